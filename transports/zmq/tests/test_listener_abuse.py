"""Abuse of the listener's libzmq socket itself (below the link protocol): clients that announce
a live routing id, one that overfills its inbound pipe and hangs up, and clients that squat
the routing ids a ROUTER would generate. Each once leaked memory or aborted the process inside
libzmq 4.3.5 while the listener was a ROUTER; the PULL listener (see ``p2pkv_zmq.hub``) files
no client under any id, so all of them are read (and dropped: none speaks the link protocol)."""

from __future__ import annotations

import ctypes
import struct

import zmq
import zmq_peers
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from zmq_fixtures import MakeTransport

T = 10.0
LISTENER_RCVHWM = 1000
"""libzmq's default receive high-water mark, which the listener keeps."""


def _client(ctx: zmq.Context[zmq.Socket[bytes]], target: str, rid: bytes) -> zmq.Socket[bytes]:
    """A PUSH (the one socket type the listener's handshake admits) announcing ``rid``."""
    sock = ctx.socket(zmq.PUSH)
    sock.linger = 0
    sock.sndhwm = 0
    if rid:
        sock.routing_id = rid
    sock.connect(f"tcp://{target}")
    return sock


def test_a_connection_reusing_a_live_routing_id_is_read_like_any_other(
    make_transport: MakeTransport,
) -> None:
    """A ROUTER listener parked (or, with ``ROUTER_HANDOVER``, took over and kept) one of two
    connections announcing the same id; the PULL listener reads both."""
    t = make_transport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        first = _client(ctx, t.local_address, b"reused-id")
        first.send(b"first")
        wait_until(
            lambda: t.stats()["dropped_messages"] >= 1,
            timeout=T,
            what="the first connection's message",
            pumps=[lambda: t.poll(0.001)],
        )
        second = _client(ctx, t.local_address, b"reused-id")  # the first one is still live
        second.send(b"second")
        wait_until(
            lambda: t.stats()["dropped_messages"] >= 2,
            timeout=T,
            what="the message of the connection that reused the live routing id",
            pumps=[lambda: t.poll(0.001)],
        )
    finally:
        ctx.destroy(linger=0)


def test_a_client_overfilling_the_listener_then_hanging_up_cannot_abort_it() -> None:
    """3x the listener's high-water mark, then close, while the application does not poll for
    ten heartbeat intervals. With heartbeats on the listener, libzmq 4.3.5 aborts there
    (``!_io_error``, stream_engine_base.cpp:310); the listener must survive and serve on."""
    options = {"heartbeat_interval": 0.05, "heartbeat_timeout": 1.0, "heartbeat_ttl": 1.0}
    with Child(zmq_peers.busy_listener, options, 0.5, name="busy-listener") as child:
        kind, address = child.recv(T, "the listener's address")
        assert kind == "address"
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        flooder = _client(ctx, address, b"overfill")
        for i in range(3 * LISTENER_RCVHWM):
            flooder.send(b"%d" % i)
        flooder.close(linger=int(T * 1000))  # everything handed to TCP, then hang up
        ctx.term()
        child.send("busy")
        kind, dropped = child.recv(T, "the listener serving after the flood")
        assert kind == "served" and dropped > 0
        assert child.process.is_alive(), f"listener died (exit {child.process.exitcode})"


def _unseeded_rand_starts(draws: int) -> set[int]:
    """The values libzmq 4.3.5 may start a ROUTER's generated routing ids from when the C
    library's ``rand()`` was never seeded (seed 1, the same in every process): one per number
    of ``rand()`` calls made before the ROUTER was created."""
    libc = ctypes.CDLL(None)
    libc.rand.restype = ctypes.c_int
    libc.srand(1)
    r = [libc.rand() for _ in range(draws + 1)]
    return {(r[j] | (r[j + 1] << 31)) & 0xFFFFFFFF for j in range(draws)}


def test_squatting_the_ids_a_router_would_generate_cannot_abort_the_listener() -> None:
    """A libzmq ROUTER files a client that announces no routing id under a generated one,
    ``\\x00`` and a counter started from ``rand()``, without checking that a client already
    announced it: the collision aborts the process (socket_base.cpp:2113). Clients squat the
    ids an unseeded ``rand()`` would give, then two connect without an id; the listener must
    read them all and serve on."""
    with Child(zmq_peers.busy_listener, {}, 0.0, name="squatted-listener") as child:
        kind, address = child.recv(T, "the listener's address")
        assert kind == "address"
        child.send("busy")
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        try:
            socks = [
                _client(ctx, address, b"\x00" + struct.pack(">I", (s + k) & 0xFFFFFFFF))
                for s in _unseeded_rand_starts(32)
                for k in range(2)
            ]
            socks += [_client(ctx, address, b"") for _ in range(2)]
            for sock in socks:
                sock.send(b"x")
            dropped = 0
            while dropped < len(socks):
                try:
                    kind, dropped = child.recv(T, "the listener reading every client's frame")
                except EOFError:
                    child.process.join(T)
                    raise AssertionError(f"listener died (exit {child.process.exitcode})") from None
                assert kind == "served"
        finally:
            ctx.destroy(linger=0)
