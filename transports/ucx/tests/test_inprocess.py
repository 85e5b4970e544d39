"""The ``ucx`` transport between instances in this process (real ucxx, loopback): bounds
checks, the round guarantee of the tags, coalescing, cancel and close semantics."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from p2pkv.contracts import CancelMode
from p2pkv.errors import PeerRejected, TransferSubmitError
from p2pkv.testing.waiting import wait_until
from p2pkv_ucx import wire
from ucx_helpers import Node, RawProducer, T, settle

Make = Callable[..., Node]


def _pair(nodes: Make, **options: object) -> tuple[Node, Node]:
    producer, consumer = nodes(seed=1, **options), nodes(seed=2, **options)
    producer.link("c", consumer, back_as="p")
    return producer, consumer


def _move(producer: Node, consumer: Node, src: list[int], dst: list[int]) -> tuple[int, int]:
    """Expect, let the producer see the round (as a fetch over the control plane would arrive
    after it), write, and check both ends report done."""
    eid = consumer.t.expect_blocks("p", dst)
    assert eid is not None
    peer = producer.t._peers["c"]  # type: ignore[attr-defined]
    link = consumer.t._peers["p"].link_in  # type: ignore[attr-defined]
    wait_until(lambda: not dst or (peer.link_out == link and peer.slot_gen[dst].all()),
               timeout=T, what="the producer to see the round",
               pumps=[consumer.t.progress, producer.t.progress])
    tid = producer.t.write_blocks("c", src, dst)
    settle([producer, consumer], {producer: {tid}, consumer: {eid}}, "the write and its receive")
    assert tid in producer.done and eid in consumer.done
    return tid, eid


@pytest.mark.parametrize("coalesce", [True, False])
def test_blocks_land_exactly_and_contiguous_runs_go_as_one_message(
    nodes: Make, coalesce: bool
) -> None:
    producer, consumer = _pair(nodes, coalesce=coalesce)
    before = consumer.blocks.copy()
    src, dst = [3, 4, 5, 6, 20, 9], [10, 11, 12, 13, 0, 30]
    tid = consumer.t.expect_blocks("p", dst)
    wid = producer.t.write_blocks("c", src, dst)
    wait_until(lambda: producer.t._transfers[wid].requests, timeout=T,  # type: ignore[attr-defined]
               what="the write to be posted", pumps=[consumer.t.progress, producer.t.progress])
    messages = len(producer.t._transfers[wid].requests)  # type: ignore[attr-defined]
    assert messages == 1 + (3 if coalesce else 6), "one HEADER plus one message per run"
    settle([producer, consumer], {producer: {wid}, consumer: {tid}}, "the write")
    assert wid in producer.done and tid in consumer.done
    assert (consumer.blocks[dst] == producer.blocks[src]).all()
    untouched = sorted(set(range(32)) - set(dst))
    assert (consumer.blocks[untouched] == before[untouched]).all()


def test_a_write_waits_for_the_consumers_expectation(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    tid = producer.t.write_blocks("c", [1, 2], [7, 8])  # nothing expected yet
    for _ in range(50):
        producer.poll("c")
        consumer.poll("p")
    assert tid not in producer.done | producer.failed
    eid = consumer.t.expect_blocks("p", [7, 8])
    settle([producer, consumer], {producer: {tid}, consumer: {eid}}, "the deferred write")
    assert tid in producer.done and eid in consumer.done
    assert (consumer.blocks[[7, 8]] == producer.blocks[[1, 2]]).all()


def test_the_consumer_lands_only_runs_of_a_live_round_and_says_so(nodes: Make) -> None:
    """A hand-driven producer sends what a real one never would: a stale round, foreign slots,
    a repeat. Only the run of the live round lands; the VERDICTs count what was refused."""
    consumer = nodes(seed=2)
    raw = RawProducer(consumer.t.num_blocks, consumer.t.block_len)
    consumer.t.add_peer("p", raw.descriptor)
    raw.connect(consumer.t.descriptor())
    pump = consumer.t.progress
    eid = consumer.t.expect_blocks("p", [4, 5])
    expect = raw.notice(pump)
    assert isinstance(expect, wire.Expect) and expect.slots.tolist() == [4, 5]
    before = consumer.blocks.copy()
    block = np.full((2, consumer.t.block_len), 7, np.uint8)
    cases = [
        [(4, 2, expect.gen + 1)],               # a round the consumer is not in
        [(4, 1, expect.gen + 1)],               # the same, one block (SLOT-tagged)
        [(6, 2, expect.gen)],                   # slots this round does not cover
        [(5, 2, expect.gen)],                   # straddles the round's end
        [(5, 1, expect.gen), (6, 1, expect.gen)],  # one good block, one foreign
    ]
    for seq, runs in enumerate(cases[:4]):
        raw.write(expect.link, seq, runs, [block[:n] for _, n, _ in runs])
        assert raw.notice(pump) == wire.Verdict(consumer.t._instance, seq, 1)  # type: ignore[attr-defined]
    wait_until(lambda: not consumer.t._poisoned or all(r.completed for r in consumer.t._drains),  # type: ignore[attr-defined]
               timeout=T, what="refused payload drained", pumps=[pump, raw.worker.progress])
    consumer.poll("p")
    assert eid not in consumer.done | consumer.failed
    assert (consumer.blocks == before).all(), "refused payload touched the region"
    raw.write(expect.link, 4, cases[4], [block[:1], block[:1]])
    assert raw.notice(pump) == wire.Verdict(consumer.t._instance, 4, 1)  # type: ignore[attr-defined]
    wait_until(lambda: (consumer.blocks[5] == 7).all(), timeout=T, what="slot 5 to land",
               pumps=[pump, raw.worker.progress])
    assert (consumer.blocks[6] == before[6]).all()
    good = np.full((1, consumer.t.block_len), 9, np.uint8)
    sends = raw.write(expect.link, 5, [(4, 1, expect.gen)], [good])
    assert raw.notice(pump) == wire.Verdict(consumer.t._instance, 5, 0)  # type: ignore[attr-defined]
    wait_until(lambda: eid in consumer.done, timeout=T, what="the live round to land",
               pumps=[consumer.poll, raw.worker.progress])
    assert (consumer.blocks[4] == 9).all() and (consumer.blocks[5] == 7).all()
    assert all(r.completed for r in sends)
    raw.write(expect.link, 6, [(4, 2, expect.gen)], [block])  # the same round again
    assert raw.notice(pump) == wire.Verdict(consumer.t._instance, 6, 1)  # type: ignore[attr-defined]
    assert (consumer.blocks[4] == 9).all()


def test_a_coalesced_run_replaces_the_posted_receives(nodes: Make) -> None:
    consumer = nodes(seed=2)
    raw = RawProducer(consumer.t.num_blocks, consumer.t.block_len)
    consumer.t.add_peer("p", raw.descriptor)
    raw.connect(consumer.t.descriptor())
    pump = consumer.t.progress
    eid = consumer.t.expect_blocks("p", [9, 10, 11, 3])
    expect = raw.notice(pump)
    payload = np.arange(3 * consumer.t.block_len, dtype=np.uint64).astype(np.uint8)
    one = np.full((1, consumer.t.block_len), 5, np.uint8)
    raw.write(expect.link, 0, [(9, 3, expect.gen), (3, 1, expect.gen)],
              [payload.reshape(3, -1), one])
    assert raw.notice(pump) == wire.Verdict(consumer.t._instance, 0, 0)  # type: ignore[attr-defined]
    wait_until(lambda: eid in consumer.done, timeout=T, what="the run and the block",
               pumps=[consumer.poll, raw.worker.progress])
    assert (consumer.blocks[9:12].ravel() == payload).all() and (consumer.blocks[3] == 5).all()


def test_a_cancelled_round_is_retracted_and_the_next_round_lands(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    slots = [4, 5]
    gens = producer.t._peers["c"].slot_gen  # type: ignore[attr-defined]
    first = consumer.t.expect_blocks("p", slots)
    wait_until(lambda: gens[slots].all(), timeout=T, what="the producer to see round 1",
               pumps=[consumer.t.progress, producer.t.progress])
    assert consumer.t.cancel([first], CancelMode.WAIT) == []  # nothing posted yet: stopped
    wait_until(lambda: not gens[slots].any(), timeout=T, what="the RETRACT",
               pumps=[consumer.t.progress, producer.t.progress])
    tid = producer.t.write_blocks("c", [20, 21], slots)
    assert not producer.t._transfers[tid].posted, "a retracted round must not be written"  # type: ignore[attr-defined]
    second = consumer.t.expect_blocks("p", slots)
    settle([producer, consumer], {producer: {tid}, consumer: {second}}, "round 2")
    assert tid in producer.done and second in consumer.done
    assert (consumer.blocks[slots] == producer.blocks[[20, 21]]).all()


def test_a_peer_cannot_write_into_slots_expected_from_another(nodes: Make) -> None:
    consumer, a, b = nodes(seed=0), nodes(seed=1), nodes(seed=2)
    a.link("c", consumer, back_as="a")
    b.link("c", consumer, back_as="b")
    from_a = consumer.t.expect_blocks("a", [0])
    from_b = consumer.t.expect_blocks("b", [1])
    before = consumer.blocks[0].copy()
    rogue = b.t.write_blocks("c", [9], [0])  # b was asked for slot 1, not 0: never posted
    wid = b.t.write_blocks("c", [5], [1])
    settle([consumer, a, b], {b: {wid}, consumer: {from_b}}, "b's legitimate write")
    assert rogue not in b.done and (consumer.blocks[0] == before).all()
    aid = a.t.write_blocks("c", [3], [0])
    settle([consumer, a, b], {a: {aid}, consumer: {from_a}}, "a's write")
    assert (consumer.blocks[0] == a.blocks[3]).all() and (consumer.blocks[1] == b.blocks[5]).all()
    assert b.t.cancel([rogue], CancelMode.WAIT) == []  # never posted: stopped at once


@pytest.mark.parametrize("call, args, match", [
    ("write", ([0], [40]), "outside"),
    ("write", ([-1], [0]), "outside"),
    ("write", ([0, 1], [0]), "remote"),
    ("write", ([0, 1], [2, 2]), "twice"),
    ("write", ([0.5], [1]), "integers"),
    ("write", ([[0]], [[1]]), "integers"),
    ("expect", ([32],), "outside"),
    ("expect", ([3, 3],), "twice"),
    ("expect", ([True],), "integers"),
])
def test_bad_indexes_are_refused_before_anything_is_posted(
    nodes: Make, call: str, args: tuple[list[int], ...], match: str
) -> None:
    producer, consumer = _pair(nodes)
    with pytest.raises(TransferSubmitError, match=match):
        if call == "write":
            producer.t.write_blocks("c", *args)
        else:
            consumer.t.expect_blocks("p", *args)
    assert not producer.t._transfers and not consumer.t._transfers  # type: ignore[attr-defined]
    _move(producer, consumer, [0], [0])  # still healthy


def test_a_slot_expects_one_write_at_a_time(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    eid = consumer.t.expect_blocks("p", [6, 7])
    with pytest.raises(TransferSubmitError, match="already expects"):
        consumer.t.expect_blocks("p", [7])
    assert consumer.t.cancel([eid], CancelMode.WAIT) == []
    _move(producer, consumer, [1], [7])  # the slot is free again


def test_empty_transfers_complete(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    tid, eid = _move(producer, consumer, [], [])
    assert tid in producer.done and eid in consumer.done


def test_cancel_immediate_forgets_and_the_slots_are_free(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    eid = consumer.t.expect_blocks("p", [2])
    tid = producer.t.write_blocks("c", [2], [9])  # never expected: waits
    assert consumer.t.cancel([eid], CancelMode.IMMEDIATE) == []
    assert producer.t.cancel([tid], CancelMode.IMMEDIATE) == []
    for _ in range(10):
        producer.poll()
        consumer.poll()
    assert not (producer.done | producer.failed | consumer.done | consumer.failed)
    _move(producer, consumer, [4], [2])


def test_deadline_fails_a_write_nobody_expects(nodes: Make) -> None:
    producer, consumer = _pair(nodes, transfer_timeout=0.3)
    tid = producer.t.write_blocks("c", [0], [0])
    eid = consumer.t.expect_blocks("p", [5])  # the producer never writes it
    settle([producer, consumer], {producer: {tid}, consumer: {eid}}, "both deadlines")
    assert tid in producer.failed and eid in consumer.failed


def test_a_write_lands_among_many_pending_rounds_and_leaves_the_others_pending(
    nodes: Make,
) -> None:
    """Rounds nobody has written to are not looked at by ``poll`` (only watched transfers
    are); they must still be there, whole, for a write that comes later."""
    producer, consumer = _pair(nodes, num_blocks=64)
    rounds = {slot: consumer.t.expect_blocks("p", [slot]) for slot in range(64)}
    tid = producer.t.write_blocks("c", [5], [40])
    settle([producer, consumer], {producer: {tid}, consumer: {rounds[40]}}, "the one write")
    assert tid in producer.done and rounds[40] in consumer.done
    assert (consumer.blocks[40] == producer.blocks[5]).all()
    for _ in range(20):
        producer.poll()
        consumer.poll()
    pending = {r for slot, r in rounds.items() if slot != 40}
    assert not pending & (consumer.done | consumer.failed)
    later = producer.t.write_blocks("c", [6, 7], [63, 0])
    settle([producer, consumer], {producer: {later}, consumer: {rounds[63], rounds[0]}},
           "a later write into two of the pending rounds")
    assert later in producer.done and {rounds[63], rounds[0]} <= consumer.done
    assert (consumer.blocks[[63, 0]] == producer.blocks[[6, 7]]).all()


def test_unwritten_rounds_fail_at_their_deadline_reported_to_their_own_peer(
    nodes: Make,
) -> None:
    p, consumer, q = nodes(seed=1), nodes(seed=2, transfer_timeout=0.3), nodes(seed=3)
    p.link("c", consumer, back_as="p")
    q.link("c", consumer, back_as="q")
    from_p = {consumer.t.expect_blocks("p", [slot]) for slot in range(8)}
    from_q = {consumer.t.expect_blocks("q", [slot]) for slot in range(8, 16)}
    wait_until(lambda: from_p <= consumer.failed, timeout=T, what="p's rounds to expire",
               pumps=[lambda: consumer.poll("p"), p.t.progress, q.t.progress])
    assert not from_q & (consumer.done | consumer.failed), "poll('p') reports only p's"
    assert not from_p & consumer.done
    wait_until(lambda: from_q <= consumer.failed, timeout=T, what="q's rounds to expire",
               pumps=[lambda: consumer.poll("q"), p.t.progress, q.t.progress])


def test_peers_must_agree_on_endpoint_error_handling(nodes: Make) -> None:
    safe, fast = nodes(), nodes(endpoint_error_handling=False)
    with pytest.raises(PeerRejected, match="endpoint_error_handling"):
        safe.t.add_peer("fast", fast.t.descriptor())
    with pytest.raises(TransferSubmitError):
        safe.t.write_blocks("fast", [0], [0])


def test_remove_then_close_release_everything(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    _move(producer, consumer, [0, 1], [2, 3])
    consumer.t.expect_blocks("p", [4])  # pending, no receive posted: cancellable
    assert consumer.t.remove_peer("p") == []
    with pytest.raises(TransferSubmitError):
        consumer.t.expect_blocks("p", [4])
    consumer.t.add_peer("p", producer.t.descriptor())
    _move(producer, consumer, [5], [4])
    assert consumer.t.close() == [] and producer.t.close() == []
    with pytest.raises(TransferSubmitError, match="closed"):
        producer.t.write_blocks("c", [0], [0])
    assert list(consumer.t.poll()) == [[], []] or not any(consumer.t.poll())


def test_re_adding_a_peer_behind_a_failed_endpoint_makes_a_fresh_one(nodes: Make) -> None:
    """A consumer paused past UCX's keepalive comes back with the same worker address: the new
    session's add_peer must not keep the dead endpoint (every write would fail forever)."""
    producer, consumer = _pair(nodes)
    old = producer.t._peers["c"]  # type: ignore[attr-defined]
    old.dead = True  # as the progress loop marks it when the endpoint errors
    with pytest.raises(TransferSubmitError, match="unreachable"):
        producer.t.write_blocks("c", [1], [2])
    producer.link("c", consumer, back_as="p")  # the new session registers it again
    assert producer.t._peers["c"] is not old  # type: ignore[attr-defined]
    _move(producer, consumer, [1], [2])
    assert (consumer.blocks[2] == producer.blocks[1]).all()
