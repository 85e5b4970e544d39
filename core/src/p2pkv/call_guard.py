"""The tier's guard on its data transport: every call that may do I/O is timed against the
driver bound (``p2pkv.contracts.DRIVER_BOUND``), and one that overran it is logged.

A call into a transport runs on the tier's one driver thread: while it runs, the tick waits,
and so does every peer's work. The data contract bounds each call (docs/plugin-authors.md,
"The driver bound"); a transport that breaks the bound stalls every peer, so the tier names
the call that did it::

    WARNING p2pkv.call_guard: the nixl data transport's remove_peer took 2.013s, over the
    driver bound (0.1s): the tier's tick, and every peer's work, waited for it

Lines are rate limited (a transport that is slow on every tick logs a few lines and a
summary). Timing uses ``time.perf_counter``, not the tier's clock: a slow call is real time.
Cheap getters (``read_capacity``, ``descriptor``, ``held``) are forwarded untimed.

Whether a slow call also looked like a process pause is the pause detector's question
(:mod:`p2pkv.session.pause`); this module only measures and tells.

Threading: the tier's driver thread, like the transport it wraps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import ParamSpec, TypeVar

from p2pkv.contracts import DRIVER_BOUND, DataTransport, PollResult
from p2pkv.ratelimit import LogLimiter
from p2pkv.reference.delegating import DelegatingDataTransport

log = logging.getLogger(__name__)

P = ParamSpec("P")
R = TypeVar("R")

_BURST = 5
_WINDOW = 60.0


class GuardedDataTransport(DelegatingDataTransport):
    """``inner``, with each call that may do I/O timed against ``bound`` seconds (see the
    module docstring). Ownership: it owns ``inner`` (its ``close`` closes it). ``overruns``
    counts the calls that took longer than ``bound``; ``slowest`` is the longest call so
    far, as ``(method, seconds)``."""

    name = "guarded"

    def __init__(self, inner: DataTransport, bound: float = DRIVER_BOUND) -> None:
        super().__init__(inner)
        self.bound = bound
        self._name = _innermost(inner).name
        """The name the lines give: the real transport's, under any wrappers (recording,
        fault injection)."""
        self.overruns = 0
        self.slowest: tuple[str, float] = ("", 0.0)
        self._lines = LogLimiter(
            log, _BURST, _WINDOW, time.monotonic(), "data transport calls over the driver bound"
        )

    def _timed(self, method: str, call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
        """``call(*args, **kwargs)``, timed; an overrun of the bound is counted and logged."""
        started = time.perf_counter()
        try:
            return call(*args, **kwargs)
        finally:
            took = time.perf_counter() - started
            if took > self.bound:
                self._overran(method, took)

    def _overran(self, method: str, took: float) -> None:
        self.overruns += 1
        if took > self.slowest[1]:
            self.slowest = (method, took)
        self._lines.log(
            time.monotonic(),
            logging.WARNING,
            "the %s data transport's %s took %.3fs, over the driver bound (%gs): "
            "the tier's tick, and every peer's work, waited for it",
            self._name,
            method,
            took,
            self.bound,
        )

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self._timed("add_peer", self.inner.add_peer, peer_id, descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        return self._timed("remove_peer", self.inner.remove_peer, peer_id)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        return self._timed("read_blocks", self.inner.read_blocks, peer_id, local_idxs, remote_idxs)

    def progress(self) -> None:
        self._timed("progress", self.inner.progress)

    def poll(self, peer_id: str | None = None) -> PollResult:
        return self._timed("poll", self.inner.poll, peer_id)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        self._timed("cancel", self.inner.cancel, transfer_ids)

    def close(self) -> list[int]:
        return self._timed("close", self.inner.close)


def _innermost(transport: DataTransport) -> DataTransport:
    while isinstance(transport, DelegatingDataTransport):
        transport = transport.inner
    return transport
