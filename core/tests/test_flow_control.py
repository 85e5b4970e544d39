"""Flow control over the memory transports (fake clock): a burst waits instead of failing,
a full send queue is back-pressure, a window-limited data transport is shared fairly, PD
loads go before prefix pulls, and a load of keys whose result the engine has not taken yet
is a request conflict at once (docs/configuration.md, "Flow control")."""

from __future__ import annotations

import numpy as np
import pytest
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.session.outbox import Outbox, OutboxOverflow
from p2pkv.session.pause import PauseDetector
from p2pkv.session.window import LoadWindow
from p2pkv.testing import harness as h
from p2pkv.types import Outcome


def _pd_burst(
    p: h.Node,
    c: h.Node,
    count: int,
    nblocks: int,
    first_job: int = 0,
    tag: str = "b",
    dst_base: int = 0,
) -> dict[int, tuple[list[int], list[int]]]:
    """Stage ``count`` PD requests on ``p`` (stored) and submit all their loads on ``c`` at
    once; returns load job id -> (producer slots, consumer slots)."""
    jobs: dict[int, tuple[list[int], list[int]]] = {}
    for i in range(count):
        kv = f"{tag}{i}"
        pctx, cctx = p.producer_ctx(kv), c.consumer_ctx(kv, p)
        p.tier.on_new_request(pctx)
        c.tier.on_new_request(cctx)
        src = list(range(i * nblocks, (i + 1) * nblocks))
        dst = list(range(dst_base + i * nblocks, dst_base + (i + 1) * nblocks))
        p.store(first_job + 2 * i, h.keys(kv, nblocks), src, pctx)
        jobs[first_job + 2 * i + 1] = (src, dst)
    for job_id, (_, dst) in jobs.items():
        kv = f"{tag}{(job_id - first_job - 1) // 2}"
        c.load(job_id, h.keys(kv, nblocks), dst, c.consumer_ctx(kv, p))
    return jobs


def _assert_all_done(
    p: h.Node,
    c: h.Node,
    jobs: dict[int, tuple[list[int], list[int]]],
    tag: str = "b",
    first_job: int = 0,
) -> None:
    """Every load done and byte-exact; then both sides finish the requests."""
    failed = {j: c.results[j] for j in jobs if c.outcome(j) is not Outcome.DONE}
    assert not failed, f"{len(failed)} loads did not succeed, e.g. {next(iter(failed.values()))}"
    for src, dst in jobs.values():
        np.testing.assert_array_equal(c.blocks[dst], p.blocks[src])
    for job_id in jobs:
        kv = f"{tag}{(job_id - first_job - 1) // 2}"
        p.tier.on_request_finished(p.producer_ctx(kv))
        c.tier.on_request_finished(c.consumer_ctx(kv, p))


def test_a_burst_beyond_the_window_and_the_send_queue_waits_and_all_succeed(
    cluster: h.Cluster,
) -> None:
    opts = {
        "control_options": {"max_queued_frames": 4},
        "num_blocks": 1200,
        "flow": {"window_rounds": 40, "window_blocks": 400},
    }
    p, c = cluster(**opts), cluster(**opts)
    jobs = _pd_burst(p, c, 300, 4)
    h.pump_until([p, c], lambda: all(j in c.results for j in jobs), rounds=2000)
    _assert_all_done(p, c, jobs)
    stats = c.tier.stats()
    assert stats["sessions"] == 1 and "jobs_peer_dead" not in stats  # never closed
    assert stats["frames_delayed"] + p.tier.stats()["frames_delayed"] > 0  # back-pressure
    h.pump_until([p, c], lambda: not c.tier.state_sizes()["frames_held"], rounds=500)
    h.assert_clean(c)


def test_a_window_limited_transport_posts_reads_as_room_frees(cluster: h.Cluster) -> None:
    """Reads that do not fit the data transport's capacity now wait in the tier; a ready
    larger than the capacity is cut into reads that fit."""
    data = {"read_capacity": 6, "completion_polls": 2}
    p = cluster(num_blocks=512)
    c = cluster(num_blocks=512, data_options=data)
    jobs = _pd_burst(p, c, 40, 9)
    h.pump_until([p, c], lambda: all(j in c.results for j in jobs), rounds=3000)
    _assert_all_done(p, c, jobs)
    h.pump([p, c], 10)
    h.assert_clean(c)


def test_one_producers_burst_never_fails_another_producers_loads(cluster: h.Cluster) -> None:
    data = {"read_capacity": 8, "completion_polls": 3}
    busy, calm = cluster(num_blocks=1024), cluster(num_blocks=64)
    c = cluster(num_blocks=1024, data_options=data)
    burst = _pd_burst(busy, c, 200, 4, tag="burst")
    quiet = _pd_burst(calm, c, 10, 4, first_job=10_000, tag="calm", dst_base=800)
    h.pump_until([busy, calm, c], lambda: all(j in c.results for j in quiet), rounds=3000)
    _assert_all_done(calm, c, quiet, "calm", 10_000)
    assert sum(j in c.results for j in burst) < len(burst)  # the burst was still going
    h.pump_until([busy, calm, c], lambda: all(j in c.results for j in burst), rounds=6000)
    _assert_all_done(busy, c, burst, "burst")


def test_a_load_that_waited_out_its_deadline_in_the_queue_says_so(cluster: h.Cluster) -> None:
    p = cluster(flow={"window_rounds": 1, "window_blocks": 64}, timeouts={"load": 5.0})
    c = cluster(flow={"window_rounds": 1, "window_blocks": 64}, timeouts={"load": 5.0})
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    c.load(1, h.keys("r", 2), [0, 1], cctx)  # opens the window; its producer never stores
    c.load(2, h.keys("r", 2, start=2), [2, 3], cctx)  # waits behind it
    h.pump([p, c], 4)
    h.advance(cluster.clock, [p, c], 6.0)
    assert c.outcome(2) is Outcome.LOAD_TIMEOUT
    assert "flow-control queue" in c.results[2].detail
    assert "flow.window_rounds=1" in c.results[2].detail


def test_pd_loads_overtake_waiting_prefix_pulls(cluster: h.Cluster) -> None:
    opts = {"flow": {"window_rounds": 1, "window_blocks": 64}, "num_blocks": 64}
    p, c = cluster(**opts), cluster(**opts)
    order: list[int] = []
    for i, probe in enumerate([True, True, False, False]):
        kv = f"q{i}"
        pctx, cctx = p.producer_ctx(kv), c.consumer_ctx(kv, p, probe=probe)
        p.tier.on_new_request(pctx)
        c.tier.on_new_request(cctx)
        p.store(100 + i, h.keys(kv, 2), [2 * i, 2 * i + 1], pctx)
        c.load(i, h.keys(kv, 2), [2 * i, 2 * i + 1], cctx)

    def done() -> bool:
        order.extend(r.job_id for r in c.collect())
        p.collect()
        return len(order) == 4

    for _ in range(400):
        if done():
            break
    assert sorted(order) == [0, 1, 2, 3]
    assert all(c.outcome(j) is Outcome.DONE for j in order)
    assert order.index(2) < order.index(1) and order.index(3) < order.index(1), order


def test_a_load_of_keys_whose_result_was_not_taken_yet_conflicts_at_once(
    cluster: h.Cluster,
) -> None:
    p, c = cluster(), cluster()
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    ks = h.keys("r", 4)
    p.store(1, ks, [0, 1, 2, 3], pctx)
    c.load(2, ks, [4, 5, 6, 7], cctx)
    for _ in range(50):  # tick without collecting: the result waits in the tier
        p.collect()
        c.tier.tick()
        if c.tier._ledger.not_taken(2):
            break
    assert c.tier._ledger.not_taken(2)
    c.load(3, ks[:2], [8, 9], cctx)
    got = {r.job_id: r for r in c.collect()}
    assert got[2].outcome is Outcome.DONE
    assert got[3].outcome is Outcome.REQUEST_CONFLICT, got[3]
    assert "not taken yet" in got[3].detail


# -- the parts -------------------------------------------------------------------------------


class _Round:
    def __init__(self, nblocks: int) -> None:
        self.nblocks = nblocks


def test_the_window_admits_in_order_pd_first_and_an_oversized_round_alone() -> None:
    w: LoadWindow[_Round] = LoadWindow(max_rounds=2, max_blocks=10)
    big, pull, pd1, pd2 = _Round(50), _Round(1), _Round(4), _Round(4)
    w.wait(pull, pull=True)
    w.wait(big, pull=False)
    w.wait(pd1, pull=False)
    assert w.admit(lambda r: False) == [big]  # larger than the window: goes alone
    w.wait(pd2, pull=False)
    assert w.admit(lambda r: False) == []
    assert w.ahead_of(pull) == 2
    w.close(big)
    assert w.admit(lambda r: False) == [pd1, pd2]  # the pull waits behind both PD loads
    w.close(pd1)
    assert w.admit(lambda r: False) == [pull]
    assert w.waiting == 0 and w.rounds == 2 and w.blocks == 5


class _Conn:
    """A control connection whose send queue holds ``room`` frames until drained."""

    def __init__(self, room: int) -> None:
        self.room = room
        self.sent: list[bytes] = []

    def send(self, frame: bytes) -> None:
        from p2pkv.errors import SendQueueFull

        if self.room == 0:
            raise SendQueueFull("full")
        self.room -= 1
        self.sent.append(frame)


def test_the_outbox_holds_frames_in_order_behind_a_full_queue() -> None:
    conn = _Conn(room=1)
    box = Outbox(conn, limit=3)  # type: ignore[arg-type]
    assert box.send(b"a") is False
    assert [box.send(f) for f in (b"b", b"c")] == [True, True]
    conn.room = 1
    assert box.send(b"d") is True  # behind the held ones, never ahead of them
    assert box.flush() is False and conn.sent == [b"a", b"b"]
    conn.room = 5
    assert box.flush() is True and conn.sent == [b"a", b"b", b"c", b"d"]
    conn.room = 0
    for f in (b"e", b"f", b"g"):
        box.send(f)
    with pytest.raises(OutboxOverflow, match="max_held_frames=3"):
        box.send(b"h")


def test_a_tick_gap_past_the_silence_timeout_is_a_pause() -> None:
    now = [0.0]
    detector = PauseDetector(lambda: now[0], 2.0)
    now[0] = 1.5
    assert detector.gap() is None
    now[0] = 4.0
    assert detector.gap() == 2.5
    assert PauseDetector(lambda: now[0], None).gap() is None


class _SilentMemoryControl(MemoryControlTransport):
    """Memory control whose peers drop us after 2 s of silence (like zmq heartbeats)."""

    @property
    def silence_timeout(self) -> float:
        return 2.0


def test_a_resumed_consumer_ends_its_pre_pause_loads_at_once() -> None:
    from p2pkv.testing.tier_machine import FakeClock, TierNode

    clock = FakeClock()
    made = [
        TierNode(
            clock,
            control=_SilentMemoryControl,
            data=MemoryDataTransport,
            registry=h.REGISTRY,
            seed=i,
        )
        for i in range(2)
    ]
    p, c = made
    try:
        cctx = c.consumer_ctx("r", p)
        c.tier.on_new_request(cctx)
        p.tier.on_new_request(p.producer_ctx("r"))
        c.load(1, h.keys("r", 2), [0, 1], cctx)  # its producer never stores
        h.pump([p, c], 4)
        assert c.outcome(1) is None
        clock.advance(3.0)  # the consumer was stopped past the silence timeout
        c.collect()
        assert c.outcome(1) is Outcome.PEER_DEAD
        assert "paused" in c.results[1].detail
    finally:
        for node in made:
            node.shutdown()
