"""The zmq control transport in one process: real sockets on 127.0.0.1 and ::1."""

from __future__ import annotations

import os
import random
import socket
from typing import Any

import pytest
import zmq
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge, SendQueueFull
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq import ZmqControlTransport
from p2pkv_zmq.connection import ZmqConnection
from p2pkv_zmq.hub import ZmqHub
from zmq_fixtures import MakeTransport

T = 5.0  # seconds any single expected event may take


def pump(*transports: Any) -> Any:
    return lambda: [t.poll(0.001) for t in transports]


def accept_one(listener: Any, *others: Any) -> Any:
    got: list[Any] = []
    wait_until(
        lambda: got.extend(listener.poll(0.001)) or got,
        timeout=T,
        what="an inbound connection",
        pumps=[pump(*others)],
    )
    assert len(got) == 1
    return got[0]


def connected(make_transport: MakeTransport) -> tuple[Any, Any, Any, Any]:
    """Two transports ``a``, ``b``; a's connection to b after one frame ``x``; b's side."""
    a, b = make_transport(), make_transport()
    out = a.connect(b.local_address)
    out.send(b"x")
    return a, b, out, accept_one(b, a)


def drain(conn: Any, count: int, *transports: Any) -> list[bytes]:
    got: list[bytes] = []
    wait_until(
        lambda: got.extend(conn.recv()) or len(got) >= count,
        timeout=T,
        what=f"{count} frames",
        pumps=[pump(*transports)],
    )
    return got


def test_capabilities_and_name() -> None:
    caps = ZmqControlTransport.capabilities
    assert ZmqControlTransport.name == "zmq"
    assert caps.cross_process and caps.cross_host and caps.auth and caps.heartbeats
    assert ZmqControlTransport.availability() is None


def test_exchange_both_ways_in_order(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    out = a.connect(b.local_address)
    assert out.peer_address == b.local_address and out.alive
    frames = [os.urandom(random.randrange(0, 300)) for _ in range(200)]
    for f in frames:
        out.send(f)
    inbound = accept_one(b, a)
    assert inbound.peer_address == a.local_address
    assert drain(inbound, len(frames), a, b) == frames
    for i in range(50):
        inbound.send(b"back-%d" % i)
    assert drain(out, 50, a, b) == [b"back-%d" % i for i in range(50)]
    for _ in range(5):  # accepted exactly once
        assert not b.poll(0.001)
    assert b.connect(a.local_address) is inbound


def test_inbound_is_returned_with_its_first_frame(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    a.connect(b.local_address).send(b"first")
    conn = accept_one(b, a)
    assert list(conn.recv()) == [b"first"]


def test_dialing_each_other_at_once_gives_one_connection_each(
    make_transport: MakeTransport,
) -> None:
    a, b = make_transport(), make_transport()
    ab, ba = a.connect(b.local_address), b.connect(a.local_address)
    ab.send(b"from a")
    ba.send(b"from b")
    assert drain(ba, 1, a, b) == [b"from a"]
    assert drain(ab, 1, a, b) == [b"from b"]
    for _ in range(5):
        assert not a.poll(0.001) and not b.poll(0.001), "no second connection may appear"
    assert a.stats()["connections"] == 1 == b.stats()["connections"]


def test_connect_normalises_the_address(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    port = b.local_address.rsplit(":", 1)[1]
    conn = a.connect(f" 127.0.0.1:{port}")
    assert a.connect(f"127.0.0.1:{port}") is conn
    with pytest.raises(ConfigError):
        a.connect("no-port")


def test_ipv6_loopback(make_transport: MakeTransport) -> None:
    a, b = make_transport("::1"), make_transport("[::1]")
    assert a.local_address.startswith("[::1]:")
    port = b.local_address.rsplit(":", 1)[1]
    out = a.connect(f"[0:0:0:0:0:0:0:1]:{port}")  # any spelling of ::1 is the same peer
    assert a.connect(b.local_address) is out
    out.send(b"v6")
    inbound = accept_one(b, a)
    assert inbound.peer_address == a.local_address
    assert list(inbound.recv()) == [b"v6"]
    inbound.send(b"v6 back")
    assert drain(out, 1, a, b) == [b"v6 back"]


def test_port_zero_is_ephemeral_and_reported(make_transport: MakeTransport) -> None:
    a = make_transport()
    host, port = a.local_address.rsplit(":", 1)
    assert host == "127.0.0.1" and 0 < int(port) < 65536


def test_port_in_use_names_port_rank_and_env_var(make_transport: MakeTransport) -> None:
    a = make_transport()
    port = int(a.local_address.rsplit(":", 1)[1])
    fds_before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(ConfigError) as err:
        make_transport(port=port, dp_rank=2)
    text = str(err.value)
    assert str(port) in text and f"base port {port - 2}" in text
    assert "data-parallel rank offset 2" in text and "P2PKV_PORT" in text
    assert len(os.listdir("/proc/self/fd")) == fds_before, "a failed create left sockets open"
    a.connect(a.local_address)  # the first owner still works


def test_data_parallel_ranks_get_distinct_ports(make_transport: MakeTransport) -> None:
    for _attempt in range(20):  # a base whose next ranks happen to be taken: try another
        base = random.randrange(20000, 60000)
        made: list[Any] = []
        try:
            for rank in range(3):
                cfg = TierConfig.from_dict({"host": "127.0.0.1", "port": base}, dp_rank=rank)
                made.append(make_transport(cfg.host, cfg.port, dp_rank=rank))
        except ConfigError:
            for t in made:
                t.close()
            continue
        ports = [int(t.local_address.rsplit(":", 1)[1]) for t in made]
        assert ports == [base, base + 1, base + 2]
        made[0].connect(made[2].local_address).send(b"rank 0 to rank 2")
        assert list(accept_one(made[2], made[0]).recv()) == [b"rank 0 to rank 2"]
        return
    pytest.fail("no free base port found in 20 attempts")


def test_unknown_and_bad_options_are_refused_by_name(make_transport: MakeTransport) -> None:
    with pytest.raises(ConfigError, match="heartbeat_intervall"):
        make_transport(heartbeat_intervall=1)
    with pytest.raises(ConfigError, match="max_queued_frames"):
        make_transport(max_queued_frames=0)
    with pytest.raises(ConfigError, match="heartbeat_ttl"):
        make_transport(heartbeat_ttl=0.01)
    with pytest.raises(ConfigError, match="insecure"):
        make_transport(insecure="yes")


def test_wildcard_bind_needs_advertise(make_transport: MakeTransport) -> None:
    with pytest.raises(ConfigError, match="advertise"):
        make_transport("0.0.0.0", insecure=True)
    a = make_transport("0.0.0.0", insecure=True, advertise="127.0.0.1")
    assert a.local_address.startswith("127.0.0.1:")
    b = make_transport()
    b.connect(a.local_address).send(b"via the advertised address")
    inbound = accept_one(a, b)
    inbound.send(b"and back")
    assert drain(b.connect(a.local_address), 1, a, b) == [b"and back"]


def test_advertise_with_port_is_used_verbatim(make_transport: MakeTransport) -> None:
    a = make_transport(advertise="LocalHost:6000")
    assert a.local_address == "localhost:6000"


def test_frame_cap_on_send(make_transport: MakeTransport) -> None:
    a, b = make_transport(max_frame_bytes=1000), make_transport(max_frame_bytes=1000)
    out = a.connect(b.local_address)
    with pytest.raises(FrameTooLarge):
        out.send(b"x" * 1001)
    out.send(b"y" * 1000)
    assert list(accept_one(b, a).recv()) == [b"y" * 1000]


def test_oversized_inbound_frame_is_refused_and_kills_only_that_connection(
    make_transport: MakeTransport,
) -> None:
    small, big, other = (
        make_transport(max_frame_bytes=1000),
        make_transport(max_frame_bytes=10_000),
        make_transport(),
    )
    out = big.connect(small.local_address)
    out.send(b"ok")
    inbound = accept_one(small, big)
    out.send(b"z" * 5000)
    wait_until(
        lambda: not out.alive,
        timeout=T,
        what="the oversized sender's connection to die",
        pumps=[pump(small, big)],
    )
    assert list(inbound.recv()) == [b"ok"]
    other.connect(small.local_address).send(b"still serving")
    assert list(accept_one(small, other).recv()) == [b"still serving"]


def test_full_send_queue_raises_and_never_blocks(make_transport: MakeTransport) -> None:
    with socket.socket() as silent:  # accepts TCP, never speaks ZMTP: nothing leaves the queue
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        a = make_transport(max_queued_frames=5)
        conn = a.connect(f"127.0.0.1:{silent.getsockname()[1]}")
        sent = 0
        with pytest.raises(SendQueueFull, match="max_queued_frames"):
            for _ in range(100):
                conn.send(b"q")
                sent += 1
        assert 5 <= sent <= 6
        assert conn.alive


def test_unreachable_peer_dies_after_connect_timeout(make_transport: MakeTransport) -> None:
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        a = make_transport(connect_timeout=0.3)
        conn = a.connect(f"127.0.0.1:{silent.getsockname()[1]}")
        conn.send(b"queued")
        wait_until(lambda: not conn.alive, timeout=T, what="connect_timeout", pumps=[pump(a)])
        with pytest.raises(ConnectionClosed):
            conn.send(b"after")


def test_close_is_idempotent_and_visible_to_the_peer(make_transport: MakeTransport) -> None:
    a, b, out, inbound = connected(make_transport)
    out.close()
    out.close()
    assert not out.alive
    with pytest.raises(ConnectionClosed):
        out.send(b"after close")
    wait_until(
        lambda: not inbound.alive, timeout=T, what="the peer to see the close", pumps=[pump(a, b)]
    )
    assert list(inbound.recv()) == [b"x"], "frames received before the close stay readable"


def test_accepted_side_close_is_visible_to_the_dialer(make_transport: MakeTransport) -> None:
    a, b, out, inbound = connected(make_transport)
    inbound.close()
    wait_until(
        lambda: not out.alive, timeout=T, what="the dialer to see the close", pumps=[pump(a, b)]
    )
    fresh = a.connect(b.local_address)
    assert fresh is not out and fresh.alive
    fresh.send(b"again")
    assert list(accept_one(b, a).recv()) == [b"again"]


def test_transport_close_is_visible_and_idempotent(make_transport: MakeTransport) -> None:
    a, b, out, inbound = connected(make_transport)
    b.close()
    b.close()
    assert not inbound.alive
    assert b.poll(0.0) == ()
    with pytest.raises(ConnectionClosed):
        b.connect(a.local_address)
    wait_until(
        lambda: not out.alive,
        timeout=T,
        what="the peer to see the transport close",
        pumps=[pump(a)],
    )


def test_close_with_frames_queued_to_nobody_returns(make_transport: MakeTransport) -> None:
    a = make_transport()
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(1)
        conn = a.connect(f"127.0.0.1:{silent.getsockname()[1]}")
        for _ in range(100):
            conn.send(b"never delivered")
        a.close()  # LINGER 0: returns at once (pytest-timeout guards it)
    assert not conn.alive


def test_restarted_peer_at_the_same_address_is_a_fresh_connection(
    make_transport: MakeTransport,
) -> None:
    a = make_transport()
    b = make_transport()
    port = int(b.local_address.rsplit(":", 1)[1])
    out = b.connect(a.local_address)
    out.send(b"first life")
    old = accept_one(a, b)
    assert list(old.recv()) == [b"first life"]
    b.close()
    reborn = make_transport(port=port)
    reborn.connect(a.local_address).send(b"second life")
    new = accept_one(a, reborn)
    assert new is not old and new.alive
    assert list(new.recv()) == [b"second life"]
    wait_until(
        lambda: not old.alive,
        timeout=T,
        what="the old connection to be retired",
        pumps=[pump(a, reborn)],
    )
    assert list(old.recv()) == [], "nothing of the new life may reach the old connection"


def test_reconnecting_over_a_dead_connection_replaces_it(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    first = a.connect(b.local_address)
    first.send(b"1")
    b_side = accept_one(b, a)
    b_side.close()
    wait_until(lambda: not first.alive, timeout=T, what="death", pumps=[pump(a, b)])
    second = a.connect(b.local_address)
    assert second is not first
    second.send(b"2")
    assert list(accept_one(b, a).recv()) == [b"2"]


def test_stale_frames_without_open_are_dropped_and_answered_gone(
    make_transport: MakeTransport,
) -> None:
    a = make_transport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    home = ctx.socket(zmq.PULL)  # the stale dialer's own listener, where "gone" must arrive
    home.linger = 0
    home.bind("tcp://127.0.0.1:*")
    port = home.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
    raw = ctx.socket(zmq.PUSH)
    raw.linger = 0
    raw.connect(f"tcp://{a.local_address}")
    try:
        raw.send_multipart(
            [f"127.0.0.1:{port}#0123456789abcdef".encode(), b"a frame from a previous life"]
        )
        wait_until(
            lambda: a.stats()["dropped_messages"] >= 1,
            timeout=T,
            what="the stale frame to be dropped",
            pumps=[pump(a)],
        )
        assert home.poll(int(T * 1000)), "the stale dialer must be told its connection is gone"
        notice = home.recv_multipart()
        assert notice[1:] == [b"", b"gone", b"0123456789abcdef"], notice
        assert a.poll(0.01) == ()
    finally:
        raw.close()
        home.close()


def test_monitor_endpoints_never_collide(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    for i in range(30):  # every dial takes a fresh inproc monitor name
        conn = a.connect(b.local_address)
        conn.send(b"%d" % i)
        conn.close()
    last = a.connect(b.local_address)
    last.send(b"last")
    accepted: list[Any] = []
    got: list[bytes] = []

    def seen_last() -> bool:
        accepted.extend(b.poll(0.001))
        for conn in accepted:
            got.extend(conn.recv())
        return b"last" in got

    wait_until(seen_last, timeout=T, what="the last dial's frame", pumps=[pump(a)])


def test_create_returns_the_zmq_implementation() -> None:
    t = ZmqControlTransport.create(ControlSettings("127.0.0.1", 0))
    try:
        assert isinstance(t, ZmqControlTransport) and isinstance(t._hub, ZmqHub)
    finally:
        t.close()


def test_a_closed_dial_never_feeds_the_peers_new_connection(make_transport: MakeTransport) -> None:
    a, b = make_transport(), make_transport()
    stale = b.connect(a.local_address)
    assert isinstance(stale, ZmqConnection)
    stale.send(b"stale")
    wait_until(
        lambda: stale.progress == "ready", timeout=T, what="b's handshake", pumps=[pump(b)]
    )  # the open and the frame are on their way to a
    stale.close()
    fresh = a.connect(b.local_address)  # a dials b while b's closed dial is still arriving
    fresh.send(b"hello")
    accepted: list[Any] = []
    wait_until(
        lambda: accepted.extend(b.poll(0.001)) or accepted,
        timeout=T,
        what="b to accept a's dial",
        pumps=[pump(a)],
    )
    accepted[0].send(b"welcome")
    got = drain(fresh, 1, a, b)
    assert got == [b"welcome"], "a frame of the closed dial reached the new connection"
    assert list(accepted[0].recv()) == [b"hello"]


def test_an_accepted_peer_that_stops_listening_is_dead_at_once(
    make_transport: MakeTransport, refused_address: str
) -> None:
    # The peer's address refuses connections when we dial back: not a zmq listener closed
    # just before, since libzmq closes a listening descriptor asynchronously (in its I/O
    # thread), so a dial right after zmq_close may still connect, and then disconnect.
    a = make_transport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    raw = ctx.socket(zmq.PUSH)
    raw.linger = 0
    link = f"{refused_address}#0123456789abcdef".encode()
    raw.connect(f"tcp://{a.local_address}")
    try:
        raw.send_multipart([link, b"", b"open", b""])
        raw.send_multipart([link, b"hi"])
        accepted: list[Any] = []
        wait_until(
            lambda: accepted.extend(a.poll(0.001)) or accepted,
            timeout=T,
            what="the inbound connection",
        )
        # well before connect_timeout (10 s): the dial-back is refused
        wait_until(
            lambda: not accepted[0].alive, timeout=T, what="the refused dial-back", pumps=[pump(a)]
        )
        assert "no longer listens" in (accepted[0].close_reason or "")
    finally:
        raw.close()


def test_the_default_host_localhost_binds_and_is_dialable(make_transport: MakeTransport) -> None:
    a, b = make_transport("localhost"), make_transport("LOCALHOST")
    assert a.local_address.startswith("localhost:")
    a.connect(b.local_address).send(b"by name")
    assert list(accept_one(b, a).recv()) == [b"by name"]


def test_batched_sends_leave_at_the_flush_in_order(make_transport: MakeTransport) -> None:
    """With ``batch_sends``, frames wait in their connection until ``flush`` (the receiver
    polls and gets none), then arrive in order without the sender polling again."""
    a, b, out, inbound = connected(make_transport)
    assert list(inbound.recv()) == [b"x"]
    assert a.batch_sends() is True
    for i in range(3):
        out.send(b"batched-%d" % i)
    for _ in range(5):
        b.poll(0.01)
    assert list(inbound.recv()) == []
    a.flush()
    assert drain(inbound, 3, b) == [b"batched-%d" % i for i in range(3)]


def test_batched_sends_to_a_full_queue_refuse_and_never_block(
    make_transport: MakeTransport,
) -> None:
    with socket.socket() as silent:  # accepts TCP, never speaks ZMTP: nothing leaves the queue
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        a = make_transport(max_queued_frames=5)
        a.batch_sends()
        conn = a.connect(f"127.0.0.1:{silent.getsockname()[1]}")
        with pytest.raises(SendQueueFull, match="max_queued_frames"):
            for _ in range(1000):
                conn.send(b"q")
                a.flush()
        assert conn.alive
