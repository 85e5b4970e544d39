"""The memory control transport against the ControlTransport contract."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from p2pkv.contracts import ControlConnection, ControlSettings
from p2pkv.control_base import OVERSIZED
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge, SendQueueFull
from p2pkv.reference import MemoryControlTransport

MakeControl = Callable[..., MemoryControlTransport]
"""The ``make`` fixture: ``make(host, port, **options)``, closed after the test."""


@pytest.fixture
def make() -> Iterator[MakeControl]:
    made: list[MemoryControlTransport] = []

    def make(host: str = "127.0.0.1", port: int = 0, **kw: Any) -> MemoryControlTransport:
        max_frame = kw.pop("max_frame_bytes", 1 << 20)
        t = MemoryControlTransport.create(ControlSettings(host, port, max_frame, kw))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def accept_one(
    t: MemoryControlTransport, dialed: ControlConnection | None = None
) -> ControlConnection:
    """Poll ``t`` for its one new inbound connection.

    With ``dialed`` (the dialer's end), first send an opening frame on it: an inbound
    connection is announced only with its first frame, which this drains.
    """
    if dialed is not None:
        dialed.send(b"open")
    (conn,) = t.poll()
    if dialed is not None:
        assert list(conn.recv()) == [b"open"]
    return conn


def test_port_zero_gets_unique_addresses(make: MakeControl) -> None:
    a, b = make(), make()
    assert a.local_address != b.local_address
    assert a.local_address.startswith("127.0.0.1:")


def test_explicit_port_and_ipv6_formatting(make: MakeControl) -> None:
    assert make("::1", 40001).local_address == "[::1]:40001"
    assert make("localhost", 40001).local_address == "localhost:40001"


def test_address_in_use_is_refused(make: MakeControl) -> None:
    name = f"mem://{uuid.uuid4().hex}"
    make(name)
    with pytest.raises(ConfigError, match="already in use"):
        make(name)


def test_closed_transport_frees_its_address(make: MakeControl) -> None:
    name = f"mem://{uuid.uuid4().hex}"
    make(name).close()
    assert make(name).local_address == name


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"bogus": 1}, "bogus"),
        ({"max_queued_frames": "3"}, "max_queued_frames"),
        ({"max_queued_frames": 0}, "max_queued_frames"),
        ({"max_queued_frames": True}, "max_queued_frames"),
        ({"connect_timeout": -1.0}, "connect_timeout"),
    ],
)
def test_bad_options_name_the_key(make: MakeControl, options: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        make(**options)


@pytest.mark.parametrize("address", ["nocolon", "host:notaport", "host:70000", "mem://"])
def test_connect_to_malformed_address(make: MakeControl, address: str) -> None:
    with pytest.raises(ConfigError):
        make().connect(address)


def test_frames_arrive_in_order_and_inbound_is_accepted_once_with_frames(make: MakeControl) -> None:
    a, b = make(), make()
    conn = a.connect(b.local_address)
    frames = [f"frame-{i}".encode() for i in range(100)]
    for frame in frames:
        conn.send(frame)
    (accepted,) = b.poll()
    assert accepted.peer_address == a.local_address
    assert list(accepted.recv()) == frames
    assert b.poll() == []
    accepted.send(b"reply")
    assert a.poll() == []
    assert list(conn.recv()) == [b"reply"]


def test_recv_returns_only_what_poll_moved(make: MakeControl) -> None:
    a, b = make(), make()
    conn = a.connect(b.local_address)
    conn.send(b"a")
    peer = accept_one(b)
    assert list(peer.recv()) == [b"a"]
    conn.send(b"x")
    assert list(peer.recv()) == []
    b.poll()
    assert list(peer.recv()) == [b"x"]
    assert list(peer.recv()) == []


def test_connect_returns_the_live_connection(make: MakeControl) -> None:
    a, b = make(), make()
    assert a.connect(b.local_address) is a.connect(b.local_address)


def test_connect_returns_unpolled_inbound_and_poll_then_skips_it(make: MakeControl) -> None:
    a, b = make(), make()
    a.connect(b.local_address).send(b"hello")
    back = b.connect(a.local_address)
    assert b.poll() == []
    assert list(back.recv()) == [b"hello"]
    back.send(b"hi")
    a.poll()
    assert list(a.connect(b.local_address).recv()) == [b"hi"]


def test_simultaneous_dial_gives_one_connection_per_side(make: MakeControl) -> None:
    a, b = make(), make()
    ab = a.connect(b.local_address)
    ba = b.connect(a.local_address)
    ab.send(b"from a")
    ba.send(b"from b")
    assert a.poll() == [] and b.poll() == []
    assert list(ba.recv()) == [b"from a"]
    assert list(ab.recv()) == [b"from b"]


def test_dial_before_listen_attaches_later(make: MakeControl) -> None:
    name = f"mem://{uuid.uuid4().hex}"
    a = make()
    conn = a.connect(name)
    conn.send(b"early")
    a.poll()
    assert conn.alive
    b = make(name)
    a.poll()
    peer = accept_one(b)
    assert list(peer.recv()) == [b"early"]


def test_dial_to_nobody_dies_after_connect_timeout(make: MakeControl) -> None:
    a = make(connect_timeout=0.01)
    conn = a.connect(f"mem://{uuid.uuid4().hex}")
    for _ in range(1000):
        a.poll(0.01)
        if not conn.alive:
            break
    assert not conn.alive
    with pytest.raises(ConnectionClosed):
        conn.send(b"x")


def test_close_is_seen_by_peer_after_pending_frames(make: MakeControl) -> None:
    a, b = make(), make()
    conn = a.connect(b.local_address)
    peer = accept_one(b, conn)
    conn.send(b"bye")
    conn.close()
    conn.close()  # idempotent
    assert not conn.alive
    with pytest.raises(ConnectionClosed):
        conn.send(b"more")
    assert peer.alive and peer.close_reason is None  # not yet polled
    b.poll()
    assert not peer.alive
    assert (conn.close_reason, peer.close_reason) == ("closed", "closed by peer")
    assert list(peer.recv()) == [b"bye"]
    with pytest.raises(ConnectionClosed):
        peer.send(b"x")


def test_transport_close_kills_connections_on_both_sides(make: MakeControl) -> None:
    a, b = make(), make()
    conn = a.connect(b.local_address)
    peer = accept_one(b, conn)
    b.close()
    b.close()
    assert not peer.alive
    a.poll()
    assert not conn.alive
    assert b.poll() == []


def test_reconnect_after_close_replaces_dead_connection(make: MakeControl) -> None:
    a, b = make(), make()
    old = a.connect(b.local_address)
    old_peer = accept_one(b, old)
    old.close()
    new = a.connect(b.local_address)
    assert new is not old and new.alive
    new.send(b"again")
    (fresh,) = b.poll()
    assert fresh is not old_peer and not old_peer.alive
    assert old_peer.close_reason in ("closed by peer", "replaced by a new connection from the peer")
    assert list(fresh.recv()) == [b"again"]


def test_oversized_frame_is_refused_before_sending(make: MakeControl) -> None:
    a, b = make(max_frame_bytes=8), make()
    with pytest.raises(FrameTooLarge, match="max_frame_bytes"):
        a.connect(b.local_address).send(b"123456789")


def test_frame_above_receiver_cap_kills_connection(make: MakeControl) -> None:
    a, b = make(), make(max_frame_bytes=4)
    conn = a.connect(b.local_address)
    conn.send(b"too long")
    (peer,) = b.poll()
    assert not peer.alive and peer.close_reason == OVERSIZED
    assert peer.recv() == ()  # nothing above the cap was delivered
    a.poll()
    assert not conn.alive


def test_bounded_queue(make: MakeControl) -> None:
    a, b = make(max_queued_frames=2), make()
    conn = a.connect(b.local_address)
    conn.send(b"1")
    conn.send(b"2")
    with pytest.raises(SendQueueFull):
        conn.send(b"3")
    peer = accept_one(b)
    conn.send(b"3")
    b.poll()
    assert list(peer.recv()) == [b"1", b"2", b"3"]


def test_send_copies_the_frame(make: MakeControl) -> None:
    a, b = make(), make()
    buf = bytearray(b"abc")
    a.connect(b.local_address).send(buf)  # type: ignore[arg-type]  # a mutable buffer, on purpose
    buf[:] = b"xyz"
    assert list(accept_one(b).recv()) == [b"abc"]


def test_poll_timeout_returns_when_nothing_happens(make: MakeControl) -> None:
    a = make()
    assert a.poll(0.01) == []


def test_cannot_connect_to_itself(make: MakeControl) -> None:
    a = make()
    with pytest.raises(ConfigError):
        a.connect(a.local_address)


@pytest.mark.timeout(60)
def test_interrupt_ends_a_waiting_poll_from_another_thread(make: MakeControl) -> None:
    t = make()
    t.interrupt()  # before a poll: that poll ends at once
    assert t.poll(120.0) == []
    timer = threading.Timer(0.2, t.interrupt)
    timer.start()
    try:
        assert t.poll(120.0) == []  # only the interrupt can end it before the test's timeout
    finally:
        timer.join(60)
