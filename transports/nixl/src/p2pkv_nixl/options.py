"""``data_options`` of the ``nixl`` transport: parsed once, every rejection names the key.

========================  =========  =====================================================
key                       default    meaning
========================  =========  =====================================================
``backends``              ``[UCX]``  NIXL backends to create, in order
``num_threads``           ``0``      each backend's ``num_threads`` (0: its default)
``enable_prog_thread``    ``false``  NIXL's own progress thread (spins a core)
``drain_timeout``         ``5.0``    seconds ``cancel`` drives a direct read NIXL would
                                     not release (``close``: 0.05 s at most)
``backend_params``        ``{}``     extra init parameters per backend
``warmup``                ``true``   ``add_peer`` wires the connection up with a tiny READ
``staging``               ``auto``   ``auto``/``always``/``never``: reads through the
                                     staging pool (see :mod:`p2pkv_nixl.staging`)
``staging_blocks``        ``256``    blocks in the staging pool (capped at the region's)
``slice_bytes``           3.5 GiB    largest NIXL registration: region and pool are
                                     registered in slices of this (whole blocks, at
                                     least one; see :mod:`p2pkv_nixl.slices`); env
                                     ``P2PKV_SLICE_BYTES`` sets the default
========================  =========  =====================================================
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from p2pkv.errors import ConfigError
from p2pkv.options import option, parse_options
from p2pkv.runs import SLICE_BYTES, default_slice_bytes

from p2pkv_nixl.descriptor import MAX_BLOCKS

__all__ = ["STAGING_MODES", "NixlOptions", "Staging"]

Staging = Literal["auto", "always", "never"]
STAGING_MODES: tuple[Staging, ...] = ("auto", "always", "never")
ParamValue = str | int | float | bool
"""A backend init parameter as the config gives it; NIXL gets its text (``true``/``false``)."""


@dataclass(frozen=True)
class NixlOptions:
    """Validated options (see the README's options table for the why of each default)."""

    backends: tuple[str, ...] = field(default=("UCX",), metadata=option(nonblank=True))
    """NIXL backends (plugins) to instantiate, in order."""
    num_threads: int = field(default=0, metadata=option(ge=0, le=MAX_BLOCKS))
    """Passed to each backend as its ``num_threads`` init parameter; 0 = backend default."""
    enable_prog_thread: bool = False
    """NIXL's own progress thread. Off: it spins a core and halves throughput on small hosts;
    ``progress()``/``poll()`` drive the worker instead, so the caller must tick them."""
    drain_timeout: float = field(default=5.0, metadata=option(ge=0, unit="seconds"))
    """Seconds ``cancel`` drives our worker to end a direct read NIXL would not release (on
    ``cma`` our own process does that copy, so no peer is waited for). ``close`` waits for
    internal transfers (warm-ups, serving WRITEs, quarantined staged reads) for the smaller
    of this and :data:`p2pkv.contracts.DRAIN_GRACE`; ``remove_peer`` waits for none (the
    driver bound, :data:`p2pkv.contracts.DRIVER_BOUND`)."""
    backend_params: Mapping[str, Mapping[str, ParamValue]] = field(default_factory=dict)
    """Extra init parameters per backend, e.g. ``{"UCX": {"ucx_error_handling_mode": "none"}}``."""
    warmup: bool = True
    """``add_peer`` posts a tiny READ from the peer so the connection is wired up before the
    first real read. Off: the first direct read posts it, and waits (held, unposted) for it:
    a direct read is never posted on a connection still wiring up (see the transport's
    finality rule)."""
    staging: Staging = "auto"
    """Where reads land first. ``auto``: straight into the slots when the peer is on this
    host and both sides have UCX's ``cma`` (our own process copies, so a cancel is final),
    else through the staging pool. ``always``: every read is staged. ``never``: every read
    is direct; on a lane other than ``cma`` a cancelled read may then still land in the
    slots (finality is the operator's responsibility; a warning is logged at create)."""
    staging_blocks: int = field(default=256, metadata=option(ge=1, le=MAX_BLOCKS))
    """Blocks in the staging pool (allocated on first use; capped at the region's
    ``num_blocks``). A read needs as many free blocks as it moves; blocks of a cancelled
    staged read stay quarantined until NIXL reports it ended."""

    slice_bytes: int = field(default=SLICE_BYTES, metadata=option(ge=1, unit="bytes"))
    """Largest NIXL registration, in bytes: the region (and the staging pool) is registered
    as consecutive slices of this many bytes rounded down to whole blocks (at least one
    block), and no transfer descriptor crosses a slice of either side. RDMA NICs read one
    huge registration at a fraction of line rate and some truncate one past their limit.
    Default 3.5 GiB, or ``P2PKV_SLICE_BYTES`` (:func:`p2pkv.runs.default_slice_bytes`)."""

    @classmethod
    def parse(cls, options: Mapping[str, Any]) -> NixlOptions:
        """Validate ``data_options``; ``ConfigError`` names the offending key (or
        ``P2PKV_SLICE_BYTES`` when it is malformed and ``slice_bytes`` is not given)."""
        opts = parse_options(cls, options, "nixl data option")
        if "slice_bytes" not in options:
            opts = replace(opts, slice_bytes=default_slice_bytes())
        if len(set(opts.backends)) != len(opts.backends):
            raise ConfigError(
                f"nixl data option 'backends' names a backend twice: {list(opts.backends)}"
            )
        stray = sorted(set(opts.backend_params) - set(opts.backends))
        if stray:
            raise ConfigError(
                f"nixl data option 'backend_params' names backend(s) {stray}, which are not "
                f"in 'backends' {list(opts.backends)}"
            )
        return opts

    def init_params(self, backend: str) -> dict[str, str]:
        """The init parameters ``backend`` is created with."""
        params = {"num_threads": str(self.num_threads)} if self.num_threads else {}
        params.update((k, _param_text(v)) for k, v in self.backend_params.get(backend, {}).items())
        return params


def _param_text(value: ParamValue) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)
