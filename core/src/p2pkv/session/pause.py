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

The gap is read on the tier's clock, so an engine that simply does not tick its tier for
that long (nothing calls ``get_finished_jobs`` / ``tick``) is treated the same: its sessions
are then closed and new requests make new ones (one handshake). The vLLM adapter ticks the
tier every engine step and from vLLM's tier-poll thread, so only a stalled process shows
such a gap.

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable

__all__ = ["PauseDetector"]


class PauseDetector:
    """Measures the gap between consecutive :meth:`gap` calls on ``clock``."""

    __slots__ = ("_clock", "_last", "limit")

    def __init__(self, clock: Callable[[], float], limit: float | None) -> None:
        self._clock = clock
        self.limit = limit
        """The silence peers tolerate (None: the control transport has no such limit)."""
        self._last = clock()

    def gap(self, allowed: float = 0.0) -> float | None:
        """The time since the previous call if it exceeded ``allowed`` (a wait the caller
        made on purpose, e.g. a poll's timeout) plus ``limit``: a pause; else None."""
        now = self._clock()
        gap, self._last = now - self._last, now
        limit = self.limit
        return gap if limit is not None and gap - allowed > limit else None
