"""Writes between two processes over real NIXL: bytes, index checks, scoped polling, re-adds."""

from __future__ import annotations

import re
from types import SimpleNamespace

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.contracts import EMPTY_POLL, DataSettings
from p2pkv.errors import TransferSubmitError
from p2pkv.testing.peers import pattern
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport
from p2pkv_nixl.transport import _indexes, _refuse_repeats

BLOCK = 16 * 1024


def _blocks(region: bytes) -> np.ndarray:
    return np.frombuffer(region, dtype=np.uint8).reshape(-1, BLOCK)


def test_256_blocks_land_byte_exact_at_scattered_slots(make_local, host, wait_for) -> None:
    producer = make_local(num_blocks=256, block_len=BLOCK, seed=7)
    consumer = host.data_peer(type(producer.transport), 512, BLOCK, {})
    consumer.fill(3)
    before = _blocks(consumer.region_bytes())
    slots = np.random.default_rng(11).choice(512, size=256, replace=False)
    sources = np.random.default_rng(12).permutation(256)
    producer.transport.add_peer("consumer", consumer.descriptor)

    tid = producer.transport.write_blocks("consumer", sources.tolist(), slots.tolist())
    done, failed = wait_for(producer.transport, "consumer", {tid})

    assert done == {tid} and not failed
    after = _blocks(consumer.region_bytes())
    np.testing.assert_array_equal(after[slots], producer.blocks[sources])
    untouched = np.setdiff1d(np.arange(512), slots)
    np.testing.assert_array_equal(after[untouched], before[untouched])
    consumer.close()


@pytest.fixture(scope="module")
def producer_and_small_peer(host):
    """A 128-block producer registered with a 32-block consumer (remote bound != local)."""
    array = pattern(1, 128 * BLOCK)
    transport = NixlDataTransport.create(DataSettings(memoryview(array), BLOCK))
    small = host.data_peer(NixlDataTransport, 32, BLOCK, {})
    transport.add_peer("small", small.descriptor)
    yield SimpleNamespace(transport=transport, array=array)
    transport.close()
    small.close()


@pytest.mark.parametrize(
    ("local_idxs", "remote_idxs", "says"),
    [
        ([0], [32], "remote (peer 'small') block index 32 is outside 0..31"),
        ([0, 1, 2], [0, 40, 1], "block index 40 is outside"),
        ([0], [-1], "block index -1 is outside"),
        ([128], [0], "local block index 128 is outside 0..127"),
        ([-2], [0], "local block index -2"),
        ([0, 1], [0], "2 local but 1 remote"),
        ([0, 1], [5, 5], "block index 5 is written twice"),
        ([0.5], [1], "flat list of integers"),
        ([[0]], [[1]], "flat list of integers"),
        (["0"], [1], "flat list of integers"),
        (list(range(100)), [*range(99), 32], "remote (peer 'small') block index 32 is outside"),
        (list(range(100)), [-5, *range(99)], "block index -5 is outside"),
        ([*range(99), 170], list(range(100)), "local block index 170 is outside"),
        (list(range(70)), [*range(30), *range(30, 0, -1), *range(10)], "is written twice"),
        (np.array([0.0]), [1], "flat list of integers"),
        ([0], np.zeros((1, 1), dtype=np.int64), "flat list of integers"),
        ([0], [2**40], "remote (peer 'small') block index outside 0..31"),
    ],
)
def test_bad_indexes_are_refused_before_anything_is_posted(
    producer_and_small_peer, record, local_idxs, remote_idxs, says
) -> None:
    producer = producer_and_small_peer
    recorder = record(producer.transport)

    with pytest.raises(TransferSubmitError, match=re.escape(says)):
        producer.transport.write_blocks("small", local_idxs, remote_idxs)

    assert not {"make_prepped_xfer", "transfer"} & set(recorder.names())


def test_poll_is_scoped_when_two_peers_share_the_transport(make_local, host, wait_for) -> None:
    producer = make_local(num_blocks=64, block_len=BLOCK, seed=5)
    t = producer.transport
    first = host.data_peer(type(t), 64, BLOCK, {})
    second = host.data_peer(type(t), 64, BLOCK, {})
    t.add_peer("first", first.descriptor)
    t.add_peer("second", second.descriptor)
    t.add_peer("first-again", first.descriptor)  # a second session to the same agent
    log = PollLog(t.poll, t.cancel, "producer")

    ids = {
        peer: [log.submitted(t.write_blocks(peer, [i], [i]), peer) for i in range(3)]
        for peer in ("first", "second", "first-again")
    }
    # everything has ended by now on the wire; each scope reports its own ids only
    for peer in ("second", "first-again", "first"):
        seen: set[int] = set()

        def mine(peer: str = peer, seen: set[int] = seen) -> bool:
            result = log.poll(peer)  # PollLog fails if another peer's id shows up
            seen.update(result.done)
            return set(ids[peer]) <= seen
        wait_until(mine, timeout=15.0, what=f"{peer}'s transfers")
    assert log.pending == set()
    assert log.poll(None) == ([], [])

    # dropping one session to an agent keeps the other one working
    assert t.remove_peer("first-again") == []
    tid = t.write_blocks("first", [9], [9])
    done, _ = wait_for(t, "first", {tid})
    assert done == {tid}
    np.testing.assert_array_equal(_blocks(first.region_bytes())[9], producer.blocks[9])
    first.close()
    second.close()


@pytest.mark.parametrize(
    "options", [{}, {"enable_prog_thread": True, "warmup": False}], ids=["default", "prog-thread"]
)
def test_contiguous_runs_and_repeated_writes(make_local, host, wait_for, options) -> None:
    producer = make_local(num_blocks=64, block_len=BLOCK, seed=9, **options)
    consumer = host.data_peer(type(producer.transport), 64, BLOCK, {})
    producer.transport.add_peer("c", consumer.descriptor)
    ids = {
        producer.transport.write_blocks("c", list(range(0, 32)), list(range(32, 64))),
        producer.transport.write_blocks("c", np.arange(32, 64), np.arange(0, 32, dtype=np.int32)),
        producer.transport.write_blocks("c", [], []),
    }
    done, failed = wait_for(producer.transport, "c", ids)
    assert done == ids and not failed
    after = _blocks(consumer.region_bytes())
    np.testing.assert_array_equal(after[32:], producer.blocks[:32])
    np.testing.assert_array_equal(after[:32], producer.blocks[32:])
    consumer.close()


def test_re_adding_a_peer_with_a_transfer_in_flight_replaces_it_once_quiescent(
    make_local, doomed, record, wait_for
) -> None:
    producer = make_local(num_blocks=16, block_len=BLOCK, seed=4)
    t = producer.transport
    consumer = doomed.data_peer(type(t), 16, BLOCK, {})
    recorder = record(t)
    doomed.pause()  # the consumer stops progressing: the cold connection cannot complete
    t.add_peer("c", consumer.descriptor)
    old = t.write_blocks("c", [1], [2])
    assert t.poll("c") == EMPTY_POLL

    t.add_peer("c", consumer.descriptor)  # replaced while `old` still runs
    assert recorder.names().count("release_dlist_handle") == 0
    doomed.resume()
    new = t.write_blocks("c", [3], [4])
    done, failed = wait_for(t, "c", {old, new})

    assert done == {old, new} and not failed
    wait_until(  # the old registration goes once its warm-up READ has ended too
        lambda: recorder.names().count("release_dlist_handle") == 1,
        timeout=15.0,
        what="the replaced registration to be released",
        pumps=[lambda: t.poll("c")],
    )
    assert "remove_remote_agent" not in recorder.names()  # the agent is still in use
    after = _blocks(consumer.region_bytes())
    np.testing.assert_array_equal(after[[2, 4]], producer.blocks[[1, 3]])


@given(st.lists(st.integers(-(2**40), 2**40), max_size=200), st.integers(1, 2**31 - 1))
def test_index_check_accepts_exactly_the_in_range_lists(values: list[int], limit: int) -> None:
    ok = all(0 <= v < limit for v in values)
    try:
        checked = _indexes(values, limit)
    except ValueError:
        assert not ok
    else:
        assert ok and checked.dtype == np.int32 and checked.tolist() == values
        assert _indexes(np.asarray(values, dtype=np.int64), limit).tolist() == values


@given(st.lists(st.integers(0, 99), max_size=150))
def test_repeated_destinations_are_found(values: list[int]) -> None:
    remote = _indexes(values, 100)
    try:
        _refuse_repeats(remote, values)
    except ValueError:
        assert len(set(values)) < len(values)
    else:
        assert len(set(values)) == len(values)
