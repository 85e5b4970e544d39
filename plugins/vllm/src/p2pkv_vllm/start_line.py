"""The tier's start line: what an operator greps to learn which tier a pod runs, and how.

vLLM configures only its own ``vllm`` logger tree (0.27.1 when ``vllm.logger`` is imported;
0.32 and 0.33 from the engine's logging config, in every engine process), and a record of
any other logger reaches the output only at WARNING, through Python's last resort. So the
start line goes to :data:`START_LOGGER`, a child of ``vllm``: it is printed at vLLM's default
settings, with vLLM's own prefix, and ``VLLM_LOGGING_LEVEL`` or ``VLLM_LOGGING_CONFIG_PATH``
govern it like any vLLM line. Every other p2pkv record stays under ``p2pkv`` (docs/vllm.md,
"Logs").

The line is built from the validated ``TierConfig`` and the environment the transports read,
once the tier listens; nothing here touches a socket. Failure: none (pure formatting).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import p2pkv
from p2pkv.config import TierConfig

from p2pkv_vllm.bridge import REPLACE_ENV, UPSTREAM_TYPE

__all__ = [
    "START_LOGGER",
    "START_PREFIX",
    "log_start",
    "security_and_peers",
    "security_mode",
    "start_line",
]

START_LOGGER = "vllm.p2pkv"
"""The logger of the start line: under vLLM's own tree, so vLLM's handler prints it."""
START_PREFIX = "p2pkv tier started:"
"""How the start line begins (what the docs tell operators to grep for)."""
CURVE_DIR_ENV = "P2PKV_CURVE_DIR"
"""The zmq transport's fleet-key directory variable (``p2pkv_zmq.options.CURVE_DIR_ENV``;
named here so that this module imports no transport)."""
_CURVE_KEYS = ("server_secret_key", "client_secret_key", "allowed_client_keys")


def security_mode(config: TierConfig, environ: Mapping[str, str] | None = None) -> str:
    """The control plane's security, as the zmq transport chose it for ``config`` (the tier
    already listens, so its policy passed): CURVE from the entry's keys or the fleet's key
    directory, or no authentication; another control transport is named as such."""
    if config.control != "zmq":
        return f"set by the {config.control!r} control transport"
    options = config.control_options
    if any(options.get(key) for key in _CURVE_KEYS):
        return "CURVE (keys from control_options)"
    directory = (os.environ if environ is None else environ).get(CURVE_DIR_ENV, "")
    if directory:
        return f"CURVE (fleet keys from {CURVE_DIR_ENV}={directory})"
    if options.get("insecure"):
        return "none (insecure: anyone who reaches the port may open sessions)"
    return "none (loopback bind)"


def _peer_policy(config: TierConfig) -> str:
    peers = config.peers
    allow = ",".join(peers.allow) if peers.allow else "any"
    connect = ",".join(peers.connect) if peers.connect else "none"
    return f"allow={allow} connect={connect} max_dialed={peers.max_dialed} warm={peers.warm}"


def security_and_peers(config: TierConfig, environ: Mapping[str, str] | None = None) -> str:
    """``security ..., peers ...`` as the start line says them: what ``p2pkv check-config``
    prints too, so an operator compares the two."""
    return f"security {security_mode(config, environ)}, peers {_peer_policy(config)}"


def start_line(
    tier_type: str, address: str, config: TierConfig, environ: Mapping[str, str] | None = None
) -> str:
    """The start line of a tier built for a ``secondary_tiers`` entry of ``tier_type`` and
    listening on ``address``."""
    entry = f"type {tier_type!r}"
    if tier_type == UPSTREAM_TYPE:
        entry += f" ({REPLACE_ENV}=1: p2pkv in place of vLLM's built-in P2P tier)"
    return (
        f"{START_PREFIX} version {p2pkv.__version__}, address {address} "
        f"(dp rank {config.dp_rank}), control {config.control}, data {config.data}, "
        f"{security_and_peers(config, environ)}, entry {entry}"
    )


def log_start(tier_type: str, address: str, config: TierConfig) -> None:
    """Log :func:`start_line` at INFO on :data:`START_LOGGER` (attributed to the caller)."""
    logging.getLogger(START_LOGGER).info("%s", start_line(tier_type, address, config), stacklevel=2)
