"""Room for new peers at a producer (issue 48): idle sessions consumers dialed to it give way
before its control transport runs out of room (:mod:`p2pkv.tiering.accept_room`).

Memory transports on a fake clock; the producer's transport holds ``max_connections``
connections, as a zmq context holds its socket cap, and refuses a peer's dial beyond it.
"""

from __future__ import annotations

from typing import Any

import pytest
from p2pkv.tiering.accept_room import MIN_IDLE, RECHECK, reserve
from p2pkv.types import Outcome
from test_peer_fleet import pd_request

ROOM = 4
"""The producer's transport holds this many sessions: one is kept free (``reserve(4)``)."""


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


def test_the_reserve_is_one_in_sixteen_within_one_to_eight() -> None:
    assert [reserve(n) for n in (1, 4, 16, 47, 128, 340, 11_000)] == [1, 1, 1, 2, 8, 8, 8]


def test_an_idle_accepted_session_gives_way_so_a_new_consumer_is_served(
    h: Any, cluster: Any
) -> None:
    p = cluster(control_options={"max_connections": ROOM})
    consumers = [cluster() for _ in range(ROOM + 2)]
    for i, c in enumerate(consumers[: ROOM - 1]):
        assert pd_request(h, p, c, f"r{i}", 10 * i + 1, consumers).outcome is Outcome.DONE
    stats = p.tier.stats()
    assert stats["sessions"] == ROOM - 1 and stats["sessions_free"] == 1, stats
    assert stats["peers_accepted_gave_way"] == 0, stats
    h.advance(p.clock, [p, *consumers], MIN_IDLE)
    for i, c in enumerate(consumers[ROOM - 1 :], start=ROOM - 1):
        assert pd_request(h, p, c, f"r{i}", 10 * i + 1, consumers).outcome is Outcome.DONE
        h.advance(p.clock, [p, *consumers], MIN_IDLE)
    stats = p.tier.stats()
    assert stats["peers_accepted"] == ROOM + 2 and stats["peers_accept_refused"] == 0, stats
    assert stats["peers_accepted_gave_way"] == 3 and stats["sessions_free"] == 1, stats
    first = consumers[0]  # the least recently active gave way first: its next request dials
    assert first.tier.peer_connection(p.address) is None
    assert pd_request(h, p, first, "again", 99, consumers).outcome is Outcome.DONE
    assert first.tier.stats()["peers_backed_off"] == 0


def test_working_sessions_keep_their_room_and_the_refused_consumer_is_told(
    h: Any, cluster: Any
) -> None:
    """Sessions that carry a request never give way: a new consumer is refused by the
    transport (counted), its load fails at once, and once a session turns idle the reserve
    is restored within ``RECHECK``."""
    p = cluster(control_options={"max_connections": 2})
    busy = [cluster() for _ in range(2)]
    late = cluster()
    everyone = [p, *busy, late]
    for i, c in enumerate(busy):  # loads waiting for their stores: both sessions work
        ctx = c.consumer_ctx(f"b{i}", p)
        p.tier.on_new_request(p.producer_ctx(f"b{i}"))
        c.tier.on_new_request(ctx)
        c.load(i + 1, h.keys(f"b{i}", 1), [0], ctx)
    h.pump(everyone, 3)
    h.advance(p.clock, everyone, MIN_IDLE)
    ctx = late.consumer_ctx("late", p)
    late.tier.on_new_request(ctx)
    late.load(9, h.keys("late", 1), [0], ctx)
    h.pump_until(everyone, lambda: 9 in late.results)
    assert late.outcome(9) is Outcome.PEER_DEAD
    stats = p.tier.stats()
    assert stats["peers_accept_refused"] == 1 and stats["peers_accepted_gave_way"] == 0, stats
    assert stats["sessions_free"] == 0, stats
    for i in range(len(busy)):  # the stores come: the loads end, the sessions idle
        p.store(i + 11, h.keys(f"b{i}", 1), [i + 2], p.producer_ctx(f"b{i}"))
    h.pump_until(everyone, lambda: all(i + 1 in c.results for i, c in enumerate(busy)))
    assert all(c.outcome(i + 1) is Outcome.DONE for i, c in enumerate(busy))
    for i, c in enumerate(busy):
        for node, node_ctx in ((p, p.producer_ctx(f"b{i}")), (c, c.consumer_ctx(f"b{i}", p))):
            node.tier.on_request_finished(node_ctx)
    h.pump(everyone, 3)  # the requests' last frames
    h.advance(p.clock, everyone, MIN_IDLE + RECHECK)
    stats = p.tier.stats()
    assert stats["peers_accepted_gave_way"] == 1 and stats["sessions_free"] == 1, stats
