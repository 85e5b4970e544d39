"""``data_options`` of the ``ucx`` data transport: names, defaults, validation.

Every key is optional; an unknown key or a value of the wrong type or range raises
``ConfigError`` naming the key. See the package README for the trade-offs behind each default.

``P2PKV_UCX_ENDPOINT_ERROR_HANDLING`` (``1``/``0``, ``true``/``false``) replaces the default of
``endpoint_error_handling`` for processes that cannot pass options (``p2pkv bench`` targets);
an explicit option still wins. ``P2PKV_SLICE_BYTES`` likewise replaces the default of
``slice_bytes`` (:func:`p2pkv.runs.default_slice_bytes`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.options import option, parse_options
from p2pkv.runs import SLICE_BYTES, default_slice_bytes

__all__ = ["ERROR_HANDLING_ENV", "UcxOptions"]

ERROR_HANDLING_ENV = "P2PKV_UCX_ENDPOINT_ERROR_HANDLING"
_BOOLS = {"1": True, "true": True, "0": False, "false": False}
_SECONDS = option(ge=0, unit="seconds")
_BYTES = option(ge=1, unit="bytes")


@dataclass(frozen=True)
class UcxOptions:
    endpoint_error_handling: bool = True
    """UCX PEER error handling on our endpoints. True (default): a dead peer fails our requests
    with an error; on one host UCX then moves payload over TCP (about 1 GB/s here). False: the
    zero-copy CMA path (several GB/s), but UCX has no failure path for it: a peer that dies
    while we pull a block from it **aborts this process** inside UCX (measured), and requests
    to a peer that vanished never complete (``transfer_timeout`` then fails them)."""
    transfer_timeout: float = field(default=60.0, metadata=_SECONDS)
    """Seconds from submit after which a read that has not arrived is failed (0 = never), and
    after which a send serving a peer's read is given up (kept as an orphan until UCX lets go
    of it). Failing a read is final at once (its bytes can only land in staging). Keep it
    above the tier's load timeout."""
    drain_timeout: float = field(default=2.0, metadata=_SECONDS)
    """Seconds the sends serving a removed peer's reads may still run, progressed by later
    pumps, before they are given up (orphaned). ``remove_peer`` never waits for them, and
    ``close`` at most :data:`p2pkv.contracts.DRAIN_GRACE` (the driver bound). Reads never
    wait: they end at once."""
    max_message_bytes: int = field(default=8 * 1024 * 1024, metadata=_BYTES)
    """Largest coalesced message: index runs contiguous on both sides of a read travel as one
    message of up to this many bytes (at least one block). Advertised to peers; a read uses
    the smaller of the two sides' values."""
    slice_bytes: int = field(default=SLICE_BYTES, metadata=_BYTES)
    """No message crosses a boundary of ``slice_bytes`` (rounded down to whole blocks, at
    least one) of our region, nor of the peer's (it advertises its own). ucxx registers no
    region: UCX registers each message's buffer when it sends it (zero-copy rendezvous,
    through its registration cache), so bounded messages that never span a slice are the
    whole of slicing here (RDMA NICs read one huge registration slowly, and some truncate
    one past their limit)."""
    coalesce: bool = True
    """Coalesce contiguous runs (see ``max_message_bytes``); False sends one message per block."""
    staging_bytes: int = field(default=32 * 1024 * 1024, metadata=_BYTES)
    """Bytes of staging buffers the reads of this transport may receive into at once (at least
    two largest messages), shared by peers in shares (:mod:`p2pkv_ucx.staging`). Every
    arriving run is received into staging and copied into its slots only once it arrived
    whole, which is what makes ``cancel`` final; runs beyond a peer's share or the budget
    wait inside UCX (a rendezvous run moves no payload until taken)."""
    ucx_config: Mapping[str, str] = field(default_factory=dict)
    """UCX settings for this transport's UCX context only, without the ``UCX_`` prefix (for
    example ``{"TLS": "tcp"}``); the process environment is not touched."""

    @classmethod
    def from_mapping(
        cls, options: Mapping[str, Any], environ: Mapping[str, str] | None = None
    ) -> UcxOptions:
        """Validate ``data_options`` (``ConfigError`` names the key), with the default of
        ``endpoint_error_handling`` from ``ERROR_HANDLING_ENV`` in ``environ`` (default:
        ``os.environ``); a malformed variable is refused even when the option is given."""
        env = os.environ if environ is None else environ
        opts = parse_options(cls, options, "ucx data option")
        if "slice_bytes" not in options:
            opts = replace(opts, slice_bytes=default_slice_bytes(env))
        raw = env.get(ERROR_HANDLING_ENV)
        if raw is None:
            return opts
        if raw.strip().lower() not in _BOOLS:
            raise ConfigError(f"{ERROR_HANDLING_ENV}={raw!r}: use 1, 0, true or false")
        if "endpoint_error_handling" in options:
            return opts
        return replace(opts, endpoint_error_handling=_BOOLS[raw.strip().lower()])
