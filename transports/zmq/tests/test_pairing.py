"""The link-pairing protocol alone (``p2pkv_zmq.pairing``): two peers over a simulated network,
no socket and no clock.

Each side is a :class:`LinkPairing` with a fake port. A PUSH is a stream: a FIFO of messages
to the other side's PULL. Streams are delivered in any interleaving (they are separate TCP
connections), each in order. Hypothesis dials, sends, closes, disconnects, delivers and lets
time pass in any order; then the network is drained and the two sides must agree:

- every frame a connection received came from one peer PUSH, the one it is paired with;
- a live connection that sent frames is paired (the peer answered it, or said "gone");
- two live connections paired with each other hold every frame the other sent, in order.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Hashable
from dataclasses import dataclass, field

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from p2pkv_zmq.connection import LinkLimits, PeerAddress, ZmqConnection
from p2pkv_zmq.identity import link_id
from p2pkv_zmq.pairing import GONE, OPEN, REFUSED, RETELL_INTERVAL, LinkPairing, classify

ADDRESSES = ("127.0.0.1:1001", "127.0.0.1:1002")
LIMITS = LinkLimits(1 << 16, 100)
_INCARNATIONS = itertools.count(1)


def _incarnation() -> bytes:
    return b"%016x" % next(_INCARNATIONS)


@dataclass(eq=False)
class Stream:
    """One PUSH's messages on their way to ``to``'s PULL, in order."""

    to: int
    messages: list[list[bytes]] = field(default_factory=list)
    closed: bool = False


class Side:
    """One peer: its pairing protocol, and the fake I/O its port does."""

    batching = False

    def __init__(self, index: int, net: Net) -> None:
        self.index = index
        self.address = ADDRESSES[index]
        self.net = net
        self.counters = {"accepted": 0, "dropped_messages": 0}
        self.pairing = LinkPairing(self, self.counters)
        self.conns: list[ZmqConnection] = []
        self.streams: dict[ZmqConnection, Stream] = {}
        self.received: dict[ZmqConnection, list[bytes]] = {}
        self.sent: dict[ZmqConnection, list[bytes]] = {}

    # -- what the hub does (connect, dial, retire) ------------------------------------------

    def connect(self) -> ZmqConnection:
        key = ADDRESSES[1 - self.index]
        conn = self.pairing.connection_to(key)
        if conn is not None:
            return conn
        answering = self.pairing.answerable(key)
        conn = self._dial(key, answering)
        if answering is not None:
            self.pairing.confirm(conn, answering, self.net.now)
        return conn

    def _dial(self, key: str, answering: bytes | None) -> ZmqConnection:
        incarnation = _incarnation()
        link = link_id(self.address, incarnation)
        stream = self.net.open(ADDRESSES.index(key))
        ref = b"" if answering is None else answering.rpartition(b"#")[2]
        stream.messages.append([link, b"", OPEN, ref])
        conn = ZmqConnection(
            self,
            LIMITS,
            PeerAddress(key, key),
            out=stream,  # type: ignore[arg-type]
            monitor=None,
            incarnation=incarnation,
            link=link,
            deadline=0.0,
        )
        self.pairing.add(conn)
        self.conns.append(conn)
        self.streams[conn] = stream
        self.sent[conn] = []
        return conn

    def send(self, conn: ZmqConnection) -> None:
        frame = b"%s|%d" % (conn.link, len(self.sent[conn]))
        self.sent[conn].append(frame)
        self.streams[conn].messages.append([conn.link, frame])

    def receive(self, parts: list[bytes]) -> None:
        """What the poller and the hub do with a message on our PULL."""
        conn = self.pairing.routes.get(parts[0]) if len(parts) == 2 else None
        if conn is not None:
            conn.inbox.append(parts[1])
            self.pairing.news(conn)
        else:
            kind = classify(parts)
            assert not isinstance(kind, str), kind  # the fake peers send nothing malformed
            self.pairing.on_message(parts, kind[0], kind[1], self.net.now)
        self.collect()

    def collect(self) -> None:
        for conn in self.conns:
            self.received.setdefault(conn, []).extend(conn.recv())

    # -- the LinkPort -----------------------------------------------------------------------

    def dial_back(self, address: str, link: bytes) -> ZmqConnection | None:
        return self._dial(address, link)

    def send_link(self, conn: ZmqConnection, verb: bytes, arg: bytes) -> bool:
        stream = self.streams[conn]
        if stream.closed:
            return False
        stream.messages.append([conn.link, b"", verb, arg])
        return True

    def notice(self, address: str, incarnation: bytes) -> bool:
        stream = self.net.open(ADDRESSES.index(address))
        stream.messages.append([link_id(self.address, _incarnation()), b"", GONE, incarnation])
        stream.closed = True  # lingers to deliver it
        return True

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        if conn.close_reason is not None:
            return
        conn.close_reason = reason
        if not notify:
            conn.out = None  # LINGER 0: what the pairing would queue on it now is lost
        link = self.pairing.forget(conn, self.net.now)
        stream = self.streams[conn]
        if notify:
            target = b"" if link is None else link.rpartition(b"#")[2]
            stream.messages.append([conn.link, b"", GONE, target])
        else:  # LINGER 0: what libzmq had not sent is lost
            stream.messages.clear()
        stream.closed = True
        conn.out = None

    def queued(self, conn: ZmqConnection) -> None:
        raise AssertionError("the simulation never batches")

    def dropped(self, link: bytes, why: str, level: int = logging.WARNING) -> None:
        self.counters["dropped_messages"] += 1

    def warn_once(self, key: Hashable, msg: str, *args: object) -> None:
        pass


class Net:
    """Both sides, their streams, and a clock that moves only when a rule says so."""

    def __init__(self) -> None:
        self.now = 0.0
        self.streams: list[Stream] = []
        self.sides = (Side(0, self), Side(1, self))

    def open(self, to: int) -> Stream:
        stream = Stream(to)
        self.streams.append(stream)
        return stream

    def pending(self) -> list[Stream]:
        return [s for s in self.streams if s.messages]

    def deliver(self, stream: Stream) -> None:
        parts = stream.messages.pop(0)
        self.sides[stream.to].receive(parts)

    def drain(self) -> None:
        for _ in range(10_000):
            pending = self.pending()
            if not pending:
                return
            self.deliver(pending[0])
        raise AssertionError("the link messages never settle")


class Pairing(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.net = Net()

    def _live(self, side: int) -> list[ZmqConnection]:
        return [c for c in self.net.sides[side].conns if c.alive]

    @rule(side=st.integers(0, 1))
    def dial(self, side: int) -> None:
        self.net.sides[side].connect()

    @precondition(lambda self: self._live(0) or self._live(1))
    @rule(side=st.integers(0, 1), pick=st.integers(0, 7), count=st.integers(1, 3))
    def send(self, side: int, pick: int, count: int) -> None:
        live = self._live(side)
        if live:
            for _ in range(count):
                self.net.sides[side].send(live[pick % len(live)])

    @precondition(lambda self: self._live(0) or self._live(1))
    @rule(side=st.integers(0, 1), pick=st.integers(0, 7))
    def close(self, side: int, pick: int) -> None:
        live = self._live(side)
        if live:
            self.net.sides[side].retire(live[pick % len(live)], "closed locally")

    @precondition(lambda self: self._live(0) or self._live(1))
    @rule(side=st.integers(0, 1), pick=st.integers(0, 7))
    def disconnect(self, side: int, pick: int) -> None:
        """The PUSH disconnected after its handshake (the monitor's path)."""
        live = self._live(side)
        if live:
            conn = live[pick % len(live)]
            link = conn.remote_link
            owner = self.net.sides[side]
            owner.retire(conn, "disconnected", notify=False)
            if link is not None:
                owner.pairing.tell_gone(link, self.net.now)

    @precondition(lambda self: bool(self.net.pending()))
    @rule(pick=st.integers(0, 15), count=st.integers(1, 4))
    def deliver(self, pick: int, count: int) -> None:
        for _ in range(count):
            pending = self.net.pending()
            if not pending:
                return
            self.net.deliver(pending[pick % len(pending)])

    @rule()
    def time_passes(self) -> None:
        self.net.now += RETELL_INTERVAL

    @invariant()
    def one_sender_per_connection(self) -> None:
        for side in self.net.sides:
            for conn, frames in side.received.items():
                senders = {f.rpartition(b"|")[0] for f in frames}
                assert len(senders) <= 1, f"{conn} got frames of {senders}"
                if senders and conn.remote_link is not None:
                    assert senders == {conn.remote_link}, (conn.remote_link, senders)

    def teardown(self) -> None:
        self.net.drain()
        self.check_agreement()

    def check_agreement(self) -> None:
        a, b = self.net.sides
        for here, there in ((a, b), (b, a)):
            for conn in self._live(here.index):
                if conn.remote_link is None:
                    assert not here.sent[conn], (
                        f"{conn} sent frames, yet the peer neither paired it nor said gone"
                    )
                    continue
                peer = next((c for c in there.conns if c.link == conn.remote_link), None)
                assert peer is not None, f"{conn} is paired with a PUSH the peer never had"
                if not peer.alive:
                    continue  # its death is on its way (a disconnect is not told here)
                assert peer.remote_link == conn.link, "the two sides paired differently"
                assert here.received.get(conn, []) == there.sent[peer], (
                    "a live pair lost, reordered or duplicated frames"
                )


TestPairing = Pairing.TestCase


def answered(net: Net) -> tuple[ZmqConnection, ZmqConnection]:
    """Side A dials B and sends a frame; B answers: (A's connection, B's)."""
    a, b = net.sides
    ours = a.connect()
    a.send(ours)
    net.drain()
    return ours, next(c for c in b.conns if c.alive)


def test_an_answer_completes_the_dial_and_frames_flow_both_ways() -> None:
    net = Net()
    a, b = net.sides
    ours, theirs = answered(net)
    b.send(theirs)
    net.drain()
    assert ours.remote_link == theirs.link and theirs.remote_link == ours.link
    assert b.received[theirs] == a.sent[ours] and a.received[ours] == b.sent[theirs]
    assert a.pairing.take_active() == [ours] and b.pairing.take_active() == [theirs]
    assert a.pairing.take_active() == []


def test_both_dialing_at_once_agree_on_one_connection() -> None:
    net = Net()
    a, b = net.sides
    ours, theirs = a.connect(), b.connect()
    a.send(ours)
    b.send(theirs)
    net.drain()
    assert ours.alive and theirs.alive
    assert ours.remote_link == theirs.link and theirs.remote_link == ours.link
    assert b.received[theirs] == a.sent[ours] and a.received[ours] == b.sent[theirs]


def test_news_nobody_takes_is_dropped_and_said() -> None:
    """A caller that never calls ``take_active`` (an older tier) leaves no references piling
    up: past a bound the news is dropped, and the next call says None (visit everything)."""
    a = Net().sides[0]
    conn = a.connect()
    for _ in range(5):
        a.pairing.news(conn)
    assert a.pairing.take_active() == [conn]
    peer = PeerAddress(ADDRESSES[1], ADDRESSES[1])
    for _ in range(4 * 4096 + 1):
        a.pairing.news(ZmqConnection.failed(a, LIMITS, peer, reason="refused"))
    assert a.pairing.take_active() is None
    a.pairing.news(conn)
    assert a.pairing.take_active() == [conn]


def test_a_peer_offered_a_dial_that_then_disconnects_is_told_gone() -> None:
    """Found by the state machine: B offers its dial to A's, then B's dial disconnects. The
    "gone" for A's offered PUSH must not ride B's dying PUSH (closed at once, it would be
    lost, and A's connection would stay open while B drops its frames)."""
    net = Net()
    a, b = net.sides
    ours, theirs = a.connect(), b.connect()
    net.deliver(net.pending()[0])  # our open reaches B, which offers its dial to ours
    b.retire(theirs, "disconnected", notify=False)
    a.send(ours)
    net.drain()
    assert not ours.alive


def test_a_dial_the_peer_cannot_answer_ends_with_the_likely_cause() -> None:
    """B cannot dial back (no socket left): it tells our PUSH "gone" before any answer, and
    our dial ends naming the refusal, not a plain close (issue 48)."""
    net = Net()
    a, b = net.sides
    b.dial_back = lambda address, link: None  # type: ignore[method-assign]
    ours = a.connect()
    a.send(ours)
    net.drain()
    assert not ours.alive and ours.close_reason == REFUSED
    assert "control_options.max_sockets" in REFUSED


def test_an_answered_connection_the_peer_ends_is_closed_by_the_peer() -> None:
    net = Net()
    ours, theirs = answered(net)
    net.sides[1].retire(theirs, "closed locally")
    net.drain()
    assert not ours.alive and ours.close_reason == "closed by the peer"
