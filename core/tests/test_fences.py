"""Fences: slots a producer may still write into after a load was released without its
confirmation (docs/protocol.md §5.1). Tiers over memory transports, fake clock, faults.

The producer's data transport keeps writes in flight for some polls and cannot confirm a
wait-cancel (like NIXL), so a write posted before a partition lands after it, in silence.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest
from p2pkv.config import Timeouts
from p2pkv.protocol import Bye, HelloAck, Quiesced
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.fences import Fences
from p2pkv.types import Outcome
from p2pkv_memory.faults import FaultInjector

SLOW = {"completion_polls": 8, "wait_cancel_refuses": True}
LATE = {"completion_polls": 60, "wait_cancel_refuses": True}
"""Writes that outlive the producer's drain deadline (5 s) and then land."""
STUCK = {"completion_polls": 10_000, "wait_cancel_refuses": True}
"""Writes that never end within a test."""


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


class Cut:
    """Producer ``p`` (slow, unstoppable writes), consumer ``c``, second producer ``q``; a load
    of ``c`` from ``p`` into slots 0 and 1 whose write is in flight when the link is cut."""

    def __init__(self, h: Any, cluster: Any, *, p_options: dict[str, Any] | None = None,
                 p_config: dict[str, Any] | None = None, **c_config: Any) -> None:
        self.h, self.cluster = h, cluster
        self.faults = FaultInjector(seed=3)
        self.p = cluster(faults=self.faults, data_options=p_options or SLOW, **(p_config or {}))
        self.c = cluster(faults=self.faults, **c_config)
        self.q = cluster(faults=self.faults)
        p, c = self.p, self.c
        pctx, self.cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        p.tier.on_new_request(pctx)
        p.store(1, [b"a", b"b"], [10, 11], pctx)
        c.load(2, [b"a", b"b"], [0, 1], self.cctx)
        h.pump([p, c], 2)
        assert p.tier.stats()["in_flight_transfers"] == 1
        self.faults.partition(p.address, c.address)
        h.pump_until([p, c], lambda: 2 in c.results, rounds=3)
        assert c.outcome(2) is Outcome.PEER_DEAD
        assert len(c.tier._env.fences) == 1
        self.stale = p.blocks[[10, 11]].copy()

    def load_from_q(self, job_id: int, kv: str, slots: list[int]) -> None:
        pctx, cctx = self.q.producer_ctx(kv), self.c.consumer_ctx(kv, self.q)
        self.q.tier.on_new_request(pctx)
        keys = self.h.keys(kv, len(slots))
        self.q.store(job_id + 1000, keys, [20 + i for i in range(len(slots))], pctx)
        self.c.load(job_id, keys, slots, cctx)

    def q_bytes(self, n: int) -> Any:
        return self.q.blocks[20:20 + n]

    def pump(self, rounds: int = 4) -> None:
        self.h.pump([self.p, self.c, self.q], rounds)

    def write_landed(self) -> bool:
        return self.p.tier.stats()["in_flight_transfers"] == 0

    def retiring(self) -> int:
        """Writes of ``p`` given up at a drain deadline and still live."""
        return int(self.p.tier.stats()["retiring_writes"])

    def give_up(self) -> None:
        """Let ``p``'s drain deadline (5 s) pass with the old write still live."""
        self.h.advance(self.cluster.clock, [self.p, self.c, self.q], 5.5)
        assert self.write_landed() and self.retiring() == 1

    def reconnect(self) -> None:
        """Heal, and give ``c`` a reason to dial ``p`` again."""
        self.faults.heal(self.p.address, self.c.address)
        self.c.tier.on_new_request(self.c.consumer_ctx("again", self.p))
        self.pump(4)


def test_a_fenced_load_waits_for_the_producers_quiesced_and_gets_clean_bytes(
        h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster)
    c, q = cut.c, cut.q
    cut.load_from_q(3, "s", [1])  # intersects the fence
    cut.load_from_q(4, "t", [5])  # does not
    h.pump_until([cut.p, c, q], cut.write_landed)
    assert c.outcome(4) is Outcome.DONE and (c.blocks[5] == cut.q_bytes(1)[0]).all()
    assert 3 not in c.results and not q.tier._state_sizes()["server_rounds"]
    assert (c.blocks[[0, 1]] == cut.stale).all()  # the old write landed after the cut
    cut.reconnect()
    assert not c.tier._env.fences.live
    assert c.outcome(3) is Outcome.DONE and (c.blocks[1] == cut.q_bytes(1)[0]).all()
    cut.pump(20)
    assert (c.blocks[1] == cut.q_bytes(1)[0]).all()


def test_quiesced_waits_until_the_old_sessions_writes_drained(h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster, p_options={"completion_polls": 40, "wait_cancel_refuses": True})
    cut.reconnect()
    assert not cut.write_landed() and len(cut.c.tier._env.fences) == 1
    h.pump_until([cut.p, cut.c], cut.write_landed, rounds=60)
    cut.pump(2)
    assert not cut.c.tier._env.fences.live


def test_a_fence_lifts_at_its_deadline_with_one_log_line(h: Any, cluster: Any,
                                                         caplog: Any) -> None:
    cut = Cut(h, cluster, timeouts={"fence": 20})
    cut.load_from_q(3, "s", [0, 1])
    h.pump_until([cut.p, cut.c, cut.q], cut.write_landed)
    assert 3 not in cut.c.results
    with caplog.at_level(logging.WARNING, logger="p2pkv.session.fences"):
        h.advance(cluster.clock, [cut.p, cut.c, cut.q], 20.5)
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pkv.session.fences"]
    assert len(lines) == 1 and "2 slot(s)" in lines[0] and "'r'" in lines[0]
    assert cut.p.address in lines[0]
    assert cut.c.outcome(3) is Outcome.DONE
    assert (cut.c.blocks[[0, 1]] == cut.q_bytes(2)).all()


def test_a_load_fenced_past_its_deadline_times_out_unsent(h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster)
    cut.load_from_q(3, "s", [0])
    cut.pump(4)
    h.advance(cluster.clock, [cut.p, cut.c, cut.q], 30.5)
    assert cut.c.outcome(3) is Outcome.LOAD_TIMEOUT
    assert "fenced" in cut.c.results[3].detail
    assert not cut.q.tier._state_sizes()["server_rounds"]


def test_a_restarted_producer_lifts_the_fence_at_once(h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster, p_options={"completion_polls": 2, "wait_cancel_refuses": True})
    cut.load_from_q(3, "s", [0])
    cut.p.shutdown()
    cut.faults.heal(cut.p.address, cut.c.address)
    p2 = cluster(faults=cut.faults, port=cut.p.port)
    cut.c.tier.on_new_request(cut.c.consumer_ctx("again", p2))
    h.pump([p2, cut.c, cut.q], 4)
    assert not cut.c.tier._env.fences.live
    assert cut.c.outcome(3) is Outcome.DONE


def test_a_write_given_up_at_the_drain_deadline_is_polled_until_it_ends_then_quiesced(
        h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster, p_options=LATE)
    p, c = cut.p, cut.c
    cut.load_from_q(3, "s", [1])  # fenced against p
    cut.give_up()
    assert p.outcome(1) is Outcome.PEER_DEAD  # the store job still fails at the drain deadline
    assert c.address in p.tier._dir.data_owner  # the data peer is kept under the live write
    cut.reconnect()
    c.load(5, [b"a2"], [5], c.consumer_ctx("again", p))  # new writes over the re-added peer
    p.tier.on_new_request(p.producer_ctx("again"))
    p.store(6, [b"a2"], [12], p.producer_ctx("again"))
    cut.pump(4)
    assert cut.retiring() == 1 and len(c.tier._env.fences) == 1 and 3 not in c.results
    h.pump_until([p, c, cut.q], lambda: not cut.retiring(), rounds=80)
    cut.pump(4)
    assert not c.tier._env.fences.live  # p said quiesced once its old write ended
    assert c.outcome(3) is Outcome.DONE and (c.blocks[1] == cut.q_bytes(1)[0]).all()
    h.pump_until([p, c], lambda: 5 in c.results and 6 in p.results, rounds=80)
    assert c.outcome(5) is Outcome.DONE and p.outcome(6) is Outcome.DONE
    assert cluster.clock() < 1000 + 30  # long before the fence deadline (120 s)
    assert p.tier._dir.data_owner[c.address] is p.tier._sessions[c.address]
    assert p.tier._state_sizes()["gave_up_peers"] == 0


def test_the_data_peer_is_removed_only_once_the_given_up_write_ended(
        h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster, p_options=LATE)
    p = cut.p
    removed: list[tuple[str, int]] = []
    remove_peer = p.data.remove_peer

    def spy(peer: str) -> list[int]:
        removed.append((peer, cut.retiring()))
        left: list[int] = remove_peer(peer)
        return left

    p.data.remove_peer = spy
    cut.give_up()
    assert not removed
    h.pump_until([p, cut.c], lambda: not cut.retiring(), rounds=80)
    assert removed == [(cut.c.address, 0)] and not p.tier._dir.data_owner
    assert p.tier._state_sizes()["gave_up_peers"] == 0


def test_a_given_up_write_still_live_at_the_fence_deadline_is_no_longer_waited_for(
        h: Any, cluster: Any, caplog: Any) -> None:
    cut = Cut(h, cluster, p_options=STUCK)
    cut.give_up()
    cut.reconnect()
    assert len(cut.c.tier._env.fences) == 1 and cut.p.tier._dir.owed  # no quiesced yet
    with caplog.at_level(logging.WARNING, logger="p2pkv.session.retiring"):
        h.advance(cluster.clock, [cut.p, cut.c], 120)
        h.advance(cluster.clock, [cut.p, cut.c], 60)
    lines = [r.getMessage() for r in caplog.records if r.name == "p2pkv.session.retiring"]
    assert len(lines) == 1 and "1 write(s)" in lines[0] and cut.c.address in lines[0]
    assert not cut.c.tier._env.fences.live and not cut.p.tier._dir.owed
    assert not cut.retiring()


def shut_down_retiring(h: Any, cluster: Any, caplog: Any, options: dict[str, Any],
                       drain: float) -> tuple[Cut, list[str]]:
    """Shut ``p`` down with a write given up at its drain deadline still live; returns the
    tier's error lines of the shutdown."""
    cut = Cut(h, cluster, p_options=options, p_config={"timeouts": {"shutdown_drain": drain}})
    h.advance(cluster.clock, [cut.p, cut.c], drain + 0.5)
    assert cut.retiring() == 1
    caplog.clear()
    with caplog.at_level(logging.ERROR, logger="p2pkv.tier"):
        cut.p.shutdown()
    return cut, [r.getMessage() for r in caplog.records if r.name == "p2pkv.tier"]


def test_shutdown_waits_for_given_up_writes_within_its_drain_bound(
        h: Any, cluster: Any, caplog: Any) -> None:
    cut, lines = shut_down_retiring(h, cluster, caplog, LATE, 2.0)
    assert not lines  # drained: nothing kept registered
    assert (cut.c.blocks[[0, 1]] == cut.stale).all()


def test_shutdown_is_bounded_and_keeps_memory_under_a_given_up_write(
        h: Any, cluster: Any, caplog: Any) -> None:
    cut, lines = shut_down_retiring(h, cluster, caplog, STUCK, 0.2)
    assert any("given up earlier are still live: [1]" in m for m in lines), lines
    assert any("kept its region registered" in m for m in lines), lines
    assert not cut.retiring() and len(cut.p.tier._deadlines) == 0


def test_another_peer_cannot_lift_a_fence_against_the_producer(h: Any, cluster: Any) -> None:
    cut = Cut(h, cluster)
    with h.RawPeer(cut.c) as raw:
        ours, _ = raw.send(raw.hello())
        assert raw.send(HelloAck(ours.epoch), Quiesced()) == [Quiesced()]  # c's own, to raw
        assert len(cut.c.tier._env.fences) == 1
        (bye,) = raw.send(Quiesced())
        assert isinstance(bye, Bye) and "sent twice" in bye.reason
    assert len(cut.c.tier._env.fences) == 1


def test_quiesced_from_a_wire_1_0_peer_is_a_protocol_error(h: Any, cluster: Any) -> None:
    from dataclasses import replace

    c = cluster()
    with h.RawPeer(c) as raw:
        ours, _ = raw.send(replace(raw.hello(), wire=(1, 0)))
        msgs = raw.send(HelloAck(ours.epoch))
        assert Quiesced() not in msgs  # a 1.0 peer is never sent one
        (bye,) = raw.send(Quiesced())
        assert isinstance(bye, Bye) and bye.reason.startswith("protocol error: quiesced")


# -- the fence table itself --------------------------------------------------------------------


class Seen:
    enabled = True

    def __init__(self) -> None:
        self.timeouts: list[dict[str, Any]] = []

    def timeout(self, **kw: Any) -> None:
        self.timeouts.append(kw)


class Waiter:
    def __init__(self, fences: Fences, slots: list[int]) -> None:
        self.fences, self.slots, self.sent = fences, slots, False

    def retry_fenced(self) -> bool:
        self.sent = not self.fences.blocked(self.slots)
        return not self.sent


def test_fence_table_blocks_lifts_by_peer_and_age_and_by_deadline() -> None:
    now = [0.0]
    deadlines, seen = Deadlines(), Seen()
    fences = Fences(16, deadlines, lambda: now[0], Timeouts(fence=10), seen)  # type: ignore[arg-type]
    assert not fences.blocked([0, 1])
    fences.fence("p", "r1", [1, 2])
    fences.fence("q", "r2", np.array([5]).tolist())
    floor = fences.next_id
    fences.fence("p", "r3", [7])
    assert fences.blocked([0, 2]) and fences.blocked([7]) and not fences.blocked([3, 4])
    w = Waiter(fences, [2, 5])
    fences.wait(w)
    assert fences.lift_before("q", floor) == 1 and not w.sent  # slot 2 still fenced against p
    assert fences.lift_before("p", floor) == 1 and w.sent
    assert fences.blocked([7])  # younger than the session that said quiesced
    now[0] = 10.0
    deadlines.fire_due(now[0])
    assert not fences.live and not fences.blocked([7])
    assert seen.timeouts == [{"kind": "fence", "kv_request_id": "r3", "peer": "p"}]
    assert len(deadlines) == 0
