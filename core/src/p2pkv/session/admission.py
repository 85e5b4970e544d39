"""Admission of inbound connections: which connection gets the session of an address
(docs/protocol.md §4.1 items 6 and 7).

A new connection claiming the address of a **usable** session does not replace it (anyone
reaching the control port could claim any address): it is held, unserved, and at most
:data:`NEWCOMER_MAX_FRAMES` of its frames are read. It takes over once that session's
connection ends, or at once when its hello shows the epoch of the session's own peer (the
peer re-dialled: it gave the old session up). It is closed if it sends more frames, if a
newer connection claims the address, if the tier stops, or if the old session is still
usable ``timeouts.handshake`` after it arrived.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from p2pkv.contracts import ControlConnection
from p2pkv.errors import ProtocolError
from p2pkv.protocol import Hello, decode
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv
from p2pkv.session.session import Session
from p2pkv.types import Outcome

log = logging.getLogger(__name__)

NEWCOMER_MAX_FRAMES = 4
"""Frames a held newcomer may send: a conforming peer sends its hello and waits for ours."""


class _Newcomer:
    """A new inbound connection claiming the address of a live session, held unserved."""

    __slots__ = ("conn", "frames", "timer")

    def __init__(self, conn: ControlConnection, timer: Timer) -> None:
        self.conn = conn
        self.frames: list[bytes] = []
        self.timer = timer


class Admission:
    """Held newcomers by address. ``sessions`` is the tier's live sessions by address;
    ``start`` opens a session on a connection (fed ``frames`` if given), ``close`` and
    ``close_unusable`` close one as the tier does."""

    def __init__(
        self,
        env: SessionEnv,
        sessions: Mapping[str, Session],
        *,
        start: Callable[[str, ControlConnection, list[bytes] | None], Session],
        close: Callable[[Session, Outcome, str], None],
        close_unusable: Callable[[Session], None],
    ) -> None:
        self._env = env
        self._sessions = sessions
        self._start = start
        self._close = close
        self._close_unusable = close_unusable
        self._held: dict[str, _Newcomer] = {}
        self._stopped = False

    def accept(self, conn: ControlConnection) -> None:
        """A new inbound connection: start its session, or hold it (see the module doc)."""
        peer = conn.peer_address
        if self._stopped:
            conn.close()
            return
        old = self._sessions.get(peer)
        if old is not None:
            if old.conn is conn:
                return
            if old.usable:
                self._hold(peer, conn)
                return
            self._close_unusable(old)
        self._start(peer, conn, None)

    def __contains__(self, peer: str) -> bool:
        return peer in self._held

    def __len__(self) -> int:
        return len(self._held)

    def serve(self) -> None:
        """Read held newcomers (a few frames at most) and start the session of each whose
        address has no usable session any more."""
        for peer, newcomer in list(self._held.items()):
            conn = newcomer.conn
            if not conn.alive:
                self._drop(peer, newcomer, "its connection ended", level=logging.INFO)
                continue
            newcomer.frames += conn.recv()
            if len(newcomer.frames) > NEWCOMER_MAX_FRAMES:
                self._drop(
                    peer,
                    newcomer,
                    f"it sent {len(newcomer.frames)} frames before its session could start",
                )
                continue
            old = self._sessions.get(peer)
            if old is not None and old.usable and self._redials(old, newcomer.frames):
                self._close(
                    old,
                    Outcome.PEER_DEAD,
                    f"{peer} dialled again with the same epoch: it had given this "
                    f"session up (paused or cut off for longer than its timeouts?)",
                )
            if old is None or not old.usable:
                self.promote(peer)

    def promote(self, peer: str) -> Session:
        """Start the held newcomer's session, the old one (unusable or gone) closed first."""
        newcomer = self._held.pop(peer)
        self._env.deadlines.cancel(newcomer.timer)
        old = self._sessions.get(peer)
        if old is not None:
            self._close_unusable(old)
        log.info("the held connection from %s takes over: its previous connection ended", peer)
        return self._start(peer, newcomer.conn, newcomer.frames)

    def stop(self) -> None:
        """The tier shuts down: close held newcomers, refuse new connections."""
        self._stopped = True
        for peer, newcomer in list(self._held.items()):
            self._drop(peer, newcomer, "tier shut down", level=logging.INFO)

    def _hold(self, peer: str, conn: ControlConnection) -> None:
        previous = self._held.pop(peer, None)
        if previous is not None:
            self._drop(peer, previous, "a newer connection claims the same address")
        wait = self._env.timeouts.handshake
        log.warning(
            "a new connection claims the address of live peer %s; it is held until "
            "that peer's connection ends (at most %.1fs)",
            peer,
            wait,
        )
        timer = self._env.deadlines.at(self._env.clock() + wait, self._expired, peer)
        self._held[peer] = _Newcomer(conn, timer)

    def _redials(self, old: Session, frames: list[bytes]) -> bool:
        """The held newcomer is ``old``'s peer itself, re-dialling: its hello carries the
        epoch of ``old``'s peer. A tier keeps one session per peer, so that peer has given
        ``old`` up (it paused or was cut off past a timeout and resumed, while our side of
        the connection still looks alive). The 64-bit epoch is random per incarnation and
        sent only to its peer (under CURVE, encrypted): a claimant that is not that peer
        cannot show it."""
        known = old.peer_hello
        if known is None or not frames:
            return False
        try:
            hello = decode(frames[0], self._env.limits)
        except ProtocolError:
            return False  # its session will say why, if it ever starts
        return isinstance(hello, Hello) and hello.epoch == known.epoch

    def _expired(self, peer: str) -> None:
        wait = self._env.timeouts.handshake
        self._drop(
            peer,
            self._held[peer],
            f"the live session with that address did not end within {wait}s (an impostor?)",
        )

    def _drop(
        self, peer: str, newcomer: _Newcomer, why: str, *, level: int = logging.WARNING
    ) -> None:
        self._held.pop(peer, None)
        self._env.deadlines.cancel(newcomer.timer)
        newcomer.conn.close()
        log.log(level, "closed a held connection claiming address %s: %s", peer, why)
