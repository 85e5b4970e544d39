"""P2PTier end to end over the memory transports (fake clock, optional fault injection)."""

from __future__ import annotations

import itertools
import threading
from collections.abc import Collection
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from p2pkv.config import TierConfig
from p2pkv.errors import ConcurrentCall, ConfigError
from p2pkv.hookspecs import hookimpl
from p2pkv.reference.faults import Fault, FaultInjector
from p2pkv.registry import Registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, LookupResult, Outcome, RequestContext


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


class Source:
    """A LocalHitSource over a dict key -> slot of a node's region."""

    ids = itertools.count(10_000)

    def __init__(
        self, node: Any, have: dict[bytes, int], retry: Collection[bytes] = frozenset()
    ) -> None:
        self.node, self.have, self.retry = node, have, set(retry)
        self.begun: list[str] = []
        self.ended: list[object] = []
        self.pinned: list[int] = []

    def begin(self, kv: str) -> object:
        self.begun.append(kv)
        return (kv, len(self.begun))

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        if key in self.retry:
            self.retry.discard(key)
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.have else LookupResult.MISS

    def pin(self, handle: object, keys: list[bytes]) -> Job:
        job_id = next(self.ids)
        self.node.submitted.add(job_id)
        self.pinned.append(job_id)
        return Job(job_id, keys, [self.have[k] for k in keys], False, RequestContext("pin"))

    def end(self, handle: object) -> None:
        self.ended.append(handle)


def pd_pair(cluster: Any, **kw: Any) -> tuple[Any, Any]:
    return cluster(**kw), cluster(**kw)


# -- both orders, rounds, cleanliness ----------------------------------------------------------


@pytest.mark.parametrize("order", ["producer_first", "consumer_first"])
def test_pd_request_moves_byte_exact_in_both_orders(h: Any, cluster: Any, order: str) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r1"), c.consumer_ctx("r1", p)
    assert p.tier.on_new_request(pctx) is True
    assert c.tier.on_new_request(cctx) is False
    ks = h.keys("r1", 32)
    src, dst = list(range(32)), list(range(10, 42))
    if order == "producer_first":
        p.store(1, ks, src, pctx)
        h.pump([p, c], 3)
        c.load(2, ks, dst, cctx)
    else:
        c.load(2, ks, dst, cctx)
        h.pump([p, c], 3)
        p.store(1, ks, src, pctx)
    h.pump_until([p, c], lambda: len(p.results) + len(c.results) == 2)
    assert p.outcome(1) is Outcome.DONE and c.outcome(2) is Outcome.DONE
    assert (c.blocks[dst] == p.blocks[src]).all()
    p.tier.on_request_finished(pctx)
    c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)
    assert not p.tier.has_pending_work() and not c.tier.has_pending_work()


def test_connect_ahead_readies_the_session_the_first_request_uses(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    assert c.tier.connect(p.tier.local_address) is True
    h.pump([p, c], 3)
    assert c.tier.stats()["sessions_ready"] == 1 and p.tier.stats()["sessions_ready"] == 1
    assert not c.tier.has_pending_work() and not p.tier.has_pending_work()
    assert c.tier.connect(p.tier.local_address) is True  # kept, not redialled
    pctx, cctx = p.producer_ctx("pre"), c.consumer_ctx("pre", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    ks = h.keys("pre", 4)
    p.store(1, ks, [0, 1, 2, 3], pctx)
    c.load(2, ks, [4, 5, 6, 7], cctx)
    h.pump_until([p, c], lambda: len(p.results) + len(c.results) == 2)
    assert p.outcome(1) is Outcome.DONE and c.outcome(2) is Outcome.DONE
    assert c.tier.stats()["sessions"] == 1 and p.tier.stats()["sessions"] == 1


def test_connect_to_an_undialable_address_says_no(h: Any, cluster: Any) -> None:
    c = cluster()
    assert c.tier.connect(c.tier.local_address) is False  # the memory transport refuses itself
    assert c.tier.stats()["sessions"] == 0
    c.tier.shutdown()
    assert c.tier.connect("127.0.0.1:1") is False


def test_several_load_rounds_complete_independently(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    ks = h.keys("r", 24)
    c.load(10, ks[:8], list(range(0, 8)), cctx)
    c.load(11, ks[8:16], list(range(8, 16)), cctx)
    c.load(12, ks[16:], list(range(16, 24)), cctx)
    h.pump([p, c], 3)
    p.store(1, ks[8:16], list(range(40, 48)), pctx)  # only round 1's blocks so far
    h.pump_until([p, c], lambda: 11 in c.results)
    assert c.outcome(11) is Outcome.DONE and 10 not in c.results and 12 not in c.results
    p.store(2, ks[:8] + ks[16:], list(range(48, 64)), pctx)
    h.pump_until([p, c], lambda: {10, 12} <= set(c.results) and 2 in p.results)
    assert c.outcome(10) is Outcome.DONE and c.outcome(12) is Outcome.DONE
    assert (c.blocks[8:16] == p.blocks[40:48]).all()
    assert (c.blocks[0:8] == p.blocks[48:56]).all() and (c.blocks[16:24] == p.blocks[56:64]).all()
    assert p.outcome(1) is Outcome.DONE and p.outcome(2) is Outcome.DONE
    p.tier.on_request_finished(pctx)
    c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)


def test_blocks_the_consumer_never_needs_are_released_by_its_finish(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    ks = h.keys("r", 8)
    p.store(1, ks, list(range(8)), pctx)  # the consumer had the first 4 as prefix hits
    c.load(2, ks[4:], list(range(4)), cctx)
    h.pump_until([p, c], lambda: 2 in c.results)
    assert 1 not in p.results  # 4 blocks still pinned for a possible later round
    c.tier.on_request_finished(cctx)
    p.tier.on_request_finished(pctx)
    h.pump_until([p, c], lambda: 1 in p.results)
    assert p.outcome(1) is Outcome.DONE
    h.assert_clean(p, c)


def test_one_producer_serves_two_consumers_and_both_roles_share_a_session(
    h: Any, cluster: Any
) -> None:
    a, b, c = cluster(), cluster(), cluster()
    for i, cons in enumerate((b, c)):
        kv = f"r{i}"
        pctx, cctx = a.producer_ctx(kv), cons.consumer_ctx(kv, a)
        a.tier.on_new_request(pctx)
        cons.tier.on_new_request(cctx)
        a.store(i, h.keys(kv, 4), [4 * i + j for j in range(4)], pctx)
        cons.load(100 + i, h.keys(kv, 4), [0, 1, 2, 3], cctx)
    # b also produces for a over the same session
    pctx, cctx = b.producer_ctx("back"), a.consumer_ctx("back", b)
    b.tier.on_new_request(pctx)
    a.tier.on_new_request(cctx)
    b.store(7, h.keys("back", 2), [30, 31], pctx)
    a.load(8, h.keys("back", 2), [60, 61], cctx)
    h.pump_until(
        [a, b, c], lambda: len(a.results) == 3 and len(b.results) == 2 and len(c.results) == 1
    )
    assert all(r.outcome is Outcome.DONE for n in (a, b, c) for r in n.results.values())
    assert (b.blocks[0:4] == a.blocks[0:4]).all() and (c.blocks[0:4] == a.blocks[4:8]).all()
    assert (a.blocks[60:62] == b.blocks[30:32]).all()
    assert a.tier.stats()["sessions"] == 2


# -- routing and lookups -----------------------------------------------------------------------


def test_lookup_pd_is_eager_hit_and_failed_ids_miss_until_finished(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    cctx = c.consumer_ctx("r", p)
    assert c.tier.lookup(b"k", RequestContext("x")) is LookupResult.MISS
    c.tier.on_new_request(cctx)
    assert c.tier.lookup(b"k", cctx) is LookupResult.HIT
    c.load(1, [b"k"], [0], cctx)
    h.pump([p, c], 3)
    h.advance(cluster.clock, [p, c], 31)  # load timeout -> abort -> ack
    assert c.outcome(1) is Outcome.LOAD_TIMEOUT
    assert c.tier.lookup(b"k", cctx) is LookupResult.MISS
    c.tier.on_request_finished(cctx)
    again = c.consumer_ctx("r", p)
    c.tier.on_new_request(again)
    assert c.tier.lookup(b"k", again) is LookupResult.HIT


def test_symmetric_lookup_batches_one_probe_per_request_and_step(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    ks = h.keys("s", 6)
    src = Source(p, {ks[0]: 20, ks[1]: 21, ks[3]: 23}, retry={ks[1]})
    p.tier.serve_lookups(src)  # an engine offers its source every step from the start
    cctx = c.consumer_ctx("s", p, probe=True)
    c.tier.on_new_request(cctx)
    h.pump([p, c], 3)
    assert [c.tier.lookup(k, cctx) for k in ks[:4]] == [LookupResult.RETRY] * 4
    c.tier.on_schedule_end()
    assert [c.tier.lookup(k, cctx) for k in ks[4:]] == [LookupResult.RETRY] * 2
    h.pump([p, c], 2)
    p.tier.serve_lookups(src)  # ks[1] answers RETRY once: that lookup waits
    h.pump([p, c], 2)
    assert src.begun == ["s"]
    c.tier.on_schedule_end()  # second batch: ks[4:]
    h.pump([p, c], 2)
    p.tier.serve_lookups(src)
    h.pump([p, c], 2)
    assert src.begun == ["s", "s"] and len(src.ended) == 2
    got = [c.tier.lookup(k, cctx) for k in ks]
    H, M = LookupResult.HIT, LookupResult.MISS
    assert got == [H, H, M, H, M, M]
    # load the prefix of hits; the pinned blocks move
    c.load(5, [ks[0], ks[1]], [0, 1], cctx)
    h.pump_until([p, c], lambda: 5 in c.results)
    assert c.outcome(5) is Outcome.DONE
    assert (c.blocks[0:2] == p.blocks[20:22]).all()
    c.tier.on_request_finished(cctx)
    h.pump_until([p, c], lambda: set(src.pinned) <= set(p.results))
    assert p.outcome(src.pinned[0]) is Outcome.DONE  # ks[0], ks[1] delivered, ks[3] unneeded
    h.assert_clean(p, c)


def test_symmetric_lookup_without_a_hit_source_answers_miss_at_once(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    cctx = c.consumer_ctx("s", p, probe=True)
    c.tier.on_new_request(cctx)
    h.pump([p, c], 3)
    assert c.tier.lookup(b"a", cctx) is LookupResult.RETRY
    assert h.probe_until(c, b"a", cctx, [p]) is LookupResult.MISS
    c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)


def test_symmetric_lookup_deadline_answers_miss(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    src = Source(p, {}, retry={b"a"})
    p.tier.serve_lookups(src)  # a source exists, but the engine stops calling in
    cctx = c.consumer_ctx("s", p, probe=True)
    c.tier.on_new_request(cctx)
    h.pump([p, c], 3)
    c.tier.lookup(b"a", cctx)
    c.tier.on_schedule_end()
    h.pump([p, c], 3)
    assert c.tier.lookup(b"a", cctx) is LookupResult.RETRY
    h.advance(cluster.clock, [p, c], p.tier._config.timeouts.lookup + 0.1)
    assert c.tier.lookup(b"a", cctx) is LookupResult.MISS
    c.tier.on_request_finished(cctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)


def test_jobs_without_a_route_finish_at_once(h: Any, cluster: Any) -> None:
    (c,) = (cluster(),)
    plain = RequestContext("plain")
    bad = RequestContext("bad", {"remote_prefiller": {"kv_request_id": "x"}})  # no host/port
    c.store(1, [b"a"], [0], plain)
    c.load(2, [b"a"], [0], plain)
    c.load(3, [b"a"], [0], bad)
    c.store(4, [b"a"], [0], bad)
    c.load(5, [], [], c.consumer_ctx("r", c))
    c.collect()
    assert c.outcome(1) is Outcome.NOTHING_TO_DO
    assert c.outcome(2) is Outcome.NO_ROUTE and c.outcome(3) is Outcome.NO_ROUTE
    assert c.outcome(4) is Outcome.NO_ROUTE  # refused params fail stores too
    assert c.results[3].detail  # the reason travels in the detail
    assert c.outcome(5) is Outcome.NOTHING_TO_DO


@pytest.mark.parametrize(
    "job, match",
    [
        (Job(1, [b"a", b"b"], [0], True, RequestContext("r")), "keys but"),
        (Job(1, [b"a"], [64], True, RequestContext("r")), "not a slot"),
        (Job(1, [b"a", b"a"], [0, 1], True, RequestContext("r")), "duplicate keys"),
        (Job(1, [b"a", b"b"], [1, 1], True, RequestContext("r")), "duplicate block ids"),
        (Job(1, ["a"], [1], True, RequestContext("r")), "keys must be"),  # type: ignore[list-item]
        (Job(1, [b"a"], [0], False, RequestContext("r")), "is_load=True"),
    ],
)
def test_malformed_load_jobs_raise_and_record_nothing(
    h: Any, cluster: Any, job: Job, match: str
) -> None:
    p, c = pd_pair(cluster)
    job.ctx = c.consumer_ctx("r", p)
    with pytest.raises(ValueError, match=match):
        c.tier.submit_load(job)
    assert c.tier.state_sizes()["jobs_open"] == 0


def test_duplicate_job_id_in_flight_is_refused(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    cctx = c.consumer_ctx("r", p)
    c.load(1, [b"a"], [0], cctx)
    with pytest.raises(ValueError, match="already in flight"):
        c.tier.submit_load(Job(1, [b"b"], [1], True, cctx))


def test_numpy_block_ids_are_accepted(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.submitted.add(1)
    p.tier.submit_store(Job(1, h.keys("r", 3), np.array([5, 6, 7]), False, pctx))  # type: ignore[arg-type]
    c.submitted.add(2)
    c.tier.submit_load(
        Job(
            2,
            h.keys("r", 3),
            np.array([1, 2, 3], dtype=np.int32),  # type: ignore[arg-type]
            True,
            cctx,
        )
    )
    h.pump_until([p, c], lambda: 1 in p.results and 2 in c.results)
    assert c.outcome(2) is Outcome.DONE and (c.blocks[1:4] == p.blocks[5:8]).all()


# -- failures and timeouts --------------------------------------------------------------------


def test_load_timeout_reports_at_once_and_nothing_lands_later(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.load(1, [b"a"], [0], cctx)
    h.pump([p, c], 3)
    before = c.blocks[0].copy()
    cluster.clock.advance(30.5)
    c.collect()  # the consumer owns its slots: no confirmation to wait for
    assert c.outcome(1) is Outcome.LOAD_TIMEOUT
    p.store(2, [b"a"], [3], pctx)  # the given-up demand must not be served later
    h.pump([p, c], 6)
    assert (c.blocks[0] == before).all()


def test_a_silent_producer_fails_the_load_at_its_deadline(h: Any, cluster: Any) -> None:
    faults = FaultInjector(seed=1)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        cctx = c.consumer_ctx("r", p)
        c.load(1, [b"a"], [0], cctx)
        h.pump([p, c], 3)
        faults.arm(Fault.DROP, peer=p.address)  # everything c sends to p is lost
        h.advance(cluster.clock, [p, c], 29.5)
        assert 1 not in c.results
        h.advance(cluster.clock, [p, c], 1)
        assert c.outcome(1) is Outcome.LOAD_TIMEOUT
    finally:
        p.shutdown()
        c.shutdown()


def test_consumer_finishing_mid_load_gets_request_finished(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    c.load(1, h.keys("r", 2), [0, 1], cctx)
    p.store(2, h.keys("r", 1), [9], pctx)  # half the blocks: the round stays open
    h.pump([p, c], 4)
    c.tier.on_request_finished(cctx)
    c.collect()
    assert c.outcome(1) is Outcome.REQUEST_FINISHED  # at once: its reads are cancelled
    h.pump_until([p, c], lambda: 2 in p.results)
    assert p.outcome(2) is Outcome.ABORTED  # released unread: the consumer gave it up
    p.tier.on_request_finished(pctx)
    h.pump([p, c], 3)
    h.assert_clean(p, c)


def test_unmet_demand_fails_when_the_producer_request_finishes(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.load(1, h.keys("r", 3), [0, 1, 2], cctx)
    p.store(2, h.keys("r", 2), [5, 6], pctx)
    h.pump([p, c], 4)
    assert not c.results
    p.tier.on_request_finished(pctx)
    h.pump_until([p, c], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.DEMAND_UNMET
    c.tier.on_request_finished(RequestContext("x", cctx.kv_transfer_params))
    h.pump_until([p, c], lambda: 2 in p.results)
    h.assert_clean(p, c)


def test_fetch_after_the_producer_finished_with_too_little_fails_fast(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    p.store(1, h.keys("r", 1), [0], pctx)
    p.tier.on_request_finished(pctx)
    c.load(2, h.keys("r", 2), [0, 1], cctx)
    h.pump_until([p, c], lambda: 2 in c.results)
    assert c.outcome(2) is Outcome.DEMAND_UNMET


def test_store_timeout_and_unbound_timeout(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    p.store(1, h.keys("r", 2), [0, 1], pctx)
    c.load(2, h.keys("r", 1), [0], cctx)  # binds the request; one block stays undelivered
    h.pump_until([p, c], lambda: 2 in c.results)
    p.store(3, [b"other"], [5], p.producer_ctx("unbound"))
    h.advance(cluster.clock, [p, c], 30.5)
    assert p.outcome(1) is Outcome.STORE_TIMEOUT and 3 not in p.results
    h.advance(cluster.clock, [p, c], 30)
    assert p.outcome(3) is Outcome.UNBOUND_TIMEOUT


def test_transfer_and_submit_failures(h: Any, cluster: Any) -> None:
    faults = FaultInjector(seed=3)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        faults.arm(Fault.FAIL_COMPLETION, count=1)
        p.store(1, [b"a"], [0], pctx)
        c.load(2, [b"a"], [0], cctx)
        h.pump_until([p, c], lambda: 1 in p.results and 2 in c.results)
        assert c.outcome(2) is Outcome.TRANSFER_FAILED  # the consumer's read failed
        assert p.outcome(1) is Outcome.ABORTED  # and it released the pin unread
        pctx2, cctx2 = p.producer_ctx("s"), c.consumer_ctx("s", p)
        faults.arm(Fault.FAIL_SUBMIT, count=1)
        p.store(3, [b"b"], [1], pctx2)
        c.load(4, [b"b"], [1], cctx2)
        h.pump_until([p, c], lambda: 3 in p.results and 4 in c.results)
        assert c.outcome(4) is Outcome.SUBMIT_FAILED and p.outcome(3) is Outcome.ABORTED
    finally:
        p.shutdown()
        c.shutdown()


def test_killed_connection_fails_both_sides_with_peer_dead(h: Any, cluster: Any) -> None:
    faults = FaultInjector(seed=4)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        p.tier.on_new_request(pctx)
        c.load(1, h.keys("r", 2), [0, 1], cctx)
        p.store(2, h.keys("r", 1), [4], pctx)
        h.pump([p, c], 4)
        faults.arm(Fault.KILL, peer=p.address, count=1)
        c.load(3, h.keys("r", 1, 5), [7], cctx)  # the send kills the connection
        h.pump_until([p, c], lambda: {1, 3} <= set(c.results))
        assert c.outcome(1) is Outcome.PEER_DEAD and c.outcome(3) is Outcome.PEER_DEAD
        assert 2 not in p.results  # its pinned block may still be being read: the lease runs
        h.advance(cluster.clock, [p, c], p.tier._config.timeouts.lease + 0.5)
        assert p.outcome(2) is Outcome.PEER_DEAD
        assert c.tier.lookup(b"x", cctx) is LookupResult.MISS
        p.store(4, h.keys("r", 1, 1), [5], pctx)  # the binding died with the session: parks
        h.pump([p, c], 2)
        assert 4 not in p.results
    finally:
        p.shutdown()
        c.shutdown()
    assert p.outcome(4) is Outcome.SHUTDOWN


def test_incompatible_peers_are_rejected_with_a_reason_on_both_sides(h: Any, cluster: Any) -> None:
    p = cluster(hash_seed="1")
    c = cluster(hash_seed="2")
    cctx = c.consumer_ctx("r", p)
    c.load(1, [b"a"], [0], cctx)
    h.pump_until([p, c], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.PEER_REJECTED
    assert "seed" in c.results[1].detail
    assert p.tier.stats()["handshake_rejections"] == 1
    assert c.tier.stats()["handshake_rejections"] == 1


def test_handshake_timeout(h: Any, cluster: Any) -> None:
    faults = FaultInjector(seed=5)
    p, c = cluster(faults=faults), cluster(faults=faults)
    try:
        faults.arm(Fault.DROP, peer=p.address)
        cctx = c.consumer_ctx("r", p)
        c.load(1, [b"a"], [0], cctx)
        h.pump([p, c], 3)
        assert c.tier.has_pending_work()
        h.advance(cluster.clock, [p, c], 10.5)
        assert c.outcome(1) is Outcome.PEER_DEAD and "handshake" in c.results[1].detail
    finally:
        p.shutdown()
        c.shutdown()


# -- pending work, drain, shutdown -------------------------------------------------------------


def test_pending_work_and_engine_work_only_while_work_exists(h: Any, cluster: Any) -> None:
    """``has_pending_work`` counts a handshake; ``needs_engine``, the work only an engine's
    calls can do or collect, does not (a tick completes a handshake). A job is both."""
    p, c = pd_pair(cluster)

    def work(*nodes: Any) -> list[tuple[bool, bool]]:
        return [(n.tier.has_pending_work(), n.tier.needs_engine()) for n in nodes]

    assert work(p, c) == [(False, False)] * 2
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    c.tier.on_new_request(cctx)
    assert work(c) == [(True, False)]  # handshake in progress
    h.pump([p, c], 3)
    assert work(p, c) == [(False, False)] * 2
    c.load(1, [b"a"], [0], cctx)
    assert work(c) == [(True, True)]
    p.store(2, [b"a"], [0], pctx)
    assert work(p) == [(True, True)]
    h.pump_until([p, c], lambda: 1 in c.results and 2 in p.results)
    assert work(p, c) == [(False, False)] * 2


def test_drain_jobs_waits_for_results_and_is_bounded(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    c.tier.on_new_request(cctx)
    h.pump([p, c], 3)  # handshake done
    c.load(1, [b"a"], [0], cctx)
    c.tier.tick()  # fetch out
    p.store(2, [b"a"], [0], pctx)
    p.tier.tick()  # fetch in, write posted, transfer_done out
    p.tier.drain_jobs(timeout=5)  # the store completes on the producer's own ticks
    c.tier.drain_jobs(timeout=5)  # the load completes on the consumer's own ticks
    p.collect()
    c.collect()
    assert c.outcome(1) is Outcome.DONE and p.outcome(2) is Outcome.DONE
    c.load(3, [b"zz"], [1], cctx)  # never served: drain returns at its deadline, no abort
    c.tier.drain_jobs(timeout=0.05)
    c.collect()
    assert 3 not in c.results and c.tier.has_pending_work()


def test_shutdown_answers_every_job_exactly_once(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster, data_options={"completion_polls": 50})
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.load(1, h.keys("r", 2), [0, 1], cctx)
    p.store(2, h.keys("r", 2), [4, 5], pctx)  # in flight for 50 polls
    p.store(3, [b"parked"], [6], p.producer_ctx("other"))
    c.load(4, [b"never"], [9], c.consumer_ctx("q", p))
    h.pump([p, c], 4)
    p.shutdown()
    assert p.outcome(2) is Outcome.SHUTDOWN and p.outcome(3) is Outcome.SHUTDOWN
    assert p.tier.shutdown() == []  # idempotent
    h.pump_until([c], lambda: {1, 4} <= set(c.results))
    assert c.outcome(1) is Outcome.PEER_DEAD and c.outcome(4) is Outcome.PEER_DEAD
    c.shutdown()
    c.load(5, [b"late"], [0], cctx)
    c.record(c.tier.get_finished_jobs())
    assert c.outcome(5) is Outcome.SHUTDOWN


def test_producer_shutdown_with_a_read_in_flight_leaves_the_slot_final(
    h: Any, cluster: Any
) -> None:
    p, c = pd_pair(cluster, data_options={"completion_polls": 3})
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    c.load(1, [b"a"], [0], cctx)
    h.pump([p, c], 3)
    p.store(2, [b"a"], [4], pctx)
    p.tier.tick()  # ready out
    c.tier.tick()  # read posted, completes after 3 polls
    assert c.tier.stats()["in_flight_transfers"] == 1
    p.tier._config = replace(
        p.tier._config, timeouts=replace(p.tier._config.timeouts, shutdown_drain=0.05)
    )
    p.shutdown()
    assert p.outcome(2) is Outcome.SHUTDOWN
    h.pump_until([c], lambda: 1 in c.results)
    after = c.blocks[0].copy()
    h.pump([c], 6)
    assert (c.blocks[0] == after).all()  # whatever the outcome, nothing lands after it


def test_stats_and_local_address(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    assert p.tier.local_address == p.address and p.address.startswith("127.0.0.1:")
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.store(1, h.keys("r", 4), [0, 1, 2, 3], pctx)
    c.load(2, h.keys("r", 4), [0, 1, 2, 3], cctx)
    h.pump_until([p, c], lambda: 1 in p.results and 2 in c.results)
    s = p.tier.stats()
    assert s["jobs_done"] == 1 and s["blocks_sent"] == 4 and s["bytes_sent"] == 4 * 16
    assert s["sessions"] == 1 and s["sessions_ready"] == 1 and s["jobs_pending"] == 0
    assert "descriptors_posted" not in s  # the memory data transport does not count them


# -- construction and observers ----------------------------------------------------------------


def test_tier_builds_its_transports_from_the_config(h: Any) -> None:
    region = bytearray(8 * 16)
    tier = P2PTier(h.config(), memoryview(region), 16, registry=h.REGISTRY)
    try:
        assert tier.local_address.startswith("127.0.0.1:")
    finally:
        tier.shutdown()


@pytest.mark.parametrize(
    "size, block_len, match",
    [
        (100, 16, "multiple"),
        (0, 16, "multiple"),
        (64, 0, "block_len"),
    ],
)
def test_bad_region_shapes_are_config_errors(h: Any, size: int, block_len: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        P2PTier(h.config(), memoryview(bytearray(size)), block_len, registry=h.REGISTRY)


def test_unknown_transport_names_fail_at_construction(h: Any) -> None:
    cfg = TierConfig.from_dict({"control": "memory", "data": "nope", "port": 0})
    with pytest.raises(ConfigError, match="unknown data transport 'nope'"):
        P2PTier(cfg, memoryview(bytearray(64)), 16, registry=h.REGISTRY)


def test_observers_see_sessions_transfers_jobs_and_timeouts(h: Any, cluster: Any) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []

    class Plugin:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_session_opened(self, peer: str, local: str) -> None:
            seen.append(("session_opened", {"peer": peer}))

        @hookimpl
        def p2pkv_session_closed(self, peer: str, reason: str) -> None:
            seen.append(("session_closed", {"reason": reason}))

        @hookimpl
        def p2pkv_transfer_submitted(self, peer: str, transfer_id: int, blocks: int) -> None:
            seen.append(("transfer_submitted", {"blocks": blocks}))

        @hookimpl
        def p2pkv_transfer_finished(self, transfer_id: int, success: bool) -> None:
            seen.append(("transfer_finished", {"success": success}))

        @hookimpl
        def p2pkv_job_finished(self, job_id: int, outcome: str) -> None:
            seen.append(("job_finished", {"job_id": job_id, "outcome": outcome}))

        @hookimpl
        def p2pkv_timeout(self, kind: str) -> None:
            seen.append(("timeout", {"kind": kind}))

        @hookimpl
        def p2pkv_tier_state(self, sessions: int) -> None:
            seen.append(("tier_state", {"sessions": sessions}))

    names = (
        "session_opened",
        "session_closed",
        "transfer_submitted",
        "transfer_finished",
        "job_finished",
        "timeout",
        "tier_state",
    )
    plugin = Plugin()
    import p2pkv_memory.plugin as memory_plugin

    reg = Registry.from_plugins([("memory", memory_plugin), ("obs", plugin)])
    assert reg.observers.enabled
    tiers = [
        P2PTier(h.config(), memoryview(bytearray(8 * 16)), 16, registry=reg, clock=cluster.clock)
        for _ in range(2)
    ]
    p, c = tiers
    try:
        host, port = p.local_address.rsplit(":", 1)
        cctx = RequestContext(
            "c",
            {
                "remote_prefiller": {
                    "kv_request_id": "r",
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        pctx = RequestContext("p", {"remote_decoder": {"kv_request_id": "r"}})
        p.submit_store(Job(1, [b"a"], [0], False, pctx))
        c.submit_load(Job(2, [b"a"], [0], True, cctx))
        c.submit_load(Job(3, [b"b"], [1], True, cctx))
        for _ in range(6):
            p.get_finished_jobs()
            c.get_finished_jobs()
        cluster.clock.advance(31)
        for _ in range(4):
            p.get_finished_jobs()
            c.get_finished_jobs()
        c.on_schedule_end()
    finally:
        p.shutdown()
        c.shutdown()
    kinds = {name for name, _ in seen}
    assert set(names) <= kinds
    jobs = [kw for name, kw in seen if name == "job_finished"]
    assert sorted((kw["job_id"], kw["outcome"]) for kw in jobs) == [
        (1, "done"),
        (2, "done"),
        (3, "load_timeout"),
    ]
    assert any(kw["kind"] == "load" for name, kw in seen if name == "timeout")


def test_a_hello_with_a_new_epoch_on_a_live_connection_restarts_the_session(
    h: Any, cluster: Any
) -> None:
    from p2pkv.addressing import parse_address
    from p2pkv.protocol import Fetch, Hello, HelloAck

    c = cluster()
    with h.RawPeer(c) as peer:
        ours, ack = peer.send(peer.hello(epoch=1))
        assert isinstance(ours, Hello) and ack == HelloAck(1)
        peer.send(HelloAck(ours.epoch))
        host, port = parse_address(peer.ctl.local_address)
        cctx = RequestContext(
            "c",
            {"remote_prefiller": {"kv_request_id": "r", "remote_host": host, "remote_port": port}},
        )
        c.load(1, [b"a"], [0], cctx)
        assert peer.send() == [Fetch("r", 0, [b"a"])]
        msgs = peer.send(peer.hello(epoch=2))  # the peer restarted behind the same connection
        c.collect()
        assert c.outcome(1) is Outcome.PEER_DEAD and "restarted" in c.results[1].detail
        assert msgs == [ours, HelloAck(2)]  # a fresh session: our hello again, then the ack
        assert c.tier.stats()["sessions"] == 1
        peer.send(HelloAck(ours.epoch))
        assert c.tier.lookup(b"a", cctx) is LookupResult.MISS  # "r" failed until it finishes
        c.load(
            2,
            [b"b"],
            [1],
            RequestContext(
                "c2",
                {
                    "remote_prefiller": {
                        "kv_request_id": "q",
                        "remote_host": host,
                        "remote_port": port,
                    }
                },
            ),
        )
        assert peer.send() == [Fetch("q", 0, [b"b"])]  # the new session works


# -- engine misuse that must not crash the engine or the session -------------------------------


def test_numpy_integer_block_ids_in_a_list_are_accepted(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.store(1, h.keys("r", 2), [np.int64(5), np.int32(6)], pctx)
    c.load(2, h.keys("r", 2), [np.int64(1), np.uint16(2)], cctx)
    h.pump_until([p, c], lambda: 1 in p.results and 2 in c.results)
    assert c.outcome(2) is Outcome.DONE and (c.blocks[1:3] == p.blocks[5:7]).all()


@pytest.mark.parametrize("ids, match", [([True], "not an integer"), ([1.0], "not an integer")])
def test_block_ids_that_are_not_integers_raise(
    h: Any, cluster: Any, ids: list[Any], match: str
) -> None:
    p, c = pd_pair(cluster)
    with pytest.raises(ValueError, match=match):
        c.tier.submit_load(Job(1, [b"a"], ids, True, c.consumer_ctx("r", p)))


@pytest.mark.parametrize(
    "limits, fragment",
    [
        ({"max_keys_per_message": 8}, "16 blocks exceed limits.max_keys_per_message=8"),
        ({"max_frame_bytes": 600}, "would exceed limits.max_frame_bytes=600"),
    ],
)
def test_a_job_over_the_limits_fails_and_the_engine_call_returns(
    h: Any, cluster: Any, limits: dict[str, int], fragment: str
) -> None:
    p, c = pd_pair(cluster, limits=limits)
    ks = h.keys("r", 16)
    c.load(1, ks, list(range(16)), c.consumer_ctx("r", p))
    if "max_keys_per_message" in limits:
        p.store(2, ks, list(range(16)), p.producer_ctx("r"))
    h.pump([p, c], 2)
    assert c.outcome(1) is Outcome.SUBMIT_FAILED and fragment in c.results[1].detail
    if "max_keys_per_message" in limits:
        assert p.outcome(2) is Outcome.SUBMIT_FAILED and fragment in p.results[2].detail


def test_two_loads_of_the_same_keys_fail_only_the_second_job(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    cctx = c.consumer_ctx("dup", p)
    ks = h.keys("dup", 4)
    c.load(1, ks, [0, 1, 2, 3], cctx)
    c.load(2, ks[2:], [8, 9], cctx)
    others = [f"r{i}" for i in range(20)]
    for i, kv in enumerate(others):
        c.load(100 + i, h.keys(kv, 2), [20 + 2 * i, 21 + 2 * i], c.consumer_ctx(kv, p))
    h.pump([p, c], 2)
    assert c.outcome(2) is Outcome.REQUEST_CONFLICT
    assert (
        "2 of its blocks are already being loaded for request 'dup' by job 1" in c.results[2].detail
    )
    p.store(3, ks, [0, 1, 2, 3], p.producer_ctx("dup"))
    for i, kv in enumerate(others):
        p.store(200 + i, h.keys(kv, 2), [10 + i, 40 + i], p.producer_ctx(kv))
    h.pump_until([p, c], lambda: len(c.results) == 22 and len(p.results) == 21)
    assert c.outcome(1) is Outcome.DONE and (c.blocks[0:4] == p.blocks[0:4]).all()
    assert all(c.outcome(100 + i) is Outcome.DONE for i in range(20))
    assert c.tier.stats()["sessions"] == 1


def test_a_second_thread_inside_the_tier_gets_a_clear_error(h: Any, cluster: Any) -> None:
    p, c = pd_pair(cluster)
    seen: list[BaseException] = []
    c.load(1, [b"a"], [0], c.consumer_ctx("r", p))
    guard = p.tier._guard
    outermost = guard.enter("serve_lookups")  # as if another thread were inside
    try:
        worker = threading.Thread(target=lambda: _capture(seen, p.tier.get_finished_jobs))
        worker.start()
        worker.join(10)
    finally:
        guard.exit(outermost)
    assert len(seen) == 1 and isinstance(seen[0], ConcurrentCall)
    assert "P2PTier.get_finished_jobs called from thread" in str(seen[0])
    assert "inside P2PTier.serve_lookups" in str(seen[0])
    worker = threading.Thread(target=p.tier.get_finished_jobs)  # handed over: allowed
    worker.start()
    worker.join(10)
    assert not worker.is_alive()


def _capture(seen: list[BaseException], call: Any) -> None:
    try:
        call()
    except BaseException as exc:
        seen.append(exc)


def test_a_load_that_cannot_dial_names_the_real_cause(h: Any, cluster: Any) -> None:
    """Memory control across processes (both at the same address): the dial fails at
    ``on_new_request``; the load's detail says why instead of blaming an earlier load."""
    c = cluster()
    ctx = RequestContext(
        "r1",
        {"remote_prefiller": {"kv_request_id": "r1", "remote_host": c.host, "remote_port": c.port}},
    )
    c.tier.on_new_request(ctx)
    c.load(1, [b"a"], [0], ctx)
    c.collect()
    assert c.outcome(1) is Outcome.SUBMIT_FAILED
    assert "cannot connect to itself" in c.results[1].detail
    assert "use a network control transport such as zmq" in c.results[1].detail
