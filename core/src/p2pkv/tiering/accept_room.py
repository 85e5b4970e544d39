"""Room for new peers: idle sessions peers dialed to this tier give way before the control
transport runs out of room.

A producer accepts one session per consumer that names it, and each holds the control
transport's resources (zmq: 3 sockets of the context's cap and 5 descriptors) until either
side closes it. ``peers.max_dialed`` bounds the sessions a tier dials, and the idle reaper
closes those, but accepted sessions are their consumers' to reap: a popular producer of a
large fleet fills its transport with them, and the transport then refuses the next new
consumer's connection however idle the others are (issue 48).

When the transport reports a bound (``ControlTransport.session_room``), this keeps a reserve
of free sessions: after a session opens, if fewer than :func:`reserve` are free, the
accepted sessions that are ready, idle (no request, round, lookup or pin of either role)
and were not active for :data:`MIN_IDLE` seconds close with a bye, least recently active
first, one per missing place, and it looks again at the next tick until the reserve is
back. Their consumers dial again on their next request (one handshake); a consumer the bye
reaches backs nothing off. While the reserve stays short with no session to close (every
accepted session working), it looks again every :data:`RECHECK` seconds. Sessions
this tier dialed never give way here: their own bound and reaper govern them.

Threading: driver thread only.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

from p2pkv.contracts import ControlTransport
from p2pkv.session import Session
from p2pkv.tiering.table import SessionTable, SessionWatcher

__all__ = ["MIN_IDLE", "RECHECK", "AcceptRoom", "reserve"]

MIN_IDLE = 1.0
"""Seconds an accepted session must have been inactive to give way (a consumer between two
requests keeps its session)."""
RECHECK = 1.0
"""Seconds before a reserve left short is looked at again."""
RESERVE_MAX = 8
"""Free sessions kept at most: new consumers arriving within one tick of each other."""


def reserve(total: int) -> int:
    """Free sessions to keep when the transport holds ``total``: one in 16, 1 to 8."""
    return max(1, min(RESERVE_MAX, total // 16))


class AcceptRoom(SessionWatcher):
    """See the module docstring. ``close(session, reason)`` closes a session with a bye;
    :meth:`check` runs among the tick's periodic work."""

    def __init__(
        self,
        control: ControlTransport,
        table: SessionTable,
        close: Callable[[Session, str], None],
    ) -> None:
        self._control = control
        self._table = table
        self._close = close
        self._due = math.inf
        """When to look at the room next (0: at the next tick; inf: nothing opened since)."""
        self.accepted = 0
        """Sessions peers opened with this tier (a peer's restart opens a new one)."""
        self.gave_way = 0
        """Accepted sessions closed to keep room for new peers."""

    def opened(self, session: Session) -> None:
        self._due = 0.0
        if not session.dialed:
            self.accepted += 1

    def stats(self) -> dict[str, int]:
        """``peers_accepted``, ``peers_accepted_gave_way``, ``peers_accept_refused`` (the
        transport's count), and ``sessions_free`` when the transport reports its room."""
        control = self._control
        out = {
            "peers_accepted": self.accepted,
            "peers_accepted_gave_way": self.gave_way,
            "peers_accept_refused": control.accepts_refused,
        }
        room = control.session_room()
        if room is not None:
            out["sessions_free"] = room.free
        return out

    def check(self, now: float) -> None:
        """Close idle accepted sessions while fewer than :func:`reserve` sessions are free."""
        if now < self._due:
            return
        self._due = math.inf
        room = self._control.session_room()
        if room is None:
            return
        missing = reserve(room.total) - room.free
        if missing <= 0:
            return
        idle = [
            (s.last_active, i, s)
            for i, s in enumerate(self._table.sessions.values())
            if not s.dialed and s.ready and s.idle and now - s.last_active >= MIN_IDLE
        ]
        for _, _, session in heapq.nsmallest(missing, idle):
            self.gave_way += 1
            self._close(
                session,
                f"gave way to new peers: {room.free} of the control transport's "
                f"{room.total} sessions are free",
            )
        # Closed ones: look again next tick (the transport's count may lag, and ``free``
        # stops at 0 below the deficit); none to close: once they may have idled.
        self._due = now if idle else now + RECHECK
