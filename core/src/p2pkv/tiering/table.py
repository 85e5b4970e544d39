"""The tier's sessions, and the small sets that tell a tick which of them have something due.

One session per peer address (:mod:`p2pkv.session`). Besides the table by address the tier
keeps, all updated as sessions open, hear, get named and close:

- by connection: to map what the control transport reports active (``take_active``) to
  sessions, so a tick receives only the sessions whose connection had frames or died;
- the sessions to receive at the next tick whatever the transport says (new ones: their
  connection may hold frames the transport listed before the session existed);
- the sessions that *may* be working (an engine call or a frame touched them since they were
  last seen idle): ``needs_engine`` and ``stats`` walk these, never every session;
- the sessions still in their handshake, the ones with lookups of ours waiting for
  ``on_schedule_end`` and the ones with lookups of the peer's waiting for ``serve_lookups``;
- the sessions this tier dialed, least recently active first (who gives way to a new peer),
  and those of them that have heard nothing from their peer yet (dials without progress).

Closed sessions whose blocks stay pinned for their consumer linger until the lease passes.
:class:`SessionWatcher` subclasses hear of every session opened, heard from (its first
frame) and closed, with whether it was *lost* (its connection died or its handshake
expired, not a bye, an eviction or our own close).

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Collection

from p2pkv.contracts import ControlConnection
from p2pkv.session.env import SessionEnv
from p2pkv.session.session import Session, State
from p2pkv.types import Outcome

__all__ = ["SessionTable", "SessionWatcher"]

log = logging.getLogger("p2pkv.tier")


class SessionWatcher:
    """Told of session events by the table (each method a no-op here)."""

    def opened(self, session: Session) -> None:
        """``session`` was opened (dialed, accepted or restarted), its hello sent."""

    def heard(self, session: Session) -> None:
        """The first frame from ``session``'s peer arrived."""

    def closed(self, session: Session, lost: bool) -> None:
        """``session`` was closed; ``lost``: its connection died or its handshake expired."""


class SessionTable:
    """The sessions by peer (``sessions``) and the sets the module docstring lists."""

    def __init__(self, env: SessionEnv) -> None:
        self._env = env
        self.stopping = False
        """The tier is shutting down: nothing dials any more."""
        self.closed = False
        """The tier shut down: no data peer is removed one by one any more."""
        self.sessions: dict[str, Session] = {}
        self.lingering: set[Session] = set()
        """Closed sessions with blocks still pinned for their consumer (until the lease)."""
        self.dialed: OrderedDict[Session, None] = OrderedDict()
        """Sessions this tier dialed, least recently active first."""
        self.unheard: dict[Session, float] = {}
        """Dialed sessions whose peer sent nothing yet, oldest first, with when each was
        dialed."""
        self.probing: dict[Session, None] = {}
        """Sessions with lookups of ours to send at ``on_schedule_end``."""
        self.serving: dict[Session, None] = {}
        """Sessions with lookups of the peer's waiting for ``serve_lookups``."""
        self.watchers: list[SessionWatcher] = []
        self._by_conn: dict[int, Session] = {}
        self._due: dict[Session, None] = {}
        self._work: dict[Session, None] = {}
        self._handshaking: dict[Session, None] = {}

    def get(self, peer: str) -> Session | None:
        return self.sessions.get(peer)

    def __len__(self) -> int:
        return len(self.sessions)

    # -- opening and closing ----------------------------------------------------------------

    def open(
        self,
        peer: str,
        conn: ControlConnection,
        *,
        dialed: bool = False,
        handshake_timeout: float | None = None,
    ) -> Session:
        """A new session on ``conn`` (its hello sent), received at the next tick."""
        session = Session(self._env, peer, conn, dialed=dialed)
        self.sessions[peer] = session
        self._by_conn[id(conn)] = session
        self._handshaking[session] = None
        self._due[session] = None
        if dialed:
            self.dialed[session] = None
            self.unheard[session] = self._env.clock()
        session.start(handshake_timeout)
        for watcher in self.watchers:
            watcher.opened(session)
        return session

    def start(self, peer: str, conn: ControlConnection, frames: list[bytes] | None) -> Session:
        """A session on an admitted connection, fed the frames it sent while held."""
        session = self.open(peer, conn)
        if frames is not None:
            self.receive(session, frames)
        return session

    def close(
        self,
        session: Session,
        outcome: Outcome,
        reason: str,
        *,
        bye: str | None = None,
        close_conn: bool = True,
        lost: bool = False,
    ) -> None:
        """Close ``session`` (its reads end, finally), remove its data peer, and keep it
        lingering while blocks stay pinned for its consumer."""
        if self.sessions.get(session.peer) is session:
            del self.sessions[session.peer]
        if self._by_conn.get(id(session.conn)) is session:
            del self._by_conn[id(session.conn)]
        for members in (
            self.dialed,
            self.unheard,
            self.probing,
            self.serving,
            self._due,
            self._work,
            self._handshaking,
        ):
            members.pop(session, None)
        session.close(outcome, reason, bye=bye, close_conn=close_conn)
        if session.producer.n_pins:
            self.lingering.add(session)
        self._release_data_peer(session)
        for watcher in self.watchers:
            watcher.closed(session, lost)

    def close_unusable(self, session: Session) -> None:
        """Close a session that is doomed or whose connection died, with its reason."""
        doom = session.doomed
        if doom is not None:
            lost = doom.outcome is Outcome.PEER_DEAD and not doom.by_peer
            self.close(session, doom.outcome, doom.reason, bye=doom.bye, lost=lost)
        else:
            why = session.conn.close_reason
            self.close(
                session,
                Outcome.PEER_DEAD,
                f"connection to {session.peer} failed: {why}"
                if why
                else f"connection to {session.peer} lost",
                lost=True,
            )

    def _release_data_peer(self, session: Session) -> None:
        """Remove the data peer if ``session`` registered it (a newer session of the same
        address that re-registered it owns it now)."""
        peer, env = session.peer, self._env
        if self.closed or not env.data_peers.release(peer, session):
            return
        env.flush_control()  # a bye queued for the peer leaves before the drain
        undrained = env.data.remove_peer(peer)
        if undrained:
            log.warning(
                "data peer %s removed with %d internal transfer(s) undrained: %s",
                peer,
                len(undrained),
                undrained[:16],
            )

    # -- receiving --------------------------------------------------------------------------

    def receive_due(self, active: Collection[ControlConnection] | None) -> None:
        """Receive the sessions whose connection is ``active`` (every session when None) and
        the new ones, then close those whose connection died."""
        due = self._due
        if active is None:
            visit: Collection[Session] = list(self.sessions.values())
        else:
            by_conn = self._by_conn
            for conn in active:
                session = by_conn.get(id(conn))
                if session is not None and session.conn is conn:
                    due[session] = None
            if not due:
                return
            visit = due
        self._due = {}
        sessions = self.sessions
        for session in visit:
            if session.state is not State.CLOSED:
                self.receive(session)
        for session in [s for s in visit if s.doomed is not None or not s.conn.alive]:
            if sessions.get(session.peer) is session:
                self.close_unusable(session)

    def receive(self, session: Session, frames: list[bytes] | None = None) -> None:
        """Hand ``session`` its frames (``frames``, else what its connection holds); a peer
        restart found among them moves the rest to a fresh session."""
        heard, count = session.heard, session.frames_in
        rest = session.receive(frames)
        if session.frames_in != count:
            self._received(session, heard)
        while rest is not None:
            session = self._restart(session, rest)
            rest = session.receive(rest)
            self._received(session, False)

    def _received(self, session: Session, heard_before: bool) -> None:
        """``session`` got frames: it may be working, serving lookups, and was heard."""
        self._work[session] = None
        if session.producer.lookups_waiting:
            self.serving[session] = None
        if session.dialed and session in self.dialed:
            self.dialed.move_to_end(session)
        if not heard_before:
            self.unheard.pop(session, None)
            for watcher in self.watchers:
                watcher.heard(session)

    def _restart(self, old: Session, frames: list[bytes]) -> Session:
        """``old``'s peer restarted (new epoch): fail the old incarnation, start afresh on the
        same connection."""
        log.warning("peer %s restarted (new session epoch); failing its old work", old.peer)
        self.close(old, Outcome.PEER_DEAD, f"{old.peer} restarted", close_conn=False)
        return self.open(old.peer, old.conn, dialed=old.dialed)

    def reap_doomed(self) -> None:
        """Close the sessions doomed since the last pass; drop lingering sessions with no
        pins left."""
        env = self._env
        doomed, env.doomed = env.doomed, []
        for candidate in doomed:
            session = self.sessions.get(candidate.peer)
            if (
                session is not None
                and session is candidate
                and (session.doomed is not None or not session.conn.alive)
            ):
                self.close_unusable(session)
        if self.lingering:
            self.lingering = {s for s in self.lingering if s.producer.n_pins}

    # -- what may be working ----------------------------------------------------------------

    def touch(self, session: Session) -> None:
        """An engine call named ``session``'s peer: it may be working from now on."""
        self._work[session] = None
        if session.dialed and session in self.dialed:
            self.dialed.move_to_end(session)

    def any_working(self) -> bool:
        """Whether a session has work open; forgets those seen idle (a touch brings them
        back)."""
        work = self._work
        idle = []
        found = False
        for session in work:
            if session.working:
                found = True
                break
            idle.append(session)
        for session in idle:
            del work[session]
        return found

    def working(self) -> list[Session]:
        """The sessions that may be working (a superset of those that are)."""
        return list(self._work)

    def any_handshaking(self) -> bool:
        """Whether a session is still in its handshake."""
        return self._unready() > 0

    def ready_count(self) -> int:
        """Sessions ready and not doomed."""
        sessions = self.sessions
        doomed_ready = sum(
            1
            for d in self._env.doomed
            if (s := sessions.get(d.peer)) is d and s.state is State.READY
        )
        return len(self.sessions) - self._unready() - doomed_ready

    def _unready(self) -> int:
        """Sessions in their handshake (forgetting those past it)."""
        waiting = self._handshaking
        for session in [s for s in waiting if s.state is not State.HANDSHAKE]:
            del waiting[session]
        return len(waiting)
