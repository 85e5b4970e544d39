"""Peers at fleet scale (issue 48, items 2 and 5): the warm set, the cap, and dials that make
no progress.

Memory transports on a fake clock. ``peers.connect`` lists a whole "Service" (every peer's
address); the tier keeps sessions to ``peers.warm`` of them, and a request naming any other
peer, or one outside the Service, is served: warm sessions are not counted in
``peers.max_dialed``, an idle dialed session gives way to a peer with a request, and a PD
request is dialed beyond the cap rather than refused. A dial that heard its peer is never
evicted for one that has not (the requests a flood holds wait: ``test_dial_queue.py``); an
address whose dial failed is backed off, so requests naming it cost no dial until the
backoff passes.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest
from p2pkv.dial_policy import GRACE
from p2pkv.testing.waiting import wait_until
from p2pkv.types import Outcome, RequestContext

SERVICE = 300
T = 60.0


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


def pd_request(h: Any, p: Any, c: Any, kv: str, job: int, others: Iterable[Any] = ()) -> Any:
    """One PD request from ``p`` to ``c`` (consumer first); the load's result."""
    pctx, cctx = p.producer_ctx(kv), c.consumer_ctx(kv, p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    c.load(job, h.keys(kv, 2), [0, 1], cctx)
    p.store(job + 1, h.keys(kv, 2), [2, 3], pctx)
    nodes = [p, c, *others]
    h.pump_until(nodes, lambda: job in c.results and job + 1 in p.results, rounds=100)
    for node, ctx in ((p, pctx), (c, cctx)):
        node.tier.on_request_finished(ctx)
    h.pump(nodes, 2)
    return c.results[job]


def test_a_service_of_300_ranks_keeps_a_bounded_warm_set_and_serves_any_other_rank(
    h: Any,
    cluster: Any,
) -> None:
    service = [cluster() for _ in range(SERVICE)]
    c = cluster(peers={"connect": [p.address for p in service], "resolve_interval": 30})
    everyone = [c, *service]

    def step() -> None:  # names resolve on a thread, in real time; dials wait on the clock
        c.clock.advance(0.05)
        h.pump(everyone, 1)

    wait_until(
        lambda: c.tier.stats()["peers_warm_ready"] == 32,
        timeout=T,
        what="32 warm sessions",
        pumps=[step],
    )
    stats = c.tier.stats()
    assert stats["peers_warm"] == 32 and stats["sessions"] == 32, stats
    outside = next(p for p in service if c.tier.peer_connection(p.address) is None)
    assert pd_request(h, outside, c, "cold", 1, [c]).outcome is Outcome.DONE
    stats = c.tier.stats()  # named: it joined the set, the least recently named member left
    assert stats["peers_warm"] == 32 and stats["sessions"] == 33, stats


def test_an_idle_session_gives_way_to_a_peer_with_a_request(h: Any, cluster: Any) -> None:
    c = cluster(peers={"max_dialed": 2})
    producers = [cluster() for _ in range(3)]
    for i, p in enumerate(producers[:2]):
        assert pd_request(h, p, c, f"r{i}", 10 * i + 1).outcome is Outcome.DONE
    assert c.tier.stats()["sessions"] == 2
    third = producers[2]
    assert pd_request(h, third, c, "r2", 21, producers).outcome is Outcome.DONE
    stats = c.tier.stats()
    assert stats["peers_gave_way"] == 1 and stats["peers_refused"] == 0, stats
    assert c.tier.peer_connection(producers[0].address) is None  # the least recently active


def test_when_every_dialed_session_works_a_pd_request_dials_beyond_the_cap(
    h: Any,
    cluster: Any,
) -> None:
    """A pull is refused; a PD request is served, so its producer's blocks are fetched, not
    left parked until ``timeouts.unbound_store``."""
    c = cluster(peers={"max_dialed": 1})
    busy, pd, pulled = cluster(), cluster(), cluster()
    bctx = c.consumer_ctx("busy", busy)
    c.tier.on_new_request(bctx)
    c.load(1, h.keys("busy", 1), [9], bctx)  # waits for its store: the session works
    h.pump([c, busy], 3)
    pull = c.consumer_ctx("pull", pulled, probe=True)
    c.tier.on_new_request(pull)
    assert c.tier.lookup(b"pull/0", pull).value == "miss"
    assert c.tier.stats()["peers_refused"] == 1
    assert pd_request(h, pd, c, "pd", 2, [busy]).outcome is Outcome.DONE
    assert c.tier.stats()["peers_over_cap"] == 1
    busy.store(3, h.keys("busy", 1), [5], busy.producer_ctx("busy"))
    busy.tier.on_new_request(busy.producer_ctx("busy"))
    h.pump_until([c, busy], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.DONE


def bogus(i: int) -> RequestContext:
    """A PD request naming a peer nobody listens on (its dial never hears anything)."""
    return RequestContext(
        f"bogus-{i}",
        {
            "remote_prefiller": {
                "kv_request_id": f"bogus-{i}",
                "remote_host": "127.0.0.1",
                "remote_port": 1 + i,
            }
        },
    )


def test_a_flood_of_silent_peers_never_evicts_a_dial_that_heard_its_peer(
    h: Any,
    cluster: Any,
) -> None:
    c = cluster(peers={"max_dialed": 16}, control_options={"connect_timeout": 3600})
    fresh = cluster()
    for i in range(4):  # the budget (16 // 4 new dials) and the places of silent dials
        c.tier.on_new_request(bogus(i))
    ctx, pctx = c.consumer_ctx("fresh", fresh), fresh.producer_ctx("fresh")
    c.tier.on_new_request(ctx)  # waits: no token, no place
    c.load(1, h.keys("fresh", 2), [0, 1], ctx)
    assert c.tier.stats()["peers_waiting"] == 1
    h.advance(c.clock, [c, fresh], GRACE)  # tokens again; the oldest silent dial makes way
    stats = c.tier.stats()
    assert stats["peers_evicted"] == 1 and stats["peers_dialing"] == 3, stats  # fresh heard
    for i in range(4, 200):  # the flood goes on: each name waits or replaces a stalled dial
        c.clock.advance(0.05)
        c.tier.on_new_request(bogus(i))
        c.collect()
    fresh.tier.on_new_request(pctx)
    fresh.store(2, h.keys("fresh", 2), [4, 5], pctx)
    h.pump_until([c, fresh], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.DONE
    assert (c.blocks[[0, 1]] == fresh.blocks[[4, 5]]).all()
    stats = c.tier.stats()  # the flood holds 4 dials and 16 waiting names at most
    assert stats["sessions"] <= 16 // 4 + 1 and stats["peers_waiting"] <= 16, stats


def test_an_address_whose_dial_failed_is_refused_at_once_until_its_backoff_passes(
    h: Any,
    cluster: Any,
) -> None:
    c = cluster(control_options={"connect_timeout": 0.001}, peers={"dial_backoff": 8})
    gone = cluster()
    address = gone.address
    gone.shutdown()  # nothing listens there any more
    ctx = c.consumer_ctx("a", gone)
    c.tier.on_new_request(ctx)
    wait_until(
        lambda: c.tier.stats()["sessions"] == 0,
        timeout=T,
        pumps=[c.collect],
        what="the dial to fail (nobody listens)",
    )
    for i in range(20):
        late = c.consumer_ctx(f"late{i}", gone)
        c.tier.on_new_request(late)
        c.load(100 + i, [b"k"], [0], late)
    c.collect()
    assert all(c.outcome(100 + i) is Outcome.PEER_DEAD for i in range(20))
    assert "peers.dial_backoff" in c.results[100].detail
    assert c.tier.stats()["peers_backed_off"] >= 20
    assert c.tier.stats()["sessions"] == 0  # none of them dialed
    c.clock.advance(20)  # past the backoff: dialed again
    c.tier.on_new_request(c.consumer_ctx("again", gone))
    assert c.tier.stats()["peers_dialing"] == 1
    assert c.tier.peer_connection(address) is not None


def test_a_listed_peer_that_was_not_up_when_pre_connect_dialed_it_is_served_at_once(
    h: Any,
    cluster: Any,
) -> None:
    """A static ``peers.connect`` whose peer starts after this tier (engines started together):
    the warm dial fails, and a request naming the peer once it is up is dialed at once, not
    refused by that dial's backoff. A failed request dial still backs the address off."""
    gone = cluster()
    address, port = gone.address, int(gone.address.rsplit(":", 1)[1])
    gone.shutdown()  # nothing listens there yet
    c = cluster(
        peers={"connect": [address], "dial_backoff": 8},
        control_options={"connect_timeout": 0.001},
    )
    wait_until(
        lambda: c.tier.stats()["peers_warm"] == 1,
        timeout=T,
        pumps=[c.collect],
        what="peers.connect's answer",
    )
    c.clock.advance(1.0)  # the member's first dial is due
    wait_until(
        lambda: c.tier.stats()["peers_dialing"] == 1,
        timeout=T,
        pumps=[c.collect],
        what="the warm dial",
    )
    wait_until(
        lambda: c.tier.stats()["peers_dialing"] == 0,
        timeout=T,
        pumps=[c.collect],
        what="the warm dial to fail (nobody listens)",
    )
    p = cluster(port=port)  # the peer is up now, well within the backoff
    assert p.address == address
    result = pd_request(h, p, c, "late", 1)
    assert result.outcome is Outcome.DONE, result
    assert c.tier.stats()["peers_backed_off"] == 0
