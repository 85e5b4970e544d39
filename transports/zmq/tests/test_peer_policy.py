"""Peers a request may make the tier dial (``peers``: allow-list and cap), over real zmq.

A router copies a request's pull source from the request itself, so requests can name any
address. A peer outside ``peers.allow`` is never dialed; a flood of requests naming
distinct refusing and black-holed addresses neither locks real peers out (a never-contacted
healthy producer is reached in the middle of it) nor disturbs established traffic, keeps the
consumer's sessions and descriptors bounded, and logs a bounded number of lines."""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

import pytest
from p2pkv.errors import ResourceUnavailable
from p2pkv.testing.waiting import wait_until
from p2pkv.types import LookupResult, Outcome, RequestContext
from zmq_tiers import Peer, T, run_request, tick

FLOOD = int(os.environ.get("P2PKV_FLOOD_PEERS", "1000"))
"""Requests naming distinct bogus peers (``P2PKV_FLOOD_PEERS``; 10,000 in docs/security.md)."""
MAX_DIALED = 8
"""The flooded consumer's ``peers.max_dialed``."""
REAL_EVERY = 100
"""One real PD request between this many bogus ones."""
LOAD_EVERY = 10
"""One bogus request in this many also submits a load."""
LOGS, BURST, PER_SECOND = 2, 20, 2.0
"""The consumer's rate-limited warning logs (the tier's and the zmq transport's): each logs
``BURST`` lines at once, then ``PER_SECOND`` on average, plus one summary line per 10 s."""


def log_budget(seconds: float) -> int:
    """The most warnings those logs may write in ``seconds``, however many requests."""
    return int(LOGS * (BURST + (PER_SECOND + 0.1) * seconds + 1)) + 2  # + the real peers


def pull_context(kv: str, host: str, port: int) -> RequestContext:
    return RequestContext(
        f"c-{kv}",
        {"remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": port}},
    )


def open_descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


def threads_now() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port on every loopback address that accepts TCP and never speaks (its backlog soon
    full, later dials get no answer at all): a peer that holds a dial in its handshake."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


def test_a_peer_outside_the_allow_list_is_never_dialed(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv")
    producer = Peer(1)
    consumer = Peer(2, peers={"allow": ["10.0.0.0/8", "prefill-0.p2pkv"]})
    try:
        ctx = pull_context("outside", producer.host, producer.port)
        consumer.tier.on_new_request(ctx)
        assert consumer.tier.lookup(b"outside/0", ctx) is LookupResult.MISS
        consumer.job(1, [b"outside/0"], [0], load=True, ctx=ctx)
        wait_until(
            lambda: 1 in consumer.results,
            timeout=T,
            what="the load's result",
            pumps=[tick(consumer)],
        )
        assert consumer.results[1].outcome is Outcome.SUBMIT_FAILED  # failed at its start
        assert "not dialing" in consumer.results[1].detail
        assert "peers.allow" in consumer.results[1].detail
        assert consumer.tier.stats()["peers_refused"] >= 1
        assert consumer.tier._control.stats()["connections"] == 0  # type: ignore[attr-defined]
        assert any(
            "not dialing" in r.getMessage() and "peers.allow" in r.getMessage()
            for r in caplog.records
        )
    finally:
        consumer.tier.shutdown()
        producer.tier.shutdown()


def test_a_flood_of_bogus_peers_locks_no_real_peer_out(
    caplog: pytest.LogCaptureFixture,
    black_hole: int,
    refusing: int,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv")
    producer, fresh = Peer(1), Peer(3)
    consumer = Peer(2, peers={"max_dialed": MAX_DIALED}, timeouts={"handshake": 3.0})
    try:
        run_request(producer, consumer, "warm", list(range(16)), consumer_first=False)
        before, threads, began = open_descriptors(), threads_now(), time.monotonic()
        loads: list[int] = []
        for i in range(FLOOD):
            host = f"127.{1 + i // 62500}.{i // 250 % 250}.{2 + i % 250}"  # distinct peers
            port = black_hole if i % 2 else refusing
            ctx = pull_context(f"bogus-{i}", host, port)
            consumer.tier.on_new_request(ctx)
            assert consumer.tier.lookup(b"k", ctx) in (LookupResult.HIT, LookupResult.MISS)
            if i % LOAD_EVERY == 0:  # a load too: it must end by the handshake, not the load
                loads.append(100_000 + i)
                consumer.job(loads[-1], [b"k"], [60], load=True, ctx=ctx)
            consumer.tier.on_request_finished(ctx)
            consumer.tier.tick()
            assert consumer.tier.stats()["sessions"] <= MAX_DIALED + 1  # + the producer's
            if i % REAL_EVERY == REAL_EVERY - 1:
                run_request(
                    producer, consumer, f"real-{i}", list(range(16)), consumer_first=bool(i % 2)
                )
            if i == FLOOD // 2:  # a producer never contacted before, mid-flood
                run_request(
                    fresh, consumer, "first-contact", list(range(16, 32)), consumer_first=False
                )
        stats = consumer.tier.stats()
        assert stats["peers_waited"] > 0, stats  # the budget of new dials held names back
        wait_until(
            lambda: all(job in consumer.results for job in loads),
            timeout=30,
            what="the bogus loads' results",
            pumps=[tick(consumer)],
        )
        for job in loads:  # none waited for the load deadline: failed at once or by the
            result = consumer.results[job]  # handshake's (or evicted for a newer peer)
            assert result.outcome is not Outcome.DONE, result
            assert result.outcome is not Outcome.LOAD_TIMEOUT, result
        fresh.tier.shutdown()  # its session was opened during the flood: not a leftover
        wait_until(
            lambda: consumer.tier.stats()["sessions"] <= 1,
            timeout=30,
            what="the bogus peers' sessions to end",
            pumps=[tick(consumer)],
        )
        wait_until(
            lambda: open_descriptors() <= before + 4,
            timeout=30,  # libzmq closes late
            what=f"descriptors back to {before} (+4)",
            pumps=[tick(consumer)],
        )
        assert threads_now() <= threads
        warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
        # a rate: the budget grows with the time the flood took, not with its size
        assert len(warnings) <= log_budget(time.monotonic() - began), len(warnings)
    finally:
        for peer in (consumer, fresh, producer):
            peer.tier.shutdown()


class JumpingClock:
    """The monotonic clock plus an offset a test moves forward (time passing at once)."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.monotonic() + self.offset

    def advance(self, seconds: float, peer: Peer) -> None:
        """Move on ``seconds``, ticking ``peer`` every 4 s of it (a longer gap between ticks
        is a pause of the process, which closes every session)."""
        for _ in range(math.ceil(seconds / 4)):
            self.offset += 4
            peer.tier.tick()


def test_an_idle_dialed_session_is_closed_and_dialed_again_when_needed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """``peers.idle_timeout``: a session with a request open is kept however long; once
    nothing is open and nothing arrives for the idle time, the consumer closes it with a
    bye (the producer closes its side too) and the next request dials again."""
    caplog.set_level(logging.INFO, logger="p2pkv")
    clock = JumpingClock()
    producer = Peer(1)
    consumer = Peer(2, clock=clock, peers={"idle_timeout": 6})
    try:
        run_request(producer, consumer, "first", [1, 2], consumer_first=False)
        pctx, cctx = pull_context_pair("open", producer)
        producer.tier.on_new_request(pctx)
        consumer.tier.on_new_request(cctx)
        consumer.job(7, [b"open/0"], [40], load=True, ctx=cctx)  # waits for the store
        consumer.tier.tick()
        clock.advance(12, consumer)
        assert consumer.tier.stats()["peers_reaped"] == 0  # a load is open: kept
        producer.job(8, [b"open/0"], [5], load=False, ctx=pctx)
        wait_until(
            lambda: 7 in consumer.results and 8 in producer.results,
            timeout=T,
            what="the open request's results",
            pumps=[tick(producer, consumer)],
        )
        assert consumer.results[7].outcome is Outcome.DONE
        assert bytes(consumer.blocks[40]) == bytes(producer.blocks[5])
        for tier, ctx in ((producer.tier, pctx), (consumer.tier, cctx)):
            tier.on_request_finished(ctx)
        wait_until(
            lambda: producer.tier.stats()["jobs_pending"] == 0,
            timeout=T,
            what="the producer's round to end",
            pumps=[tick(producer, consumer)],
        )
        clock.advance(8, consumer)
        wait_until(
            lambda: consumer.tier.stats()["peers_reaped"] == 1,
            timeout=T,
            what="the idle session's close",
            pumps=[tick(consumer)],
        )
        assert consumer.tier.stats()["sessions"] == 0
        wait_until(
            lambda: producer.tier.stats()["sessions"] == 0,
            timeout=T,
            what="the producer to close its side",
            pumps=[tick(producer)],
        )
        assert any("idle for 6s (peers.idle_timeout)" in r.getMessage() for r in caplog.records)
        run_request(producer, consumer, "again", [3], consumer_first=True)  # dials anew
        assert consumer.tier.stats()["sessions"] == 1
    finally:
        consumer.tier.shutdown()
        producer.tier.shutdown()


def pull_context_pair(kv: str, producer: Peer) -> tuple[RequestContext, RequestContext]:
    return (
        RequestContext(f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}}),
        pull_context(kv, producer.host, producer.port),
    )


def test_out_of_zmq_sockets_names_the_cap_really_hit(
    make_transport: Any,
    black_hole: int,
) -> None:
    transport = make_transport(max_sockets=16)
    with pytest.raises(ResourceUnavailable) as raised:
        for i in range(16):  # each dial to a black hole holds its sockets
            transport.connect(f"127.1.0.{2 + i}:{black_hole}")
    message = str(raised.value)
    assert "ZMQ_MAX_SOCKETS = 16" in message and "peers.max_dialed" in message
    assert "ulimit" not in message  # the descriptor limit was not the one hit


def test_a_peer_named_by_a_host_name_is_connected_before_any_request() -> None:
    """``peers.connect`` with a name from /etc/hosts (``localhost``): the consumer dials what
    it resolves to before any request names the producer (another process), and the first
    PD load then runs over that session, its bytes exact."""
    pytest.importorskip("nixl._api", reason="needs NIXL for a cross-process data path")
    import numpy as np
    import zmq_peers
    from p2pkv.config import TierConfig
    from p2pkv.testing.child import Child
    from p2pkv.tier import P2PTier
    from p2pkv.types import Job

    blocks, block_len = 16, 256
    with Child(zmq_peers.producer_tier, "nixl", blocks, block_len, 7, name="named") as child:
        kind, address = child.recv(60, "the producer's address")
        assert kind == "address"
        port = int(address.rpartition(":")[2])
        region = np.zeros(blocks * block_len, np.uint8)
        config = TierConfig.from_dict(
            {
                "control": "zmq",
                "data": "nixl",
                "host": "127.0.0.1",
                "port": 0,
                "peers": {"connect": [f"localhost:{port}"], "resolve_interval": 0.5},
            }
        )
        consumer = P2PTier(config, region.data, block_len)
        try:
            wait_until(
                lambda: consumer.stats()["sessions_ready"] >= 1,
                timeout=T,
                what="the session to the named peer",
                pumps=[lambda: consumer.tick(0.01)],
            )
            sessions = consumer.stats()["sessions"]
            child.send(("store", 1, "named", [b"named/0", b"named/1"], [3, 4]))
            ctx = pull_context("named", "127.0.0.1", port)
            consumer.on_new_request(ctx)
            consumer.submit_load(Job(2, [b"named/0", b"named/1"], [0, 1], True, ctx))
            results: dict[int, Any] = {}
            wait_until(
                lambda: (
                    results.update({r.job_id: r for r in consumer.get_finished_jobs()})
                    or 2 in results
                ),
                timeout=T,
                what="the load",
                pumps=[consumer.tick],
            )
            assert results[2].outcome is Outcome.DONE, results[2]
            source = np.random.default_rng(7).integers(0, 256, blocks * block_len, np.uint8)
            assert (region[: 2 * block_len] == source[3 * block_len : 5 * block_len]).all()
            assert consumer.stats()["sessions"] == sessions  # no new dial for the request
            consumer.on_request_finished(ctx)
            child.send(("finish", "named"))
        finally:
            consumer.shutdown()
