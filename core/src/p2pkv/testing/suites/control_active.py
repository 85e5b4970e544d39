"""The kit's checks of ``ControlTransport.take_active``, mixed into
:class:`~p2pkv.testing.suites.ControlTransportSuite` (see :mod:`p2pkv.testing.suites`).

``take_active`` lets a tier visit only the connections with news. The rule it must keep is
"no lost wakeup": a connection that received frames, or stopped being alive, since the
previous call is listed, once. A transport that returns None does not track them (the tier
then visits every connection each tick); these checks skip it, naming why.

The checks use the transport as a tier does: after every ``poll`` they call ``take_active``,
drain every listed connection, and then look at every connection they were not told about.
Frames arrive through ``poll`` only (``recv`` does no I/O), so an unlisted connection holding
frames is a miss at once. A death may happen outside ``poll`` (a peer in this process closing
its end), so an unlisted death is a miss if the next ``take_active`` does not list it either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import pytest

from p2pkv.contracts import ControlConnection, ControlTransport
from p2pkv.testing.peers import ControlPeer, LocalControlPeer
from p2pkv.testing.waiting import wait_until

_PEERS = 4
"""Peers of one check: we dial the even ones, the odd ones dial us."""
_ROUNDS = 12
"""Rounds of sends; in each, several connections get frames before our next poll."""


class _Watcher:
    """The transport under test, used as a tier uses ``take_active``, checking every answer.

    ``untracked`` is True once ``take_active`` returned None (nothing more is checked).
    """

    def __init__(self, transport: ControlTransport) -> None:
        self.transport = transport
        self.conns: list[ControlConnection] = []
        self.frames: dict[int, list[bytes]] = {}
        self._alive: dict[int, bool] = {}
        self._unlisted_deaths: set[int] = set()
        self.untracked = False

    def add(self, conn: ControlConnection) -> None:
        """A connection ``connect`` returned (or ``poll``, which :meth:`poll` adds itself)."""
        if all(conn is not known for known in self.conns):
            self.conns.append(conn)
            self.frames[id(conn)] = []
            self._alive[id(conn)] = True

    def poll(self, timeout: float = 0.001) -> None:
        """``poll``, then ``take_active``, then the no-lost-wakeup check."""
        for conn in self.transport.poll(timeout):
            self.add(conn)
        active = self.transport.take_active()
        if active is None:
            self.untracked = True
            for conn in self.conns:
                self._visit(conn)
            return
        listed = list(active)
        for i, conn in enumerate(listed):
            assert all(conn is not other for other in listed[:i]), (
                f"take_active listed the connection to {conn.peer_address} twice in one call"
            )
            self.add(conn)
            self._visit(conn)
            self._unlisted_deaths.discard(id(conn))
        for conn in self.conns:
            if any(conn is seen for seen in listed):
                continue
            self._check_unlisted(conn)

    def _visit(self, conn: ControlConnection) -> None:
        self.frames[id(conn)].extend(conn.recv())
        self._alive[id(conn)] = conn.alive

    def _check_unlisted(self, conn: ControlConnection) -> None:
        missed = list(conn.recv())
        assert not missed, (
            f"take_active did not list the connection to {conn.peer_address}, which received "
            f"{len(missed)} frame(s) since the previous call (a lost wakeup: a tier would "
            "leave them unread)"
        )
        key = id(conn)
        if self._alive[key] and not conn.alive:
            assert key not in self._unlisted_deaths, (
                f"take_active did not list the connection to {conn.peer_address}, which "
                "stopped being alive, in two calls (a lost wakeup: a tier would never fail "
                "its jobs)"
            )
            self._unlisted_deaths.add(key)


class ActiveConnectionChecks:
    """``take_active`` never misses a connection with news (see the module docstring).

    Uses the suite's ``local``, ``make_peer`` and ``peer_mode`` fixtures and ``timeout``.
    """

    timeout: ClassVar[float]
    liveness_timeout: ClassVar[float]

    def test_take_active_never_misses_a_connection(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> None:
        watcher = _Watcher(local.transport)
        if local.transport.take_active() is None:
            pytest.skip(
                "the transport does not track active connections (take_active() is "
                "None): the tier visits every connection, as before"
            )
        peers = [make_peer(peer_mode) for _ in range(_PEERS)]
        handles = [self._open(watcher, peer, i) for i, peer in enumerate(peers)]
        if watcher.untracked:
            pytest.skip("take_active() returned None while connections opened")
        sent: dict[int, list[bytes]] = {i: [] for i in range(_PEERS)}
        pumps = [watcher.poll, *(peer.pump for peer in peers)]
        for round_ in range(_ROUNDS):
            for i, (peer, handle) in enumerate(zip(peers, handles, strict=True)):
                for k in range((round_ + i) % 3):  # 0-2 frames: several peers each round
                    frame = f"{i}:{round_}:{k}".encode()
                    peer.send(handle, frame)
                    sent[i].append(frame)
            for peer in peers:
                peer.pump()
            watcher.poll()
        ours = [self._ours(watcher, peer) for peer in peers]
        wait_until(
            lambda: all(watcher.frames[id(c)] == sent[i] for i, c in enumerate(ours)),
            timeout=self.timeout,
            what="every peer's frames, each listed connection drained",
            pumps=pumps,
        )
        for peer, handle in list(zip(peers, handles, strict=True))[1::2]:
            peer.close_conn(handle)
        wait_until(
            lambda: not any(c.alive for c in ours[1::2]),
            timeout=self.liveness_timeout,
            what="the connections whose peers closed them to die",
            pumps=pumps,
        )
        watcher.poll()  # a death listed late is listed by now

    def _open(self, watcher: _Watcher, peer: ControlPeer, i: int) -> int:
        """A connection with ``peer`` (we dial the even ones, the odd ones dial us, sending a
        first frame); the peer's handle."""
        if i % 2 == 0:
            conn = watcher.transport.connect(peer.address)
            watcher.add(conn)
            conn.send(b"hello")
            got: list[int] = []

            def accepted() -> list[int]:
                got.extend(peer.accepted())
                return got

            wait_until(
                accepted,
                timeout=self.timeout,
                what="the peer to accept our dial",
                pumps=[watcher.poll, peer.pump],
            )
            return got[0]
        handle = peer.connect(watcher.transport.local_address)
        peer.send(handle, b"hello")
        wait_until(
            lambda: any(c.peer_address == peer.address for c in watcher.conns),
            timeout=self.timeout,
            what="our poll to return the peer's dial",
            pumps=[peer.pump, watcher.poll],
        )
        return handle

    @staticmethod
    def _ours(watcher: _Watcher, peer: ControlPeer) -> ControlConnection:
        """Our connection with ``peer``, its first frame (``hello``) dropped from the record."""
        conn = next(c for c in watcher.conns if c.peer_address == peer.address)
        record = watcher.frames[id(conn)]
        if record[:1] == [b"hello"]:
            del record[0]
        return conn
