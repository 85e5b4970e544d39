"""A zmq peer of another implementation, in both directions: vLLM's built-in P2P tier dials
with a DEALER (routing id = its own ``host:port``, heartbeats on, msgpack frames) and listens
with a ROUTER. libzmq refuses to pair either with ours (our PUSH dials a PULL) inside the
ZMTP handshake and reports no failure: the transport must still name such a peer at once,
as that implementation, and go on serving p2pkv peers (docs/vllm.md, "Mixed fleets").

The foreign sockets are set up as vLLM's ``ZmqTransport`` sets up its own (socket types,
routing id, heartbeat options), with pyzmq alone.
"""

from __future__ import annotations

import contextlib
import logging
import socket
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from p2pkv.testing.waiting import wait_until
from zmq_fixtures import MakeTransport

T = 30.0
"""Bound of every wait. It is longer than the transport's 10 s handshake timeout, so the
tests tell a named refusal from a timed-out handshake by the reason, never by the time."""
UPSTREAM_HEARTBEAT_MS = {
    zmq.HEARTBEAT_IVL: 2000,
    zmq.HEARTBEAT_TIMEOUT: 10000,
    zmq.HEARTBEAT_TTL: 10000,
}
"""The heartbeat options vLLM's P2P ``ZmqTransport`` puts on its sockets."""
CONNECT_MSG = b"\x81\xa4type\xa7connect"
"""A msgpack map ``{"type": "connect"}``: the shape of the built-in tier's first message."""
FOREIGN = "vLLM's built-in P2P tier"


@pytest.fixture
def ctx() -> Iterator[zmq.Context[zmq.Socket[bytes]]]:
    context: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    yield context
    context.destroy(linger=0)


def _upstream_socket(ctx: zmq.Context[zmq.Socket[bytes]], kind: int) -> zmq.Socket[bytes]:
    sock = ctx.socket(kind)
    sock.linger = 0
    for option, value in UPSTREAM_HEARTBEAT_MS.items():
        sock.setsockopt(option, value)
    return sock


def _exchange_works(make_transport: MakeTransport, listener: Any) -> None:
    """A p2pkv peer dials ``listener`` and its first frame arrives with the connection."""
    peer = make_transport()
    peer.connect(listener.local_address).send(b"still serving")
    got: list[Any] = []
    wait_until(
        lambda: got.extend(listener.poll(0.001)) or got,
        timeout=T,
        what="a p2pkv peer's connection after the foreign one",
        pumps=[lambda: peer.poll(0.001)],
    )
    assert got[0].recv() == [b"still serving"]


def test_a_dealer_dialing_the_listener_is_named_and_the_listener_serves_on(
    make_transport: MakeTransport,
    ctx: zmq.Context[zmq.Socket[bytes]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Each dial is named: certainly, at WARNING, when libzmq ended it with no handshake
    outcome; else (the DEALER found the mismatch first) in the listener's one INFO line about
    connections that ended in the handshake. Dialed until one was named certainly."""
    caplog.set_level(logging.INFO, logger="p2pkv")
    t = make_transport()

    def dial() -> None:
        dealer = _upstream_socket(ctx, zmq.DEALER)
        dealer.routing_id = b"127.0.0.1:7777"
        dealer.reconnect_ivl = -1  # one attempt per dial, as the built-in tier's sessions do
        dealer.connect(f"tcp://{t.local_address}")
        with contextlib.suppress(zmq.Again):  # its one attempt may have ended already
            dealer.send(CONNECT_MSG, zmq.NOBLOCK)  # queued: libzmq never pairs the two
        wait_until(
            lambda: FOREIGN in caplog.text,
            timeout=T,
            what="a line naming it",
            pumps=[lambda: t.poll(0.001)],
        )

    dial()
    named = [r for r in caplog.records if FOREIGN in r.getMessage()]
    assert named and named[0].levelno >= logging.INFO, named
    wait_until(
        lambda: "not a p2pkv zmq peer" in caplog.text,
        timeout=T,
        what="a dial named certainly",
        pumps=[dial],
    )
    certain = [r for r in caplog.records if "not a p2pkv zmq peer" in r.getMessage()]
    assert all(r.levelno == logging.WARNING for r in certain), certain  # once per host
    assert t.stats()["refused_handshakes"] >= 1
    assert t.stats()["connections"] == 0
    _exchange_works(make_transport, t)


def test_a_dial_to_a_router_dies_naming_the_foreign_listener(
    make_transport: MakeTransport,
    ctx: zmq.Context[zmq.Socket[bytes]],
) -> None:
    """The dial dies in its handshake, and the reason names the built-in tier either way
    (no outcome: the ROUTER refused our PUSH; a failure: our side refused first)."""
    router = _upstream_socket(ctx, zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    t = make_transport()
    conn = t.connect(f"127.0.0.1:{port}")
    conn.send(b"hello")
    wait_until(
        lambda: not conn.alive,
        timeout=T,
        what="the dial to the ROUTER to die",
        pumps=[lambda: t.poll(0.001)],
    )
    reason = str(conn.close_reason)  # the same words whichever side found the mismatch
    assert "hung up in the zmq handshake" in reason, reason
    assert FOREIGN in reason, reason
    assert router.poll(0) == 0  # nothing of ours reached the foreign listener
    _exchange_works(make_transport, t)


def test_a_raw_tcp_probe_is_not_named_foreign(
    make_transport: MakeTransport,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A connect-and-close (a kubelet TCP probe, a port scan) fails its handshake as a
    client that left: never named a foreign zmq peer, no warning (one INFO line)."""
    caplog.set_level(logging.DEBUG, logger="p2pkv")
    t = make_transport()
    host, port = t.local_address.rsplit(":", 1)
    for _ in range(3):
        socket.create_connection((host, int(port))).close()
    wait_until(
        lambda: "ended in its zmq handshake" in caplog.text,
        timeout=T,
        what="the probes' ends",
        pumps=[lambda: t.poll(0.001)],
    )
    _exchange_works(make_transport, t)
    assert "not a p2pkv zmq peer" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
