"""``peers.idle_timeout``: closing the sessions this tier dialed once they carry nothing.

A session holds sockets of the control transport and a data peer (registered memory
descriptors) for as long as it is open. Requests naming many peers once each (a busy prefix
cache spread over a fleet, or a client naming bogus peers that did answer) would otherwise
keep every one of them open forever. A dialed session that has no request, round, lookup
or pin of either role and received no frame for ``idle_timeout`` seconds is closed with a
bye; the next request naming the peer dials again (one handshake). Sessions peers dialed to
us are theirs to reap, and warm sessions (``peers.connect``'s peers the tier keeps) are kept
on purpose.

Each dialed session has one timer on the tier's deadline heap, due ``idle_timeout`` after it
was last active; nothing walks the sessions. A timer that finds its session active since is
moved to the new due time; one that finds it working, in its handshake or kept looks again
a quarter of ``idle_timeout`` later (at most :data:`RECHECK` seconds).

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from p2pkv.session import Session
from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.session import State
from p2pkv.tiering.table import SessionWatcher

RECHECK = 30.0
"""Seconds at most before a session that was not closable is looked at again."""


class IdleReaper(SessionWatcher):
    """Closes dialed sessions idle for ``idle_timeout`` (0: none, ever) through ``close``;
    ``kept(peer)``: whether the peer's session is kept warm."""

    def __init__(
        self,
        idle_timeout: float,
        deadlines: Deadlines,
        clock: Callable[[], float],
        close: Callable[[Session, str], None],
        kept: Callable[[str], bool],
    ) -> None:
        self.idle_timeout = idle_timeout
        self._recheck = min(idle_timeout / 4, RECHECK)
        self._deadlines = deadlines
        self._clock = clock
        self._close = close
        self._kept = kept
        self._timers: dict[Session, Timer] = {}
        self.reaped = 0
        """Sessions closed for being idle."""

    def opened(self, session: Session) -> None:
        if self.idle_timeout and session.dialed:
            self._arm(session, session.last_active + self.idle_timeout)

    def closed(self, session: Session, lost: bool) -> None:
        self._deadlines.cancel(self._timers.pop(session, None))

    def _arm(self, session: Session, when: float) -> None:
        self._timers[session] = self._deadlines.at(when, self._due, session)

    def _due(self, session: Session) -> None:
        del self._timers[session]
        if session.state is State.CLOSED:
            return
        now = self._clock()
        since = session.last_active + self.idle_timeout
        if since > now:
            self._arm(session, since)
        elif not (session.ready and session.idle) or self._kept(session.peer):
            self._arm(session, now + self._recheck)
        else:
            self.reaped += 1
            self._close(session, f"idle for {self.idle_timeout:g}s (peers.idle_timeout)")
