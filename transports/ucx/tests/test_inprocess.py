"""The ``ucx`` transport between instances in this process (real ucxx, loopback): checks of
``read_blocks``, the producer serving reads on its own, the consumer taking only what a live
read asked for, cancel and close semantics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import pytest
from p2pkv.errors import PeerRejected, TransferSubmitError
from p2pkv.testing.waiting import wait_until
from p2pkv_ucx import tags, wire
from p2pkv_ucx.records import Peer
from ucx_helpers import Node, RawProducer, T, settle

Make = Callable[..., Node]
CANARY = 0xA5


def _pair(nodes: Make, **options: object) -> tuple[Node, Node]:
    producer, consumer = nodes(seed=1, **options), nodes(seed=2, **options)
    producer.link("c", consumer, back_as="p")
    return producer, consumer


def _read(producer: Node, consumer: Node, dst: Sequence[int], src: Sequence[int]) -> int:
    """Read ``src`` of the producer into ``dst``; check it is done and byte-exact."""
    tid = consumer.t.read_blocks("p", dst, src)
    settle([producer, consumer], {consumer: {tid}}, "the read")
    assert tid in consumer.done
    assert (consumer.blocks[dst] == producer.blocks[src]).all()
    return tid


def _raw(nodes: Make) -> tuple[Node, RawProducer]:
    consumer = nodes(seed=2)
    raw = RawProducer(consumer.t.num_blocks, consumer.t.block_len)
    consumer.t.add_peer("p", raw.descriptor)
    raw.connect(consumer.t.descriptor())
    return consumer, raw


def _keep_polling(node: Node, raw: RawProducer, sends: list[Any], rounds: int = 50) -> None:
    """Poll until the raw producer's sends completed, then some more (bounded)."""
    wait_until(
        lambda: all(s.completed for s in sends),
        timeout=T,
        what="the raw sends",
        pumps=[node.poll, raw.worker.progress],
    )
    for _ in range(rounds):
        node.poll()
        raw.worker.progress()


@pytest.mark.parametrize("coalesce", [True, False])
def test_blocks_land_exactly_and_contiguous_runs_go_as_one_message(
    nodes: Make, coalesce: bool
) -> None:
    producer, consumer = _pair(nodes, coalesce=coalesce)
    before = consumer.blocks.copy()
    src, dst = [3, 4, 5, 6, 20, 9], [10, 11, 12, 13, 0, 30]
    tid = consumer.t.read_blocks("p", dst, src)
    runs = len(consumer.t.read_handle(tid).lengths)
    assert runs == (3 if coalesce else 6), "one message per run contiguous on both sides"
    settle([producer, consumer], {consumer: {tid}}, "the read")
    assert tid in consumer.done
    assert (consumer.blocks[dst] == producer.blocks[src]).all()
    untouched = sorted(set(range(32)) - set(dst))
    assert (consumer.blocks[untouched] == before[untouched]).all()
    assert not producer.done | producer.failed, "serving is internal: the producer reports nothing"


def test_numpy_indexes_and_a_repeated_source_block_are_fine(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    local: Any = np.array([1, 2, 3])
    remote: Any = [np.int64(7), np.int32(7), 8]
    _read(producer, consumer, local, remote)


def test_a_remote_index_may_repeat_anywhere_in_a_read(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    _read(producer, consumer, [0, 1, 2, 3, 4, 5], [5, 5, 5, 2, 5, 6])


def test_a_contiguous_read_posts_fewer_messages_than_a_scattered_one(nodes: Make) -> None:
    """Coalescing: 32 blocks contiguous on both sides travel as one DATA message (one send
    on the producer, one receive here); 32 scattered ones as 32. The bytes are right."""
    producer, consumer = _pair(nodes, num_blocks=64)
    counts = []
    for dst, src in [
        (list(range(32)), list(range(32, 64))),
        (list(range(0, 64, 2)), list(range(63, 0, -2))),
    ]:
        sent, received = producer.t.descriptors_posted, consumer.t.descriptors_posted
        _read(producer, consumer, dst, src)
        counts.append(
            (producer.t.descriptors_posted - sent, consumer.t.descriptors_posted - received)
        )
    assert counts == [(1, 1), (32, 32)]


def test_the_producer_serves_only_from_its_own_progress(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    tid = consumer.t.read_blocks("p", [7, 8], [1, 2])
    for _ in range(50):
        consumer.poll("p")
    assert tid not in consumer.done | consumer.failed, "nothing moves while the producer idles"
    wait_until(
        lambda: tid in consumer.done,
        timeout=T,
        what="the read once the producer pumps",
        pumps=[producer.t.progress, lambda: consumer.poll("p")],
    )
    assert (consumer.blocks[[7, 8]] == producer.blocks[[1, 2]]).all()


def test_a_read_sent_before_the_producer_knew_us_is_served_once_it_does(nodes: Make) -> None:
    producer, consumer = nodes(seed=1), nodes(seed=2)
    consumer.t.add_peer("p", producer.t.descriptor())
    tid = consumer.t.read_blocks("p", [4], [9])
    for _ in range(20):
        producer.t.progress()
        consumer.poll("p")
    producer.t.add_peer("c", consumer.t.descriptor())
    settle([producer, consumer], {consumer: {tid}}, "the early read")
    assert tid in consumer.done and (consumer.blocks[4] == producer.blocks[9]).all()


def test_the_consumer_takes_only_what_a_live_read_asked_for(nodes: Make) -> None:
    """A hand-driven producer sends what a real one never would: runs of unknown reads, of a
    cancelled read, a run number the read does not have, a repeat. None of it touches the
    region; the read's own runs land."""
    consumer, raw = _raw(nodes)
    gone = consumer.t.read_blocks("p", [1, 2], [0, 1])
    first = raw.notice(consumer.t.progress)
    consumer.t.cancel([gone])
    assert isinstance(raw.notice(consumer.t.progress), wire.Cancel)
    tid = consumer.t.read_blocks("p", [4, 5, 9], [0, 1, 7])
    read = raw.notice(consumer.t.progress)
    assert isinstance(read, wire.Read) and read.lengths.tolist() == [2, 1]
    consumer.blocks[[1, 2, 4, 5, 9]] = CANARY
    block = consumer.t.block_len
    junk = np.full(2 * block, 7, np.uint8)
    sends = [
        raw.send_run(first.link, first.rid, 0, junk),  # the cancelled read
        raw.send_run(read.link, read.rid + 5, 0, junk),  # a read never made
        raw.send_run(read.link + 1, read.rid, 0, junk),  # another link
        raw.send_run(read.link, read.rid, 2, junk[:block]),  # a run the read does not have
    ]
    _keep_polling(consumer, raw, sends)
    assert (consumer.blocks[[1, 2, 4, 5, 9]] == CANARY).all(), "unasked payload touched slots"
    assert tid not in consumer.done | consumer.failed
    good = np.arange(2 * block, dtype=np.uint64).astype(np.uint8)
    sends = [
        raw.send_run(read.link, read.rid, 0, good),
        raw.send_run(read.link, read.rid, 1, np.full(block, 9, np.uint8)),
    ]
    wait_until(
        lambda: tid in consumer.done,
        timeout=T,
        what="the live read",
        pumps=[consumer.poll, raw.worker.progress],
    )
    assert (consumer.blocks[[4, 5]].ravel() == good).all() and (consumer.blocks[9] == 9).all()
    consumer.blocks[[4, 5, 9]] = CANARY
    _keep_polling(consumer, raw, [raw.send_run(read.link, read.rid, 1, junk[:block])])
    assert (consumer.blocks[[4, 5, 9]] == CANARY).all(), "a repeat of a done read landed"
    assert gone not in consumer.done | consumer.failed


def test_a_run_of_the_wrong_length_fails_the_read_and_lands_nothing(nodes: Make) -> None:
    consumer, raw = _raw(nodes)
    tid = consumer.t.read_blocks("p", [3], [0])
    read = raw.notice(consumer.t.progress)
    consumer.blocks[3] = CANARY
    sends = [raw.send_run(read.link, read.rid, 0, np.zeros(consumer.t.block_len // 2, np.uint8))]
    wait_until(
        lambda: tid in consumer.failed,
        timeout=T,
        what="the read to fail",
        pumps=[consumer.poll, raw.worker.progress],
    )
    _keep_polling(consumer, raw, sends)
    assert (consumer.blocks[3] == CANARY).all()


def test_a_refused_read_fails(nodes: Make) -> None:
    consumer, raw = _raw(nodes)
    tid = consumer.t.read_blocks("p", [3], [0])
    read = raw.notice(consumer.t.progress)
    raw.send_notice(wire.encode_refuse(raw.instance, read.link, read.rid, "no such block"))
    wait_until(
        lambda: tid in consumer.failed,
        timeout=T,
        what="the refusal",
        pumps=[consumer.poll, raw.worker.progress],
    )


def test_a_read_cancelled_before_it_is_served_is_skipped_and_never_lands(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    tid = consumer.t.read_blocks("p", [6, 7], [1, 2])
    consumer.t.cancel([tid])
    consumer.blocks[[6, 7]] = CANARY
    for _ in range(100):
        producer.poll()
        consumer.poll()
    assert tid not in consumer.done | consumer.failed
    assert (consumer.blocks[[6, 7]] == CANARY).all()
    _read(producer, consumer, [6, 7], [1, 2])  # the slots are ours again


def test_a_producer_refuses_a_read_outside_its_region(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    peer = consumer.t.attached_peer("p")
    assert isinstance(peer, Peer)
    peer.desc = wire.Descriptor(
        peer.desc.address,
        peer.desc.instance,
        64,
        peer.desc.block_len,
        peer.desc.max_run,
        peer.desc.error_handling,
    )  # lie: 64 blocks
    tid = consumer.t.read_blocks("p", [0], [40])
    settle([producer, consumer], {consumer: {tid}}, "the refusal")
    assert tid in consumer.failed


@pytest.mark.parametrize(
    "args, match",
    [
        (([0], [40]), "outside"),
        (([40], [0]), "outside"),
        (([0], [-1]), "outside"),
        (([0, 1], [0]), "remote"),
        (([2, 2], [0, 1]), "twice"),
        (([], []), "at least one"),
        (([0.5], [1]), "integers"),
        (([[0]], [[1]]), "integers"),
        (([True], [1]), "integers"),
        (([1], ["a"]), "integers"),
    ],
)
def test_bad_indexes_are_refused_before_anything_is_sent(
    nodes: Make, args: tuple[list[object], list[object]], match: str
) -> None:
    producer, consumer = _pair(nodes)
    with pytest.raises(TransferSubmitError, match=match):
        consumer.t.read_blocks("p", *args)  # type: ignore[arg-type]
    assert not consumer.t.state.live and not consumer.t.state.loose
    _read(producer, consumer, [0], [0])  # still healthy


def test_unknown_peer_and_closed_transport_are_refused(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        consumer.t.read_blocks("nobody", [0], [0])
    assert consumer.t.close() == []
    with pytest.raises(TransferSubmitError, match="closed"):
        consumer.t.read_blocks("p", [0], [0])
    assert not any(consumer.t.poll()) and consumer.t.close() == []
    with pytest.raises(PeerRejected, match="closed"):
        consumer.t.add_peer("p", producer.t.descriptor())


def test_cancel_ends_a_finished_but_unreported_read_and_ignores_the_rest(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    tid = consumer.t.read_blocks("p", [1], [2])
    read = consumer.t.read_handle(tid)
    wait_until(
        lambda: read.ended,
        timeout=T,
        what="the read to finish",
        pumps=[producer.t.progress, consumer.t.progress],
    )
    consumer.t.cancel([tid, 999, tid])
    for _ in range(10):
        consumer.poll()
    assert tid not in consumer.done | consumer.failed
    done = _read(producer, consumer, [1], [3])
    consumer.t.cancel([done])  # already reported: ignored


def test_deadline_fails_a_read_and_its_late_runs_never_land(nodes: Make) -> None:
    producer, consumer = _pair(nodes, transfer_timeout=0.3)
    tid = consumer.t.read_blocks("p", [5, 6], [1, 2])
    wait_until(
        lambda: tid in consumer.failed,
        timeout=T,
        what="the deadline",
        pumps=[lambda: consumer.poll("p")],
    )
    consumer.blocks[[5, 6]] = CANARY
    for _ in range(100):  # the producer serves it now: its runs are drained
        producer.poll()
        consumer.poll()
    assert (consumer.blocks[[5, 6]] == CANARY).all()


def test_reads_are_reported_to_their_own_peer(nodes: Make) -> None:
    consumer, p, q = nodes(seed=0), nodes(seed=1), nodes(seed=2)
    p.link("c", consumer, back_as="p")
    q.link("c", consumer, back_as="q")
    from_p = {consumer.t.read_blocks("p", [i], [i]) for i in range(4)}
    from_q = {consumer.t.read_blocks("q", [i], [i]) for i in range(4, 8)}
    wait_until(
        lambda: from_p <= consumer.done,
        timeout=T,
        what="p's reads",
        pumps=[p.t.progress, q.t.progress, lambda: consumer.poll("p")],
    )
    assert not from_q & (consumer.done | consumer.failed), "poll('p') reports only p's"
    wait_until(
        lambda: from_q <= consumer.done,
        timeout=T,
        what="q's reads",
        pumps=[p.t.progress, q.t.progress, lambda: consumer.poll("q")],
    )
    assert (consumer.blocks[:4] == p.blocks[:4]).all()
    assert (consumer.blocks[4:8] == q.blocks[4:8]).all()


def test_many_pending_reads_cost_nothing_until_served(nodes: Make) -> None:
    producer, consumer = _pair(nodes, num_blocks=64)
    ids = [consumer.t.read_blocks("p", [slot], [63 - slot]) for slot in range(64)]
    settle([producer, consumer], {consumer: set(ids)}, "64 reads")
    assert set(ids) <= consumer.done
    assert (consumer.blocks == producer.blocks[::-1]).all()


def test_a_small_staging_budget_still_moves_everything(nodes: Make) -> None:
    producer, consumer = _pair(nodes, staging_bytes=1, coalesce=False)
    _read(producer, consumer, list(range(32)), list(range(31, -1, -1)))


def test_a_peer_moves_to_a_fresh_link_before_read_ids_wrap(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    peer = consumer.t.attached_peer("p")
    assert isinstance(peer, Peer)
    peer.next_rid = tags.RID_LIMIT - 1
    old = peer.link
    _read(producer, consumer, [1], [2])
    _read(producer, consumer, [3], [4])
    assert peer.link != old and peer.next_rid == 1


def test_peers_must_agree_on_endpoint_error_handling(nodes: Make) -> None:
    safe, fast = nodes(), nodes(endpoint_error_handling=False)
    with pytest.raises(PeerRejected, match="endpoint_error_handling"):
        safe.t.add_peer("fast", fast.t.descriptor())
    with pytest.raises(TransferSubmitError):
        safe.t.read_blocks("fast", [0], [0])


def test_an_older_wire_version_is_rejected(nodes: Make) -> None:
    import msgpack

    node = nodes()
    old = msgpack.packb(
        {
            "transport": "ucx",
            "v": 1,
            "address": b"x",
            "instance": 1,
            "num_blocks": 32,
            "block_len": 1024,
            "max_run": 1,
            "error_handling": True,
        }
    )
    with pytest.raises(PeerRejected, match="version"):
        node.t.add_peer("old", old)


def test_remove_then_close_release_everything(nodes: Make) -> None:
    producer, consumer = _pair(nodes)
    _read(producer, consumer, [2, 3], [0, 1])
    pending = consumer.t.read_blocks("p", [4], [5])
    consumer.blocks[4] = CANARY
    assert consumer.t.remove_peer("p") == []
    with pytest.raises(TransferSubmitError):
        consumer.t.read_blocks("p", [4], [5])
    for _ in range(50):
        producer.poll()
        consumer.poll()
    assert pending not in consumer.done | consumer.failed and (consumer.blocks[4] == CANARY).all()
    consumer.t.add_peer("p", producer.t.descriptor())
    _read(producer, consumer, [4], [5])
    assert consumer.t.close() == [] and producer.t.close() == []


def test_re_adding_a_peer_behind_a_failed_endpoint_makes_a_fresh_one(nodes: Make) -> None:
    """A producer paused past UCX's keepalive comes back with the same worker address: the new
    session's add_peer must not keep the dead endpoint (every read would fail forever).

    Keepalive fails the endpoints at both ends, and the new session registers each end again.
    (Only one end marked dead would not be the scenario: releasing its endpoint disconnects
    the other end's live one, UCX's pair of the two, so a read in between may fail.)"""
    producer, consumer = _pair(nodes)
    old, back = consumer.t.attached_peer("p"), producer.t.attached_peer("c")
    assert isinstance(old, Peer) and isinstance(back, Peer)
    old.dead = back.dead = True  # as the progress loops mark them when the endpoints error
    with pytest.raises(TransferSubmitError, match="unreachable"):
        consumer.t.read_blocks("p", [1], [2])
    producer.link("c", consumer, back_as="p")  # the new session registers both ends again
    assert consumer.t.attached_peer("p") is not old
    assert producer.t.attached_peer("c") is not back
    _read(producer, consumer, [1], [2])
    consumer.t.add_peer("p", producer.t.descriptor())  # healthy: kept as it is
    assert consumer.t.attached_peer("p") is not old


def test_a_consumer_that_removes_its_producer_still_drains_the_sends_serving_it(
    nodes: Make,
) -> None:
    """The consumer cancels reads the producer is already serving and removes the producer
    at once (a producer shutting down): it keeps the endpoint and drains the runs still
    coming into scratch, so the producer's rendezvous sends complete and its remove_peer
    returns nothing undrained; the cancelled slots keep their canary."""
    opts = {"ucx_config": {"TLS": "tcp"}, "drain_timeout": 3.0}
    producer = nodes(seed=1, num_blocks=16, block_len=256 * 1024, **opts)
    consumer = nodes(seed=2, num_blocks=16, block_len=256 * 1024, **opts)
    producer.link("c", consumer, back_as="p")
    tids = [consumer.t.read_blocks("p", [i], [i]) for i in range(8)]
    wait_until(
        lambda: len(producer.t.state.serves) == len(tids),
        timeout=T,
        what="the producer serving every read",
        pumps=[producer.t.progress, lambda: consumer.t.state.worker.progress()],
    )
    consumer.t.cancel(tids)
    consumer.blocks[:8] = CANARY
    assert consumer.t.remove_peer("p") == []
    assert consumer.t.state.retired, "the consumer released the endpoint the producer still needs"
    wait_until(
        lambda: not producer.t.state.serves and not consumer.t.state.retired,
        timeout=T,
        what="the serving sends to drain",
        pumps=[producer.poll, consumer.poll],
    )
    assert producer.t.remove_peer("c") == []
    assert (consumer.blocks[:8] == CANARY).all()
    assert not consumer.t.state.ghosts
    assert consumer.t.close() == [] and producer.t.close() == []
