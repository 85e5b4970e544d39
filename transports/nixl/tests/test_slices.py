"""Regions registered in slices (data option ``slice_bytes``): tiny slices of 3 blocks here, so
every read crosses slice boundaries on both sides; a peer may slice differently."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
from nixl_fixtures import MakeLocal, WaitFor
from p2pkv.errors import ConfigError, PeerRejected
from p2pkv.testing.peers import PeerHost
from p2pkv_nixl import NixlDataTransport
from p2pkv_nixl.agent import block_dlist
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.slices import MAX_SLICES, region_slices
from slice_oracle import cuts

BLOCK = 4096
THREE = 3 * BLOCK + 100  # rounds down to 3 blocks
FIVE = 5 * BLOCK


def _blocks(region: bytes) -> np.ndarray:
    return np.frombuffer(region, dtype=np.uint8).reshape(-1, BLOCK)


def test_slice_layout_rounds_down_to_whole_blocks_at_least_one() -> None:
    assert region_slices(16, BLOCK, THREE) == (3, 3, 3, 3, 3, 1)
    assert region_slices(6, BLOCK, THREE) == (3, 3)
    assert region_slices(2, BLOCK, 4 * 2**30) == (2,)
    with pytest.raises(ConfigError, match=r"'slice_bytes'.*more than"):
        region_slices(MAX_SLICES + 1, BLOCK, BLOCK)


def test_prepared_lists_have_one_row_per_slice() -> None:
    rows = block_dlist(0x1000, (3, 3, 1), 64)
    assert rows.tolist() == [
        [0x1000, 64, 0, 64, 3],
        [0x1000 + 192, 64, 0, 64, 3],
        [0x1000 + 384, 64, 0, 64, 1],
    ]


def test_the_descriptor_advertises_the_slices_and_nixl_holds_them_apart(
    make_local: MakeLocal,
) -> None:
    t = make_local(num_blocks=16, block_len=BLOCK, slice_bytes=THREE).transport
    desc = RegionDescriptor.decode(t.descriptor(), "self")
    assert desc.slices == (3, 3, 3, 3, 3, 1)
    other = make_local(num_blocks=16, block_len=BLOCK, seed=2).transport
    assert RegionDescriptor.decode(other.descriptor(), "o").slices == (16,)  # the 3.5 GiB default
    other.add_peer("t", t.descriptor())
    agent = other.state.agent
    span = [(int(other._blocks.ctypes.data), 4 * BLOCK, 0)]
    with pytest.raises(Exception, match="NOT_FOUND"):  # 4 blocks span two of t's slices
        agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(span, "DRAM"),
            agent.get_xfer_descs([(desc.base, 4 * BLOCK, 0)], "DRAM"),
            desc.agent,
        )


@pytest.mark.parametrize("producer_slice", [THREE, FIVE], ids=["same-slices", "other-slices"])
def test_direct_reads_cross_slices_byte_exact_one_descriptor_per_piece(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor, producer_slice: int
) -> None:
    consumer = make_local(
        num_blocks=64, block_len=BLOCK, seed=10, staging="never", slice_bytes=THREE
    )
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 64, BLOCK, {"slice_bytes": producer_slice})
    producer.fill(31)
    source = _blocks(producer.region_bytes())
    t.add_peer("p", producer.descriptor)
    every = producer_slice // BLOCK
    scattered = np.random.default_rng(3).choice(64, size=40, replace=False).tolist()
    for local, remote, posted in [
        (list(range(32)), list(range(32)), 1 + len(cuts(0, 32, 3) | cuts(0, 32, every))),
        (list(range(16, 48)), list(range(32)), 1 + len(cuts(16, 32, 3) | cuts(0, 32, every))),
        (list(range(0, 64, 2)), list(range(32, 64)), 32),
        (scattered, list(range(40)), None),
    ]:
        before = t.descriptors_posted
        tid = t.read_blocks("p", local, remote)
        assert wait_for(t, "p", {tid}) == ({tid}, set())
        if posted is not None:
            assert t.descriptors_posted - before == posted
        np.testing.assert_array_equal(consumer.blocks[local], source[remote])
    assert t.descriptors_posted - before >= 14  # 40 blocks cut at 3-block slices at least
    producer.close()


def test_staged_reads_write_across_both_sides_slices_byte_exact(
    make_local: MakeLocal, host: PeerHost, wait_for: WaitFor
) -> None:
    consumer = make_local(
        num_blocks=64,
        block_len=BLOCK,
        seed=4,
        staging="always",
        staging_blocks=16,
        slice_bytes=THREE,
    )
    t = consumer.transport
    producer = host.data_peer(NixlDataTransport, 64, BLOCK, {"slice_bytes": FIVE})
    producer.fill(9)
    source = _blocks(producer.region_bytes())
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())  # it serves staged reads
    assert t.lane("p") == "staged" and t.state.pool is not None and t.state.pool.slice_blocks == 3
    for local, remote in [
        (list(range(40, 56)), list(range(3, 19))),  # the whole pool, contiguous
        (list(range(16)), list(range(63, 47, -1))),
        (np.random.default_rng(5).choice(64, size=13, replace=False).tolist(), [7] * 13),
    ]:
        tid = t.read_blocks("p", local, remote)
        assert wait_for(t, "p", {tid}) == ({tid}, set())
        np.testing.assert_array_equal(consumer.blocks[local], source[remote])
    assert t.staging_usage() == {"capacity": 16, "free": 16, "quarantined": 0}
    producer.close()


@pytest.mark.parametrize(
    ("slices", "says"),
    [
        ([8, 8], "covers 16 blocks, the region has 8"),
        ([4, 0, 4], "not a positive integer"),
        ("8", "not a list"),
        (None, "not a list"),
    ],
)
def test_a_malformed_slice_list_is_rejected_at_add_peer(
    make_local: MakeLocal, slices: object, says: str
) -> None:
    t = make_local(num_blocks=8, block_len=BLOCK).transport
    peer = make_local(num_blocks=8, block_len=BLOCK, seed=2, slice_bytes=THREE).transport
    fields = msgpack.unpackb(peer.descriptor(), raw=False)
    fields["slices"] = slices
    with pytest.raises(PeerRejected, match=f"peer 'p': nixl descriptor slice list .*{says}"):
        t.add_peer("p", msgpack.packb(fields, use_bin_type=True))
    t.add_peer("p", peer.descriptor())  # the real one is fine
