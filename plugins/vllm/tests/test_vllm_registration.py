"""The vLLM general plugin registers P2PKVTier on vLLM's factory (``nox -s vllm``, and the
release sessions): ``"type": "p2pkv"`` everywhere, ``"type": "p2p"`` only in zero-edit mode.

Each case runs in a fresh interpreter: vLLM's plugin loader and its factory registry are
process-wide state, exactly as in an engine process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.vllm
pytest.importorskip("vllm.v1.kv_offload.tiering.factory", reason="needs vLLM (nox -s vllm)")

_PROBE = """
import json, vllm.plugins
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory as F
vllm.plugins.load_general_plugins()
print(json.dumps({t: F.get_tier_class({"type": t}).__name__ for t in ("p2pkv", "P2PKVTier",
                                                                     "p2p")}))
"""


def _classes(replace: str | None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "P2PKV_REPLACE_P2P"}
    if replace is not None:
        env["P2PKV_REPLACE_P2P"] = replace
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    found: dict[str, str] = json.loads(proc.stdout.strip().splitlines()[-1])
    return found


def test_vllm_s_plugin_loader_registers_the_tier_and_leaves_p2p_alone() -> None:
    found = _classes(None)
    assert found["p2pkv"] == found["P2PKVTier"] == "P2PKVTier"
    assert found["p2p"] != "P2PKVTier"  # vLLM's own tier, untouched without the opt-in


def test_zero_edit_mode_builds_p2pkv_for_type_p2p() -> None:
    assert _classes("1")["p2p"] == "P2PKVTier"
    assert _classes("0")["p2p"] != "P2PKVTier"
