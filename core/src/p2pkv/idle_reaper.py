"""``peers.idle_timeout``: closing the sessions this tier dialed once they carry nothing.

A session holds sockets of the control transport and a data peer (registered memory
descriptors) for as long as it is open. Requests naming many peers once each (a busy prefix
cache spread over a fleet, or a client naming bogus peers that did answer) would otherwise
keep every one of them open forever. A dialed session that has no request, round, lookup
or pin of either role and received no frame for ``idle_timeout`` seconds is closed with a
bye; the next request naming the peer dials again (one handshake). Sessions peers dialed to
us are theirs to reap, and sessions to ``peers.connect``'s peers are kept warm on purpose.

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Container, Iterable

from p2pkv.session import Session

__all__ = ["IdleReaper"]

_MAX_SWEEP_INTERVAL = 30.0
"""Sessions are checked every ``idle_timeout / 4`` seconds, at most this."""


class IdleReaper:
    """Which dialed sessions have been idle for ``idle_timeout`` (0: none, ever)."""

    def __init__(self, idle_timeout: float, now: float) -> None:
        self.idle_timeout = idle_timeout
        self._interval = min(idle_timeout / 4, _MAX_SWEEP_INTERVAL)
        self._next_sweep = now + self._interval
        self.reaped = 0
        """Sessions closed for being idle."""

    def due(self, now: float, sessions: Iterable[Session], kept: Container[str]) -> list[Session]:
        """The sessions to close now (counted as reaped): at most once per sweep interval,
        the ready dialed sessions not in ``kept`` idle since ``now - idle_timeout``."""
        if not self.idle_timeout or now < self._next_sweep:
            return []
        self._next_sweep = now + self._interval
        cutoff = now - self.idle_timeout
        idle = [s for s in sessions
                if s.dialed and s.ready and s.last_active <= cutoff and s.idle
                and s.peer not in kept]
        self.reaped += len(idle)
        return idle
