"""Registering ``P2PKVTier`` with vLLM's tier factory, from a vLLM general plugin.

vLLM runs every ``vllm.general_plugins`` entry point in each of its processes before it
builds anything (p2pkv-vllm declares ``p2pkv = "p2pkv_vllm.registration:register"``). So on
every release, including those whose factory has no ``module_path`` (0.27.1 resolves
``type`` through its registry only), an entry ``{"type": "p2pkv", ...}`` or
``{"type": "P2PKVTier", ...}`` builds p2pkv's tier; ``module_path`` keeps working where the
factory has it.

**Zero-edit mode.** With ``P2PKV_REPLACE_P2P=1`` in the engine's environment, the type
``p2p`` (vLLM's built-in P2P tier) builds ``P2PKVTier`` instead, and the tier accepts every
key the built-in tier takes, with its meaning (:data:`p2pkv_vllm.bridge.UPSTREAM_KEYS`): the
llm-d guide's ``{"type": "p2p", "host": "$(POD_IP)", "port": 7777}`` moves its blocks
through p2pkv unedited. Without the variable nothing of vLLM's is replaced.

Registration is idempotent (vLLM may load plugins more than once per process) and never
raises into vLLM: a vLLM without the tier factory is logged at INFO and left alone; a bad
``P2PKV_REPLACE_P2P`` value raises ``ConfigError`` naming it (the engine must not start
silently with the other tier).
"""

from __future__ import annotations

from p2pkv.logs import module_logger

from p2pkv_vllm.bridge import REPLACE_ENV, UPSTREAM_TYPE, replace_requested

__all__ = ["TIER_NAMES", "register"]

log = module_logger(__name__)

TIER_NAMES = ("p2pkv", "P2PKVTier")
"""Tier types registered for p2pkv's tier on every release."""


def _load_tier() -> type:
    from p2pkv_vllm.adapter import P2PKVTier

    return P2PKVTier


def register() -> None:
    """The general plugin: register :data:`TIER_NAMES` (and, in zero-edit mode, ``p2p``)
    with vLLM's ``SecondaryTierFactory``."""
    replace = replace_requested()
    try:
        from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
    except ImportError as exc:
        log.info(
            "p2pkv: this vLLM has no secondary tier factory (%s); P2PKVTier not registered", exc
        )
        return
    registry = SecondaryTierFactory._registry
    for name in TIER_NAMES:
        registry.setdefault(name, _load_tier)
    if replace and registry.get(UPSTREAM_TYPE) is not _load_tier:
        registry[UPSTREAM_TYPE] = _load_tier
        log.info(
            "p2pkv: %s=1: secondary tier type 'p2p' builds p2pkv's P2PKVTier, not "
            "vLLM's built-in P2P tier",
            REPLACE_ENV,
        )
