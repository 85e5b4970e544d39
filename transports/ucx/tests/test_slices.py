"""Regions of any size (data option ``slice_bytes``): no message crosses a slice boundary of
either side. Tiny slices of 3 blocks here, so every read crosses boundaries; a peer may
slice differently (it advertises its own)."""

from __future__ import annotations

from collections.abc import Callable

import msgpack
import numpy as np
import pytest
from p2pkv.errors import PeerRejected
from p2pkv.runs import ONE_SLICE
from p2pkv_ucx import wire
from p2pkv_ucx.records import Peer
from slice_oracle import cuts
from ucx_helpers import Node, settle

Make = Callable[..., Node]
BLOCK = 1024
THREE = 3 * BLOCK + 10  # rounds down to 3 blocks


@pytest.mark.parametrize("producer_blocks", [3, 5], ids=["same-slices", "other-slices"])
def test_reads_cross_slices_byte_exact_one_message_per_piece(
    nodes: Make, producer_blocks: int
) -> None:
    producer = nodes(num_blocks=64, block_len=BLOCK, seed=1, slice_bytes=producer_blocks * BLOCK)
    consumer = nodes(num_blocks=64, block_len=BLOCK, seed=2, slice_bytes=THREE)
    producer.link("c", consumer, back_as="p")
    scattered = np.random.default_rng(4).choice(64, size=40, replace=False).tolist()
    for dst, src, runs in [
        (list(range(32)), list(range(32)), 1 + len(cuts(0, 32, 3) | cuts(0, 32, producer_blocks))),
        (
            list(range(16, 48)),
            list(range(32, 64)),
            1 + len(cuts(16, 32, 3) | cuts(32, 32, producer_blocks)),
        ),
        (scattered, list(range(40)), None),
    ]:
        sent, received = producer.t.descriptors_posted, consumer.t.descriptors_posted
        tid = consumer.t.read_blocks("p", dst, src)
        settle([producer, consumer], {consumer: {tid}}, "the read")
        assert tid in consumer.done
        assert (consumer.blocks[dst] == producer.blocks[src]).all()
        if runs is not None:
            posted = (
                producer.t.descriptors_posted - sent,
                consumer.t.descriptors_posted - received,
            )
            assert posted == (runs, runs)


def test_a_producer_refuses_a_run_across_its_slices(nodes: Make) -> None:
    producer = nodes(num_blocks=32, block_len=BLOCK, seed=1, slice_bytes=THREE)
    consumer = nodes(num_blocks=32, block_len=BLOCK, seed=2)
    producer.link("c", consumer, back_as="p")
    before = consumer.blocks.copy()
    peer = consumer.t.attached_peer("p")
    assert isinstance(peer, Peer)
    peer.slices = ONE_SLICE  # lie: ignore the producer's slices
    tid = consumer.t.read_blocks("p", list(range(8)), list(range(8)))
    settle([producer, consumer], {consumer: {tid}}, "the refusal")
    assert tid in consumer.failed
    assert (consumer.blocks == before).all()


@pytest.mark.parametrize("value", [0, -3, "3", None, True])
def test_a_malformed_slice_size_is_rejected(nodes: Make, value: object) -> None:
    producer, consumer = nodes(seed=1, slice_bytes=THREE), nodes(seed=2)
    fields = msgpack.unpackb(producer.t.descriptor(), raw=False)
    assert fields["slice_blocks"] == 3
    assert wire.decode_descriptor(producer.t.descriptor()).slice_blocks == 3
    if value is None:
        del fields["slice_blocks"]
    else:
        fields["slice_blocks"] = value
    with pytest.raises(PeerRejected, match="peer 'p': descriptor needs positive integers"):
        consumer.t.add_peer("p", msgpack.packb(fields))
    consumer.t.add_peer("p", producer.t.descriptor())
