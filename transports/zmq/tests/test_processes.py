"""The zmq control transport across real processes: bulk ordered exchange, peers joining
mid-stream, SIGKILL and SIGSTOP of a peer, and a restarted peer at the same address."""

from __future__ import annotations

from typing import Any

import zmq_peers
from p2pkv.errors import SendQueueFull
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from zmq_fixtures import MakeTransport
from zmq_peers import FAST

T = 10.0  # generous: children start on a busy 2-core machine
DEATH_MARGIN = 2.0  # seconds beyond the heartbeat timeout for death to show


def accept_one(p: Any) -> Any:
    accepted: list[Any] = []
    wait_until(
        lambda: accepted.extend(p.poll(0.01)) or accepted, timeout=T, what="the child's connection"
    )
    assert len(accepted) == 1
    return accepted[0]


def echo(p: Any, conn: Any, word: bytes) -> None:
    conn.send(word)
    wait_until(
        lambda: b"echo:" + word in conn.recv(),
        timeout=T,
        what="the echo",
        pumps=[lambda: p.poll(0.01)],
    )


def address_of(child: Child) -> str:
    kind, address = child.recv(T, "its address")
    assert kind == "address"
    return str(address)


def test_two_processes_exchange_10000_in_order_and_a_third_joins_mid_stream(
    make_transport: MakeTransport,
) -> None:
    p = make_transport()
    plan = {"B": 10_000, "C": 2_000}  # frames each way per peer
    calm: dict[str, float] = {}  # default heartbeats: a starved CPU must not look like death
    with Child(
        zmq_peers.streamer, p.local_address, plan["B"], b"B", plan["B"], calm, name="streamer-B"
    ) as b:
        addresses = {address_of(b): "B"}
        c: Child | None = None
        conns: dict[str, Any] = {}
        sent = {"B": 0, "C": 0}
        got: dict[str, list[bytes]] = {"B": [], "C": []}

        def step() -> bool:
            nonlocal c
            for conn in p.poll(0.001):
                conns[addresses[conn.peer_address]] = conn
            for name, conn in conns.items():
                got[name].extend(conn.recv())
                # B is held at half way until C has joined, so C joins mid-stream.
                limit = plan[name] if (name == "C" or got["C"]) else plan[name] // 2
                while sent[name] < limit:
                    try:
                        conn.send(b"P:%d" % sent[name])
                    except SendQueueFull:
                        break
                    sent[name] += 1
            if c is None and len(got["B"]) >= plan["B"] // 2:
                c = Child(
                    zmq_peers.streamer,
                    p.local_address,
                    plan["C"],
                    b"C",
                    plan["C"],
                    calm,
                    name="streamer-C",
                ).start()
                addresses[address_of(c)] = "C"
            return all(len(got[n]) >= plan[n] and sent[n] == plan[n] for n in plan)

        try:
            wait_until(step, timeout=30, what="both streams to complete")
            assert c is not None
            for name, child in (("B", b), ("C", c)):
                assert got[name] == [b"%s:%d" % (name.encode(), i) for i in range(plan[name])]
                report = child.recv(T, "its report")
                assert report == ("done", plan[name], True, plan[name]), report
            assert len(conns) == 2 and p.stats()["connections"] == 2
        finally:
            if c is not None:
                c.send("stop")
                c.stop()
            b.send("stop")


def test_sigkill_is_detected_and_a_restarted_peer_reconnects_fresh(
    make_transport: MakeTransport,
) -> None:
    p = make_transport(options=FAST)
    with Child(zmq_peers.sitter, 0, p.local_address, FAST, name="sitter-1") as first:
        address = address_of(first)
        port = int(address.rsplit(":", 1)[1])
        old = accept_one(p)
        assert old.peer_address == address and list(old.recv()) == [b"hello"]
        assert p.connect(address) is old
        echo(p, old, b"ping")
        first.kill()
        wait_until(
            lambda: not old.alive,
            timeout=FAST["heartbeat_timeout"] + DEATH_MARGIN,
            what="alive False after SIGKILL",
            pumps=[lambda: p.poll(0.01)],
        )
    with Child(zmq_peers.sitter, port, p.local_address, FAST, name="sitter-2") as second:
        assert address_of(second) == address
        new = accept_one(p)
        assert new is not old and new.alive and new.peer_address == address
        assert list(new.recv()) == [b"hello"]
        assert list(old.recv()) == [], "the restarted peer's frames must not reach the old one"
        assert p.connect(address) is new
        echo(p, new, b"again")
        second.send("stop")


def test_dialed_peer_sigkill_is_detected(make_transport: MakeTransport) -> None:
    p = make_transport(options=FAST)
    with Child(zmq_peers.sitter, 0, None, FAST, name="sitter-dialed") as child:
        conn = p.connect(address_of(child))
        echo(p, conn, b"ping")
        child.kill()
        wait_until(
            lambda: not conn.alive,
            timeout=FAST["heartbeat_timeout"] + DEATH_MARGIN,
            what="alive False after SIGKILL",
            pumps=[lambda: p.poll(0.01)],
        )


def test_silent_peer_is_detected_by_heartbeats(make_transport: MakeTransport) -> None:
    p = make_transport(options=FAST)
    with Child(zmq_peers.sitter, 0, p.local_address, FAST, name="sitter-frozen") as child:
        conn = accept_one(p)
        echo(p, conn, b"ping")  # after the echo, both directions are established
        child.pause()  # SIGSTOP: sockets stay open, nothing answers
        try:
            wait_until(
                lambda: not conn.alive,
                timeout=FAST["heartbeat_interval"] + FAST["heartbeat_timeout"] + DEATH_MARGIN,
                what="alive False while the peer is SIGSTOPped",
                pumps=[lambda: p.poll(0.01)],
            )
        finally:
            child.kill()
