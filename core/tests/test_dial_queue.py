"""Requests that wait for a dial (issue 48, item 5): a flood spends the budget of new dials,
and a request naming a new peer waits for a free dial instead of failing, within its
deadlines.

Memory transports on a fake clock. ``peers.max_dialed`` 4 gives a budget of one new dial a
second and one place for a dial that heard nothing; a request naming a silent address
(nobody listens: its dial never hears anything) spends both.
"""

from __future__ import annotations

import pytest
from p2pkv.dial_policy import GRACE
from p2pkv.testing.harness import (
    Cluster,
    Node,
    advance,
    keys,
    probe_until,
    pump,
    pump_until,
)
from p2pkv.types import LookupResult, Outcome, RequestContext

SMALL = {"max_dialed": 4}
"""One new dial a second; one dial that heard nothing at once; four peers waiting."""


def silent(i: int, *, loads: Node | None = None) -> RequestContext:
    """A PD request naming an address nobody listens on (with a load from ``loads``)."""
    ctx = RequestContext(
        f"silent-{i}",
        {
            "remote_prefiller": {
                "kv_request_id": f"silent-{i}",
                "remote_host": "127.0.0.1",
                "remote_port": 1 + i,
            }
        },
    )
    if loads is not None:
        loads.tier.on_new_request(ctx)
        loads.load(1000 + i, [f"s{i}".encode()], [60], ctx)
    return ctx


def consumer(cluster: Cluster, **timeouts: float) -> Node:
    """A consumer whose one new dial a second is spent by a silent address already."""
    c = cluster(peers=SMALL, control_options={"connect_timeout": 3600}, timeouts=timeouts or {})
    c.tier.on_new_request(silent(0))
    assert c.tier.stats()["peers_dialing"] == 1
    return c


def test_a_load_to_a_new_peer_waits_for_a_free_dial_and_is_served(cluster: Cluster) -> None:
    c, fresh = consumer(cluster), cluster()
    ctx = c.consumer_ctx("fresh", fresh)
    c.tier.on_new_request(ctx)
    c.load(1, keys("fresh", 2), [0, 1], ctx)
    pump([c, fresh], 2)
    stats = c.tier.stats()
    assert stats["peers_waiting"] == 1 and stats["peers_waited"] == 1, stats
    assert c.outcome(1) is None and c.tier.has_pending_work()
    advance(c.clock, [c, fresh], GRACE / 2)  # no token yet, the silent dial is young
    assert c.tier.stats()["peers_waiting"] == 1 and c.outcome(1) is None
    advance(c.clock, [c, fresh], GRACE / 2)  # a token; the silent dial makes way
    stats = c.tier.stats()
    assert stats["peers_waiting"] == 0 and stats["peers_evicted"] == 1, stats
    pctx = fresh.producer_ctx("fresh")
    fresh.tier.on_new_request(pctx)
    fresh.store(2, keys("fresh", 2), [4, 5], pctx)
    pump_until([c, fresh], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.DONE
    assert (c.blocks[[0, 1]] == fresh.blocks[[4, 5]]).all()


def test_a_waiting_load_fails_at_its_own_deadline(cluster: Cluster) -> None:
    c = consumer(cluster, load=0.5)
    silent(1, loads=c)
    advance(c.clock, [c], 0.4)
    assert c.outcome(1001) is None
    advance(c.clock, [c], 0.2)  # past the load's deadline, before any token
    assert c.outcome(1001) is Outcome.LOAD_TIMEOUT
    assert "waited 0.5s for a dial of 127.0.0.1:2" in c.results[1001].detail


def test_a_load_handed_to_its_new_session_keeps_the_deadline_it_had(cluster: Cluster) -> None:
    c, fresh = consumer(cluster, load=1.5), cluster()
    ctx = c.consumer_ctx("late", fresh)
    c.tier.on_new_request(ctx)
    c.load(1, keys("late", 1), [0], ctx)
    advance(c.clock, [c, fresh], GRACE)  # dialed now, 1 s after its submit
    assert c.tier.stats()["peers_waiting"] == 0
    advance(c.clock, [c, fresh], 0.4)
    assert c.outcome(1) is None
    advance(c.clock, [c, fresh], 0.2)  # 1.5 s after the submit, not after the dial
    assert c.outcome(1) is Outcome.LOAD_TIMEOUT


def test_a_peer_waits_at_most_the_handshake_timeout(cluster: Cluster) -> None:
    c = consumer(cluster, handshake=0.5)
    silent(1, loads=c)
    advance(c.clock, [c], 0.6)  # no token came within a handshake's time
    assert c.outcome(1001) is Outcome.PEER_DEAD
    assert "waited 0.5s for a free dial (timeouts.handshake)" in c.results[1001].detail
    stats = c.tier.stats()
    assert stats["peers_waiting"] == 0 and stats["peers_wait_failed"] == 1, stats
    c.load(1002, [b"again"], [61], silent(1))  # the request failed: its next load too
    c.collect()
    assert c.outcome(1002) is Outcome.SUBMIT_FAILED


def test_beyond_max_dialed_waiting_peers_the_oldest_named_once_leaves(
    cluster: Cluster,
) -> None:
    c = consumer(cluster)
    for i in range(1, 6):  # four places in the queue
        silent(i, loads=c)
    c.collect()
    assert c.outcome(1001) is Outcome.PEER_DEAD
    assert "4 peers wait for a dial (peers.max_dialed)" in c.results[1001].detail
    assert all(c.outcome(1000 + i) is None for i in range(2, 6))
    assert c.tier.stats()["peers_waiting"] == 4


def test_a_full_queue_of_peers_named_twice_refuses_a_name_at_once(cluster: Cluster) -> None:
    c = consumer(cluster)
    for i in range(1, 5):  # each named by two requests: the queue keeps them
        for kv in ("a", "b"):
            ctx = RequestContext(
                f"{kv}{i}",
                {
                    "remote_prefiller": {
                        "kv_request_id": f"{kv}{i}",
                        "remote_host": "127.0.0.1",
                        "remote_port": 1 + i,
                    }
                },
            )
            c.tier.on_new_request(ctx)
    silent(5, loads=c)  # named once, into a full queue: the worst, it does not wait
    c.collect()
    assert c.outcome(1005) is Outcome.SUBMIT_FAILED  # its request failed when it was named
    assert "4 peers wait for a dial" in c.results[1005].detail
    assert c.tier.stats()["peers_waiting"] == 4


def test_a_peer_named_by_more_requests_is_dialed_first(cluster: Cluster) -> None:
    c, fresh = consumer(cluster), cluster()
    silent(1, loads=c)
    for kv in ("a", "b"):  # a stream of requests: a healthy peer, not a flood's name
        ctx = c.consumer_ctx(kv, fresh)
        c.tier.on_new_request(ctx)
    silent(2, loads=c)  # named once, and last
    advance(c.clock, [c], GRACE, rounds=1)  # one token
    assert c.tier.peer_connection(fresh.address) is not None
    assert c.tier.stats()["peers_waiting"] == 2  # the silent names wait
    pump([c, fresh], 2)  # the fresh peer answered: its token is back, the next one dials
    assert c.tier.stats()["peers_waiting"] == 1


def test_a_waiting_symmetric_lookup_says_retry_then_answers(cluster: Cluster) -> None:
    c, fresh = consumer(cluster), cluster()
    ctx = c.consumer_ctx("sym", fresh, probe=True)
    c.tier.on_new_request(ctx)
    assert c.tier.lookup(b"sym/0", ctx) is LookupResult.RETRY
    advance(c.clock, [c, fresh], GRACE)
    assert probe_until(c, b"sym/0", ctx, [fresh]) is LookupResult.MISS  # fresh has no block


@pytest.mark.parametrize(
    ("end", "outcome"), [("finish", Outcome.REQUEST_FINISHED), ("shutdown", Outcome.SHUTDOWN)]
)
def test_waiting_loads_end_with_their_request_or_the_tier(
    cluster: Cluster,
    end: str,
    outcome: Outcome,
) -> None:
    c = consumer(cluster)
    ctx = silent(1, loads=c)
    if end == "finish":
        c.tier.on_request_finished(ctx)
        c.collect()
    else:
        c.shutdown()
    assert c.outcome(1001) is outcome
    if end == "finish":
        assert c.tier.stats()["peers_waiting"] == 0
        assert c.tier.state_sizes()["dial_queue"] == 0
