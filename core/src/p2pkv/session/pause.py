"""Telling that this process was paused: the gap between two ticks of the tier.

A process stopped (SIGSTOP, a frozen cgroup, a VM migrated, a stall) longer than its control
transport's silence timeout (``ControlTransport.silence_timeout``: how long peers tolerate
hearing nothing from us) has been given up on by every peer: they closed their sessions, and
failed or released what was ours. Its own sessions still look alive to it until the first
frame after the resume bounces. The tier does not wait for that: when the gap between two of
its ticks exceeds the silence timeout it closes every session at once (its loads end, their
reads cancelled; new loads dial afresh), so the engine learns on the resume, not at each load
deadline.

The tier checks twice per tick: at its start (the gap since the previous tick) and right
after its control poll (the poll's own wait allowed for): a process stopped *inside* the poll
would otherwise read the frames that queued during the pause — ``ready`` frames of a session
its peer has dropped, whose pins are gone — before it noticed.

A long gap is a pause only if the process did not run meanwhile. A tick that was slow
because of a call of the tier's own (a transport that blocked, a long garbage collection)
leaves the same gap, but the process ran all along: its heartbeats went out and its peers
kept its sessions, so closing them would fail healthy work. A watchdog thread tells the two
apart (:mod:`p2pkv.session.stop_watch`): a gap counts as a pause only when the watchdog did
not run either. A slow tick that was no pause is logged; the call that made it slow is
logged by the tier's call guard (:mod:`p2pkv.call_guard`).

The gap is read on the tier's clock. An engine that simply does not tick its tier for that
long (nothing calls ``get_finished_jobs`` / ``tick``) while the process runs is no pause:
its sessions stay, and peers that dropped them meanwhile say so on the next frame. The vLLM
adapter ticks the tier every engine step and from vLLM's tier-poll thread.

Threading: driver thread only (the watchdog runs its own thread, see its module).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from p2pkv.session.stop_watch import StopWatch

log = logging.getLogger(__name__)


class PauseDetector:
    """Measures the gap between consecutive :meth:`gap` calls on ``clock``, and asks a
    :class:`~p2pkv.session.stop_watch.StopWatch` (started here when there is a ``limit``)
    whether a long one was a stop of the process. ``watch`` replaces it (tests)."""

    __slots__ = ("_clock", "_ident", "_last", "_watch", "limit", "slow_ticks")

    def __init__(
        self, clock: Callable[[], float], limit: float | None, *, watch: StopWatch | None = None
    ) -> None:
        self._clock = clock
        self.limit = limit
        """The silence peers tolerate (None: the control transport has no such limit)."""
        self._last = clock()
        self._watch = watch if watch is not None or limit is None else StopWatch(clock, limit)
        self.slow_ticks = 0
        """Gaps longer than ``limit`` while the process ran: slow ticks, not pauses."""
        self._ident = 0
        """``threading.get_ident()`` of the thread of the latest call (the driver)."""

    def gap(self, allowed: float = 0.0) -> float | None:
        """The time since the previous call if it exceeded ``allowed`` (a wait the caller
        made on purpose, e.g. a poll's timeout) plus ``limit`` and the process was stopped
        meanwhile: a pause; else None (a long gap with the process running is logged)."""
        now = self._clock()
        since, self._last = self._last, now
        gap, limit, watch = now - since, self.limit, self._watch
        if watch is None:
            return None
        ident = threading.get_ident()
        if ident != self._ident:  # a new driver thread: the watchdog reads its CPU times
            self._ident, watch.driver = ident, threading.get_native_id()
        if limit is None or gap - allowed <= limit:
            return None
        if watch.stopped(since, now):
            return gap
        self.slow_ticks += 1
        log.warning(
            "this tier was not ticked for %.1fs, longer than the control transport's "
            "silence timeout %gs, but the process ran meanwhile: a slow tick, not a "
            "pause; its sessions are kept",
            gap,
            limit,
        )
        return None

    def close(self) -> None:
        """Stop the watchdog (the tier's shutdown). Idempotent."""
        if self._watch is not None:
            self._watch.close()
