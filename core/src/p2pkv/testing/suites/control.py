"""``ControlTransportSuite``: the ``ControlTransport``/``ControlConnection`` contract (see
:mod:`p2pkv.testing.suites`).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import pytest

from p2pkv.contracts import (
    Capabilities,
    ControlConnection,
    ControlSettings,
    ControlTransport,
    TransportKind,
)
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge
from p2pkv.testing.peers import ControlPeer, LocalControlPeer, PeerHost, pattern
from p2pkv.testing.suites.support import _SuiteBase
from p2pkv.testing.waiting import WaitTimeout, quietly, wait_until

__all__ = ["ControlTransportSuite"]

T = TypeVar("T")

STREAM_FRAMES = 600
"""Frames each way in the long-stream test: a transport that loses one frame in a hundred
passes it with a chance of about 1e-5."""
STREAM_BATCH = 50
"""Frames sent before the long-stream test waits for them (a send queue may be bounded)."""


class _Stream:
    """Frames expected on one end, in order, each once, checked as they arrive.

    A frame out of place fails at once, naming the frames lost, duplicated or reordered. A
    wait that times out names the frames still missing, not only the time waited."""

    def __init__(self, what: str, source: Callable[[], Sequence[bytes]]) -> None:
        self.what = what
        self.source = source
        self.expected: list[bytes] = []
        self.got = 0

    def check(self) -> bool:
        """Take what arrived; True once every expected frame is here."""
        for frame in self.source():
            self._place(frame)
        return self.got == len(self.expected)

    def wait(self, pumps: Sequence[Callable[[], object]], timeout: float) -> None:
        try:
            wait_until(self.check, timeout=timeout, what=self.what, pumps=pumps)
        except WaitTimeout:
            due = len(self.expected)
            raise AssertionError(
                f"{self.what}: {self.got} of {due} frames arrived within {timeout}s; "
                f"frames {self.got}..{due - 1} never did (dropped, or the connection stalled)"
            ) from None

    def _place(self, frame: bytes) -> None:
        due = self.got
        if due < len(self.expected) and frame == self.expected[due]:
            self.got += 1
            return
        try:
            index = self.expected.index(frame)
        except ValueError:
            raise AssertionError(
                f"{self.what}: a frame never sent arrived where frame {due} "
                f"was due (corrupted or misdelivered)"
            ) from None
        if index > due:
            raise AssertionError(
                f"{self.what}: frame {index} arrived where frame {due} was "
                f"due: frames {due}..{index - 1} were lost"
            )
        raise AssertionError(
            f"{self.what}: frame {index} arrived again after frame {due - 1} "
            f"(duplicated or reordered)"
        )


class _ControlPair:
    """The transport under test (wrapped as a :class:`LocalControlPeer`) and one peer.

    Every ``poll`` of the transport under test goes through :meth:`poll_local`, which records
    the inbound connections it returns, so accept-once is checked whatever the test does.
    """

    def __init__(self, local: LocalControlPeer, peer: ControlPeer, timeout: float) -> None:
        self.local = local
        self.transport: ControlTransport = local.transport
        self.peer = peer
        self.timeout = timeout
        self.inbound: list[ControlConnection] = []
        self._first: dict[int, list[bytes]] = {}

    def poll_local(self, timeout: float = 0.001) -> None:
        for conn in self.transport.poll(timeout):
            assert all(conn is not seen for seen in self.inbound), (
                "poll returned the same inbound connection twice"
            )
            first = list(conn.recv())
            assert first or not conn.alive, (
                "poll returned a live inbound connection with no frame buffered"
            )
            self.inbound.append(conn)
            self._first[id(conn)] = first

    def recv(self, conn: ControlConnection) -> list[bytes]:
        """``conn.recv()``, after the frames ``poll_local`` found buffered on an inbound one."""
        return [*self._first.pop(id(conn), ()), *conn.recv()]

    def pumps(self) -> list[Callable[[], object]]:
        return [self.poll_local, self.peer.pump]

    def accept_from_peer(self, frames: Sequence[bytes]) -> tuple[int, ControlConnection]:
        """The peer dials us and sends ``frames``; returns (peer handle, our accepted conn)."""
        before = len(self.inbound)
        handle = self.peer.connect(self.transport.local_address)
        for frame in frames:
            self.peer.send(handle, frame)
        wait_until(
            lambda: len(self.inbound) > before,
            timeout=self.timeout,
            what="our poll to return the inbound connection",
            pumps=self.pumps(),
        )
        assert len(self.inbound) == before + 1, "one peer dialed once, poll returned more"
        return handle, self.inbound[-1]

    def dial_peer(self, frames: Sequence[bytes]) -> tuple[ControlConnection, int]:
        """We dial the peer and send ``frames``; returns (our conn, the peer's handle)."""
        conn = self.transport.connect(self.peer.address)
        for frame in frames:
            conn.send(frame)
        handles: list[int] = []
        wait_until(
            lambda: _gather(handles, self.peer.accepted()),
            timeout=self.timeout,
            what="the peer's poll to return our connection with its first frame (lost?)",
            pumps=self.pumps(),
        )
        assert len(handles) == 1
        return conn, handles[0]

    def receive(self, source: Callable[[], Sequence[bytes]], count: int, what: str) -> list[bytes]:
        got: list[bytes] = []
        wait_until(
            lambda: len(_gather(got, source())) >= count,
            timeout=self.timeout,
            what=what,
            pumps=self.pumps(),
        )
        return got


class ControlTransportSuite(_SuiteBase):
    """The ``ControlTransport``/``ControlConnection`` contract. Subclass and set ``transport``."""

    kind: ClassVar[TransportKind] = "control"
    max_frame_bytes: ClassVar[int] = 64 * 1024
    liveness_timeout: ClassVar[float] = 10.0
    host: ClassVar[str] = "127.0.0.1"

    @pytest.fixture
    def make_peer(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        request: pytest.FixtureRequest,
    ) -> Iterator[Callable[..., ControlPeer]]:
        """``make_peer(mode, max_frame_bytes=None, host=None)`` -> a listening peer."""
        made: list[ControlPeer] = []

        def make(
            mode: str, max_frame_bytes: int | None = None, host: PeerHost | None = None
        ) -> ControlPeer:
            cap = max_frame_bytes or self.max_frame_bytes
            peer: ControlPeer
            if mode == "same-process":
                peer = LocalControlPeer(transport_class, transport_options, cap, self.host)
            else:
                host = host or request.getfixturevalue("peer_host")
                peer = host.control_peer(transport_class, transport_options, cap, self.host)
            made.append(peer)
            return peer

        yield make
        for peer in made:
            quietly(peer.close)

    @pytest.fixture
    def local(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> Iterator[LocalControlPeer]:
        local = LocalControlPeer(
            transport_class, transport_options, self.max_frame_bytes, self.host
        )
        yield local
        quietly(local.close)

    @pytest.fixture
    def pair(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> _ControlPair:
        return _ControlPair(local, make_peer(peer_mode), self.timeout)

    def _frames(self, count: int) -> list[bytes]:
        sizes = [1, 2, 17, 1000, self.max_frame_bytes]
        return [
            bytes([i % 251]) + pattern(i, sizes[i % len(sizes)] - 1).tobytes() for i in range(count)
        ]

    # -- setup ----------------------------------------------------------------------------

    def test_identity_and_address(self, local: LocalControlPeer) -> None:
        t = local.transport
        assert t.name and t.kind == "control"
        assert isinstance(t.local_address, str) and t.local_address

    def test_local_address_is_host_port(self, local: LocalControlPeer) -> None:
        """The tier dials ``host:port`` only (a request names its producer so): an address
        of another form could never be reached through a router."""
        from p2pkv.addressing import parse_address

        address = local.transport.local_address
        try:
            parse_address(address)
        except ConfigError as exc:
            raise AssertionError(
                f"local_address {address!r} is not host:port ({exc}); the tier dials only "
                "host:port: map it onto your medium (docs/plugin-authors.md, 'Addresses and "
                "non-IP media')"
            ) from None

    def test_unknown_option_is_refused_naming_it(
        self,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
        capabilities: Capabilities,
    ) -> None:
        key = "p2pkv_conformance_no_such_option"
        settings = ControlSettings(
            self.host, 0, self.max_frame_bytes, {**transport_options, key: 1}
        )
        with pytest.raises(ConfigError, match=key):
            transport_class.create(settings).close()

    def test_address_in_use_is_refused(
        self,
        local: LocalControlPeer,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
    ) -> None:
        from p2pkv.addressing import parse_address

        try:
            _, port = parse_address(local.address)
        except ConfigError:
            pytest.skip(f"local address {local.address!r} is not host:port")
        with pytest.raises(ConfigError):
            transport_class.create(
                ControlSettings(self.host, port, self.max_frame_bytes, transport_options)
            ).close()

    # -- delivery -------------------------------------------------------------------------

    def test_frames_arrive_in_order_each_once(self, pair: _ControlPair) -> None:
        frames = self._frames(40)
        conn, handle = pair.dial_peer(frames)
        ours = _Stream("40 frames, at the peer", lambda: pair.peer.frames(handle))
        ours.expected += frames
        ours.wait(pair.pumps(), self.timeout)
        reply = self._frames(7)[::-1]
        for frame in reply:
            pair.peer.send(handle, frame)
        theirs = _Stream("the peer's replies, at us", lambda: pair.recv(conn))
        theirs.expected += reply
        theirs.wait(pair.pumps(), self.timeout)

    def test_a_long_stream_loses_no_frame(self, pair: _ControlPair) -> None:
        """600 small frames each way, in batches, arrive in order, each once. A transport
        that loses an occasional frame (one in a hundred) fails here, naming the frames
        lost, where the short tests would likely pass it."""
        frames = [i.to_bytes(4, "big") + pattern(i, i % 61).tobytes() for i in range(STREAM_FRAMES)]
        conn, handle = pair.dial_peer(frames[:1])
        ours = _Stream("a long stream, at the peer", lambda: pair.peer.frames(handle))
        theirs = _Stream("a long stream from the peer, at us", lambda: pair.recv(conn))
        ours.expected.append(frames[0])
        for start in range(1, STREAM_FRAMES, STREAM_BATCH):
            for frame in frames[start : start + STREAM_BATCH]:
                conn.send(frame)
                ours.expected.append(frame)
                pair.peer.send(handle, frame)
                theirs.expected.append(frame)
            pair.transport.flush()
            ours.wait(pair.pumps(), self.timeout)
            theirs.wait(pair.pumps(), self.timeout)

    def test_batched_frames_arrive_in_order_each_once(self, pair: _ControlPair) -> None:
        """A transport that batches (``batch_sends()`` True) delivers what ``send`` queued
        in order, each once, whether ``flush`` or ``poll`` puts it on the wire."""
        conn, handle = pair.dial_peer(self._frames(1))
        pair.receive(lambda: pair.peer.frames(handle), 1, "the first frame")
        if not pair.transport.batch_sends():
            pytest.skip("the transport does not batch sends (batch_sends() is False)")
        frames = self._frames(40)
        for i, frame in enumerate(frames):
            conn.send(frame)
            if i % 7 == 3:
                pair.transport.flush()
            elif i % 11 == 5:
                pair.poll_local(0.0)
        pair.transport.flush()
        batched = _Stream("40 batched frames, at the peer", lambda: pair.peer.frames(handle))
        batched.expected += frames
        batched.wait(pair.pumps(), self.timeout)

    def test_inbound_connection_is_returned_once_with_its_first_frames(
        self, pair: _ControlPair
    ) -> None:
        frames = self._frames(3)
        handle = pair.peer.connect(pair.transport.local_address)
        for _ in range(20):  # dialed, nothing sent yet: nothing may be announced
            for pump in pair.pumps():
                pump()
        for frame in frames:
            pair.peer.send(handle, frame)
        wait_until(
            lambda: pair.inbound,
            timeout=self.timeout,
            what="our poll to return the inbound connection",
            pumps=pair.pumps(),
        )
        conn = pair.inbound[0]
        first = pair.recv(conn)
        assert first[0] == frames[0]
        rest = pair.receive(lambda: pair.recv(conn), len(frames) - len(first), "the other frames")
        assert first + rest == frames
        for _ in range(5):
            pair.poll_local()  # fails if the connection is returned again
        assert len(pair.inbound) == 1, "one peer dialed once, poll returned more connections"

    def test_accepted_connection_can_reply(self, pair: _ControlPair) -> None:
        handle, conn = pair.accept_from_peer([b"hello"])
        conn.send(b"welcome")
        assert pair.receive(lambda: pair.peer.frames(handle), 1, "our reply") == [b"welcome"]

    def test_session_room_counts_an_accepted_connection(self, pair: _ControlPair) -> None:
        """``session_room`` (optional): within its total, and one fewer free once a peer's
        connection is accepted; ``accepts_refused`` a count that refused nothing here."""
        before = pair.transport.session_room()
        if before is None:
            pytest.skip(f"{pair.transport.name} reports no session room (optional)")
        assert 0 <= before.free <= before.total, before
        pair.accept_from_peer([b"hello"])
        after = pair.transport.session_room()
        assert after is not None and after.total == before.total, (before, after)
        assert after.free == max(0, before.free - 1), (before, after)
        assert pair.transport.accepts_refused == 0

    def test_connect_returns_the_live_connection(self, pair: _ControlPair) -> None:
        conn = pair.transport.connect(pair.peer.address)
        assert pair.transport.connect(pair.peer.address) is conn, (
            "connect to an address with a live connection must return that connection"
        )
        assert conn.peer_address == pair.peer.address
        assert conn.alive

    def test_connections_do_not_cross_talk(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> None:
        peers = [make_peer(peer_mode) for _ in range(3)]
        pairs = [_ControlPair(local, p, self.timeout) for p in peers]
        conns = [p.dial_peer([f"to-{i}".encode()]) for i, p in enumerate(pairs)]
        for i, (p, (_, handle)) in enumerate(zip(pairs, conns, strict=True)):
            got = p.receive(functools.partial(p.peer.frames, handle), 1, f"peer {i}'s frame")
            assert got == [f"to-{i}".encode()]

    def test_frame_size_cap(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"x"])
        with pytest.raises(FrameTooLarge):
            conn.send(b"x" * (self.max_frame_bytes + 1))
        exact = b"y" * self.max_frame_bytes
        conn.send(exact)
        got = pair.receive(lambda: pair.peer.frames(handle), 2, "a frame at the cap")
        assert got == [b"x", exact]

    def test_oversized_inbound_frame_is_never_delivered(
        self, local: LocalControlPeer, make_peer: Callable[..., ControlPeer], peer_mode: str
    ) -> None:
        big_peer = make_peer(peer_mode, max_frame_bytes=self.max_frame_bytes * 4)
        pair = _ControlPair(local, big_peer, self.timeout)
        _, conn = pair.accept_from_peer([b"hi"])
        handle = pair.peer.connect(pair.transport.local_address)
        big = b"z" * (self.max_frame_bytes * 2)
        pair.peer.send(handle, big)
        pair.peer.send(handle, b"after")
        got: list[bytes] = []
        wait_until(
            lambda: b"after" in _gather(got, pair.recv(conn)) or not conn.alive,
            timeout=self.timeout,
            what="the frame after an oversized one, or the connection's death",
            pumps=pair.pumps(),
        )
        assert big not in got, "a frame above max_frame_bytes was delivered"

    # -- close and liveness ---------------------------------------------------------------

    def test_close_is_idempotent(self, pair: _ControlPair) -> None:
        conn, _ = pair.dial_peer([b"x"])
        conn.close()
        conn.close()
        assert not conn.alive
        with pytest.raises(ConnectionClosed):
            conn.send(b"after close")
        pair.transport.close()
        pair.transport.close()

    def test_close_is_visible_to_the_peer(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"x"])
        conn.close()
        wait_until(
            lambda: not pair.peer.alive(handle),
            timeout=self.liveness_timeout,
            what="the peer to see our closed connection die",
            pumps=pair.pumps(),
        )

    def test_peer_close_is_visible_to_us(self, pair: _ControlPair) -> None:
        handle, conn = pair.accept_from_peer([b"x"])
        pair.peer.close_conn(handle)
        wait_until(
            lambda: not conn.alive,
            timeout=self.liveness_timeout,
            what="our accepted connection to die after the peer closed it",
            pumps=pair.pumps(),
        )
        with pytest.raises(ConnectionClosed):
            conn.send(b"to the dead")

    def test_transport_close_is_visible_to_the_peer(self, pair: _ControlPair) -> None:
        _, handle = pair.dial_peer([b"x"])
        pair.transport.close()
        wait_until(
            lambda: not pair.peer.alive(handle),
            timeout=self.liveness_timeout,
            what="the peer to see our transport close",
            pumps=[pair.peer.pump],
        )

    def test_dead_connection_is_replaced_on_connect(self, pair: _ControlPair) -> None:
        conn, handle = pair.dial_peer([b"first"])
        pair.peer.close_conn(handle)
        wait_until(
            lambda: not conn.alive,
            timeout=self.liveness_timeout,
            what="our connection to die after the peer closed it",
            pumps=pair.pumps(),
        )
        fresh = pair.transport.connect(pair.peer.address)
        assert fresh is not conn and fresh.alive, "connect must replace a dead connection"
        fresh.send(b"second")
        handles: list[int] = []
        wait_until(
            lambda: _gather(handles, pair.peer.accepted()),
            timeout=self.timeout,
            what="the peer to accept the new connection",
            pumps=pair.pumps(),
        )
        got = pair.receive(lambda: pair.peer.frames(handles[-1]), 1, "a frame on the new one")
        assert got == [b"second"]

    @pytest.mark.parametrize("direction", ["dialed", "accepted"])
    def test_peer_killed_is_detected(
        self,
        local: LocalControlPeer,
        make_peer: Callable[..., ControlPeer],
        capabilities: Capabilities,
        direction: str,
    ) -> None:
        self._require(capabilities.cross_process, "transport does not claim cross_process")
        with PeerHost(name="p2pkv-doomed-peer") as host:
            pair = _ControlPair(local, make_peer("child-process", host=host), self.timeout)
            if direction == "dialed":
                conn, _ = pair.dial_peer([b"x"])
            else:
                _, conn = pair.accept_from_peer([b"x"])
            host.kill()
            wait_until(
                lambda: not conn.alive,
                timeout=self.liveness_timeout,
                what="alive to turn False after the peer was SIGKILLed",
                pumps=[lambda: pair.poll_local(0.01)],
            )
            with pytest.raises(ConnectionClosed):
                conn.send(b"to the dead")

    def test_silent_peer_is_detected(
        self,
        local: LocalControlPeer,
        make_peer: Callable[..., ControlPeer],
        capabilities: Capabilities,
    ) -> None:
        self._require(capabilities.cross_process, "transport does not claim cross_process")
        self._require(capabilities.heartbeats, "transport does not claim heartbeats")
        with PeerHost(name="p2pkv-frozen-peer") as host:
            pair = _ControlPair(local, make_peer("child-process", host=host), self.timeout)
            conn, _ = pair.dial_peer([b"x"])
            host.pause()
            try:
                wait_until(
                    lambda: not conn.alive,
                    timeout=self.liveness_timeout,
                    what="alive to turn False while the peer is SIGSTOPped",
                    pumps=[lambda: pair.poll_local(0.01)],
                )
            finally:
                host.kill()

    def test_connect_to_nobody_does_not_block(
        self,
        local: LocalControlPeer,
        transport_class: type[ControlTransport],
        transport_options: Mapping[str, Any],
    ) -> None:
        gone = LocalControlPeer(transport_class, transport_options, self.max_frame_bytes, self.host)
        address = gone.address
        gone.close()
        conn = local.transport.connect(address)  # must return at once
        try:
            conn.send(b"queued")
        except ConnectionClosed:
            pass  # allowed if the transport already knows the address is dead
        local.transport.poll(0.0)


# -- helpers ---------------------------------------------------------------------------------


def _gather(into: list[T], more: Iterable[T]) -> list[T]:
    into.extend(more)
    return into
