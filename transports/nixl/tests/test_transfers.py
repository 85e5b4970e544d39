"""Reads between two processes over real NIXL: bytes, index checks, scoped polling, re-adds.

The consumer (this process) posts every read; the producers live in a ``PeerHost`` child.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
from nixl_fixtures import MakeLocal, MakePollLog, MakeRecorder, WaitFor
from p2pkv.contracts import DataSettings
from p2pkv.errors import TransferSubmitError
from p2pkv.runs import coalesce
from p2pkv.testing.peers import PeerHost, pattern
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport

BLOCK = 16 * 1024


def _blocks(region: bytes) -> np.ndarray:
    return np.frombuffer(region, dtype=np.uint8).reshape(-1, BLOCK)


@pytest.mark.parametrize(
    ("options", "lane"),
    [({}, "direct"), ({"staging": "always"}, "staged")],
    ids=["auto-direct", "always-staged"],
)
def test_256_blocks_land_byte_exact_at_scattered_slots(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor, options: dict[str, Any], lane: str
) -> None:
    consumer = make_local(num_blocks=512, block_len=BLOCK, seed=7, **options)
    before = consumer.blocks.copy()
    producer = host.data_peer(NixlDataTransport, 256, BLOCK, {})
    producer.fill(3)
    source = _blocks(producer.region_bytes())
    slots = np.random.default_rng(11).choice(512, size=256, replace=False)
    sources = np.random.default_rng(12).permutation(256)
    consumer.transport.add_peer("producer", producer.descriptor)
    producer.add_peer("consumer", consumer.transport.descriptor())  # it serves staged reads
    assert consumer.transport.lane("producer") == lane

    tid = consumer.transport.read_blocks("producer", slots.tolist(), sources.tolist())
    done, failed = wait_for(consumer.transport, "producer", {tid})

    assert done == {tid} and not failed
    np.testing.assert_array_equal(consumer.blocks[slots], source[sources])
    untouched = np.setdiff1d(np.arange(512), slots)
    np.testing.assert_array_equal(consumer.blocks[untouched], before[untouched])
    assert consumer.transport.staging_usage()["quarantined"] == 0
    producer.close()


@pytest.fixture(scope="module")
def consumer_and_small_peer(host: PeerHost) -> Iterator[SimpleNamespace]:
    """A 128-block consumer registered with a 32-block producer (remote bound != local)."""
    array = pattern(1, 128 * BLOCK)
    transport = NixlDataTransport.create(DataSettings(array.data, BLOCK))
    small = host.data_peer(NixlDataTransport, 32, BLOCK, {})
    small.fill(2)
    transport.add_peer("small", small.descriptor)
    yield SimpleNamespace(transport=transport, array=array, source=_blocks(small.region_bytes()))
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
        ([], [], "at least one block"),
        (np.array([], dtype=np.int64), [], "at least one block"),
        ([5, 5], [0, 1], "local block index 5 is named twice"),
        ([0.5], [1], "flat sequence of integers"),
        ([[0]], [[1]], "flat sequence of integers"),
        (["0"], [1], "flat sequence of integers"),
        ([0], ["1"], "remote (peer 'small') block indexes must be a flat sequence of integers"),
        (
            list(range(100)),
            [*range(31), *range(31), *range(31), *range(6), 32],
            "remote (peer 'small') block index 32 is outside",
        ),
        (list(range(100)), [-5, *range(31), *range(31), *range(31), *range(6)], "index -5 is"),
        ([*range(99), 170], [i % 32 for i in range(100)], "local block index 170 is outside"),
        (
            [*range(30), *range(30, 0, -1), *range(10)],
            [i % 32 for i in range(70)],
            "local block index 29 is named twice",
        ),
        (np.array([0.0]), [1], "flat sequence of integers"),
        ([0], np.zeros((1, 1), dtype=np.int64), "flat sequence of integers"),
        ([0], [2**40], f"remote (peer 'small') block index {2**40} is outside 0..31"),
    ],
)
def test_bad_indexes_are_refused_before_anything_is_posted(
    consumer_and_small_peer: SimpleNamespace,
    record: MakeRecorder,
    local_idxs: object,
    remote_idxs: object,
    says: str,
) -> None:
    consumer = consumer_and_small_peer
    recorder = record(consumer.transport)

    with pytest.raises(TransferSubmitError, match=re.escape(says)):
        consumer.transport.read_blocks("small", local_idxs, remote_idxs)

    assert not {"make_prepped_xfer", "transfer"} & set(recorder.names())


def test_numpy_indexes_and_repeated_sources_are_accepted(
    consumer_and_small_peer: SimpleNamespace, host: PeerHost, wait_for: WaitFor
) -> None:
    """Numpy integers (in lists, or 1-D arrays) are indexes like ints; one source block may
    be read into several of our blocks (only destinations must be distinct)."""
    t = consumer_and_small_peer.transport
    blocks = consumer_and_small_peer.array.reshape(-1, BLOCK)
    ids = {
        t.read_blocks("small", [np.int64(3), np.int32(4)], [np.uint8(7), 7]),
        t.read_blocks("small", np.array([10, 11], dtype=np.uint16), np.array([0, 0])),
    }
    done, failed = wait_for(t, "small", ids)
    assert done == ids and not failed
    np.testing.assert_array_equal(blocks[[3, 4]], consumer_and_small_peer.source[[7, 7]])
    np.testing.assert_array_equal(blocks[[10, 11]], consumer_and_small_peer.source[[0, 0]])


@pytest.mark.parametrize("staging", ["never", "always"])
def test_a_repeated_source_fills_every_slot_it_is_named_for_on_both_lanes(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor, staging: str
) -> None:
    """Repeated remote indexes, scattered and in runs, over the direct READ and over the
    staged request (the producer WRITEs one source block into several pool blocks)."""
    consumer = make_local(num_blocks=32, block_len=BLOCK, seed=8, staging=staging)
    producer = host.data_peer(NixlDataTransport, 16, BLOCK, {})
    producer.fill(6)
    source = _blocks(producer.region_bytes())
    consumer.transport.add_peer("p", producer.descriptor)
    producer.add_peer("c", consumer.transport.descriptor())
    assert consumer.transport.lane("p") == ("staged" if staging == "always" else "direct")
    remote = [5, 5, 5, 0, 1, 1, 15, 0]
    local = [20, 3, 4, 10, 11, 12, 31, 0]

    tid = consumer.transport.read_blocks("p", local, remote)
    assert wait_for(consumer.transport, "p", {tid}) == ({tid}, set())
    np.testing.assert_array_equal(consumer.blocks[local], source[remote])
    producer.close()


def test_poll_is_scoped_when_two_peers_share_the_transport(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor, poll_log: MakePollLog
) -> None:
    consumer = make_local(num_blocks=64, block_len=BLOCK, seed=5)
    t = consumer.transport
    first = host.data_peer(NixlDataTransport, 64, BLOCK, {})
    second = host.data_peer(NixlDataTransport, 64, BLOCK, {})
    first.fill(21)
    second.fill(22)
    t.add_peer("first", first.descriptor)
    t.add_peer("second", second.descriptor)
    t.add_peer("first-again", first.descriptor)  # a second session to the same agent
    log = poll_log(t)
    slot = {"first": 0, "second": 10, "first-again": 20}

    ids = {
        peer: [log.submitted(t.read_blocks(peer, [slot[peer] + i], [i]), peer) for i in range(3)]
        for peer in ("first", "second", "first-again")
    }
    for peer in ("second", "first-again", "first"):  # each scope reports its own ids only
        seen: set[int] = set()

        def mine(peer: str = peer, seen: set[int] = seen) -> bool:
            result = log.poll(peer)  # PollLog fails if another peer's id shows up
            seen.update(result.done)
            return set(ids[peer]) <= seen

        wait_until(mine, timeout=15.0, what=f"{peer}'s reads")
    assert log.pending == set()
    assert log.poll(None) == ([], [])
    np.testing.assert_array_equal(consumer.blocks[10:13], _blocks(second.region_bytes())[:3])

    # dropping one session to an agent keeps the other one working
    assert log.undrained(t.remove_peer("first-again"), "remove_peer") == set()
    tid = t.read_blocks("first", [9], [9])
    done, _ = wait_for(t, "first", {tid})
    assert done == {tid}
    np.testing.assert_array_equal(consumer.blocks[9], _blocks(first.region_bytes())[9])
    first.close()
    second.close()


@pytest.mark.parametrize(
    "options",
    [{}, {"enable_prog_thread": True, "warmup": False}, {"staging": "always"}],
    ids=["default", "prog-thread", "staged"],
)
def test_contiguous_runs_and_repeated_reads(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor, options: Any
) -> None:
    consumer = make_local(num_blocks=64, block_len=BLOCK, seed=9, **options)
    producer = host.data_peer(NixlDataTransport, 64, BLOCK, {})
    producer.fill(19)
    source = _blocks(producer.region_bytes())
    consumer.transport.add_peer("p", producer.descriptor)
    producer.add_peer("c", consumer.transport.descriptor())
    ids = {
        consumer.transport.read_blocks("p", list(range(32, 64)), list(range(0, 32))),
        # numpy index arrays: accepted, though typed Sequence[int]
        consumer.transport.read_blocks(
            "p",
            np.arange(0, 32),  # type: ignore[arg-type]
            np.arange(32, 64, dtype=np.int32),  # type: ignore[arg-type]
        ),
    }
    done, failed = wait_for(consumer.transport, "p", ids)
    assert done == ids and not failed
    np.testing.assert_array_equal(consumer.blocks[32:], source[:32])
    np.testing.assert_array_equal(consumer.blocks[:32], source[32:])
    producer.close()


def test_re_adding_a_peer_ends_its_reads_and_replaces_it_once_quiescent(
    make_local: MakeLocal,
    doomed: PeerHost,
    record: MakeRecorder,
    wait_for: WaitFor,
    poll_log: MakePollLog,
) -> None:
    """A new incarnation (another descriptor) replaces the peer at once: the old read ends
    finally and is never reported; the old record goes once its warm-up READ ended."""
    consumer = make_local(num_blocks=16, block_len=BLOCK, seed=4)
    t = consumer.transport
    old, new = (doomed.data_peer(NixlDataTransport, 16, BLOCK, {}) for _ in range(2))
    new.fill(14)
    source = _blocks(new.region_bytes())
    recorder = record(t)
    log = poll_log(t)
    doomed.pause()  # the producers stop progressing: the cold connection cannot complete
    t.add_peer("p", old.descriptor)
    log.submitted(t.read_blocks("p", [2], [1]), "p")  # ended by the re-add below
    assert log.poll("p") == ([], [])
    t.add_peer("p", old.descriptor)  # the same descriptor: nothing changes
    assert log.pending and log.poll("p") == ([], [])

    t.add_peer("p", new.descriptor)  # replaced: the old read ends now, finally
    log.ended_peer("p")
    assert recorder.names().count("release_dlist_handle") == 0  # its warm-up still runs
    doomed.resume()
    consumer.blocks[2] = 0xCC  # slot of the ended read, reused at once
    fresh = log.submitted(t.read_blocks("p", [4], [3]), "p")
    wait_until(
        lambda: log.terminal({fresh}),
        timeout=15.0,
        what="the new read",
        pumps=[lambda: log.poll("p")],
    )

    assert log.done == {fresh}  # the old read was never reported (PollLog checks it)
    wait_until(  # the old record goes once its warm-up READ has ended too
        lambda: recorder.names().count("release_dlist_handle") == 1,
        timeout=15.0,
        what="the replaced registration to be released",
        pumps=[t.progress],
    )
    assert recorder.names().count("release_dlist_handle") == 1
    np.testing.assert_array_equal(consumer.blocks[4], source[3])
    assert (consumer.blocks[2] == 0xCC).all(), "the ended read landed after the re-add"


def test_runs_join_pairs_consecutive_on_both_sides() -> None:
    local_starts, remote_starts, lengths = coalesce(
        np.array([0, 1, 2, 5, 6, 7, 8]), np.array([3, 4, 9, 10, 11, 11, 12])
    )  # remote breaks after 4 and repeats 11; local jumps 2 -> 5
    assert local_starts.tolist() == [0, 2, 5, 7]
    assert remote_starts.tolist() == [3, 9, 10, 11]
    assert lengths.tolist() == [2, 1, 2, 2]


def test_a_contiguous_read_posts_one_descriptor_a_scattered_one_one_per_block(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor
) -> None:
    consumer = make_local(num_blocks=64, block_len=BLOCK, seed=10, staging="never")
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 64, BLOCK, {})
    producer.fill(31)
    source = _blocks(producer.region_bytes())
    t.add_peer("p", producer.descriptor)
    for local, remote, posted in [
        (list(range(16, 48)), list(range(32)), 1),  # one run of 32 blocks on both sides
        (list(range(0, 64, 2)), list(range(32, 64)), 32),  # local not consecutive
    ]:
        before = t.descriptors_posted
        tid = t.read_blocks("p", local, remote)
        assert wait_for(t, "p", {tid}) == ({tid}, set())
        assert t.descriptors_posted - before == posted
        np.testing.assert_array_equal(consumer.blocks[local], source[remote])
    producer.close()
