"""Staged reads as requests served by the producer's WRITE (two transports in this process).

A staged read is a NIXL notification to the producer naming the blocks; the producer's
``progress`` posts a WRITE into our staging pool carrying the completion notification (see
the transport's module docstring). These tests check the producer's side: its WRITEs are
never reported by its ``poll``, it refuses malformed requests without raising (answering a
failure when the request id could be read), and ignores agents it did not add.
"""

from __future__ import annotations

import logging
import struct
from typing import Any

import numpy as np
import pytest
from nixl_fixtures import Local, MakeLocal
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport, wire

BLOCK = 4096

Pair = tuple[NixlDataTransport, NixlDataTransport, Local]
"""The ``pair`` fixture: (consumer, producer, the consumer's :class:`Local`)."""


class _Corrupting:
    """Wraps an agent; rewrites the first source index of each outgoing staged request."""

    def __init__(self, agent: Any, index: int) -> None:
        self._agent = agent
        self._index = index

    def __getattr__(self, name: str) -> Any:
        return getattr(self._agent, name)

    def send_notif(self, remote: str, message: bytes, *args: Any) -> Any:
        if message.startswith(wire.REQUEST):
            head = wire.REQUEST_HEAD.size
            message = message[:head] + struct.pack("<I", self._index) + message[head + 4 :]
        return self._agent.send_notif(remote, message, *args)


def _head(
    request: int, base: int, capacity: int, block_len: int, count: int, slice_blocks: int = 3
) -> bytes:
    """A staged request's head (the pool in slices of ``slice_blocks``)."""
    return wire.REQUEST_HEAD.pack(
        wire.REQUEST, request, base, capacity, block_len, count, slice_blocks
    )


def _serving(transport: NixlDataTransport) -> bool:
    """Whether the transport runs a WRITE serving a peer's staged read."""
    return any(peer.serving for peer in transport.state.peers)


@pytest.fixture
def pair(make_local: MakeLocal) -> Pair:
    """(consumer, producer, consumer Local): the consumer stages every read."""
    consumer = make_local(
        num_blocks=16, block_len=BLOCK, seed=1, staging="always", staging_blocks=8
    )
    producer = make_local(num_blocks=16, block_len=BLOCK, seed=2)
    consumer.transport.add_peer("p", producer.transport.descriptor())
    producer.transport.add_peer("c", consumer.transport.descriptor())
    return consumer.transport, producer.transport, consumer


def _read(
    consumer: NixlDataTransport, producer: NixlDataTransport, local: list[int], remote: list[int]
) -> tuple[set[int], set[int]]:
    tid = consumer.read_blocks("p", local, remote)
    done: set[int] = set()
    failed: set[int] = set()

    def ended() -> bool:
        served = producer.poll()
        assert not served.done and not served.failed, "the producer reported its WRITE"
        result = consumer.poll("p")
        done.update(result.done)
        failed.update(result.failed)
        return tid in done | failed

    wait_until(ended, timeout=15.0, what="the staged read to end")
    return done, failed


def test_a_staged_read_is_served_by_the_producers_write_and_lands_exact(pair: Pair) -> None:
    consumer, producer, local = pair
    assert consumer.lane("p") == "staged"
    source = producer._blocks.copy()
    done, failed = _read(consumer, producer, [9, 3, 4, 5], [0, 15, 7, 8])
    assert done and not failed
    np.testing.assert_array_equal(local.blocks[[9, 3, 4, 5]], source[[0, 15, 7, 8]])
    assert consumer.staging_usage() == {"capacity": 8, "free": 8, "quarantined": 0}
    assert not consumer.state.requests and not _serving(producer)
    assert producer.remove_peer("c") == [] and consumer.remove_peer("p") == []


@pytest.mark.parametrize(
    ("local", "remote", "posted"),
    [
        ([9, 3, 4], [4, 5, 6], 1),  # the WRITE's runs: producer blocks 4..6 into pool blocks 0..2
        ([0, 1, 2, 3], [0, 2, 4, 6], 4),  # scattered source: one descriptor per block
        ([0, 1, 2, 3], [7, 8, 9, 10], 2),  # the pool's slices of 3 blocks cut the run at block 3
    ],
)
def test_a_staged_read_counts_the_descriptors_its_request_asks_for(
    make_local: MakeLocal, local: list[int], remote: list[int], posted: int
) -> None:
    """``descriptors_posted`` counts a staged read too, on the consumer: the runs of the
    producer's WRITE its request asks for (:func:`p2pkv.runs.coalesce`, cut at both sides'
    slices), however our own slots lie."""
    consumer = make_local(
        num_blocks=16,
        block_len=BLOCK,
        seed=1,
        staging="always",
        staging_blocks=8,
        slice_bytes=3 * BLOCK,
    ).transport
    producer = make_local(num_blocks=16, block_len=BLOCK, seed=2).transport
    consumer.add_peer("p", producer.descriptor())
    producer.add_peer("c", consumer.descriptor())
    done, failed = _read(consumer, producer, local, remote)
    assert done and not failed
    assert consumer.descriptors_posted == posted


def test_a_request_the_producer_refuses_fails_the_read_and_frees_its_blocks(
    pair: Pair, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, producer, local = pair
    before = local.blocks.copy()
    consumer.state.agent = _Corrupting(consumer.state.agent, 1 << 20)  # a source index out of range
    with caplog.at_level(logging.WARNING, logger="p2pkv.nixl.transport"):
        done, failed = _read(consumer, producer, [0, 1], [0, 1])
    assert failed and not done
    np.testing.assert_array_equal(local.blocks, before)
    assert any(
        "refused staged read request" in r.getMessage() and "outside" in r.getMessage()
        for r in caplog.records
    )
    assert consumer.staging_usage()["free"] == 8
    consumer.state.agent = consumer.state.agent._agent
    assert _read(consumer, producer, [0, 1], [0, 1])[0]  # the pair still works


@pytest.mark.parametrize(
    "message",
    [
        wire.REQUEST,  # truncated header
        _head(7, 1 << 20, 8, BLOCK, 2),  # no arrays
        _head(7, 1 << 20, 8, 512, 1) + bytes(8),
        _head(7, 0, 8, BLOCK, 1) + bytes(9),
        _head(7, 1 << 20, 8, BLOCK, 0),
        _head(7, 1 << 20, 8, BLOCK, 2**32 - 1),
        _head(7, 1 << 20, 8, BLOCK, 1, slice_blocks=0) + bytes(9),  # no pool slices
        _head(7, 1 << 20, 2**20, BLOCK, 1, slice_blocks=1) + bytes(9),  # too many slices
        _head(7, 1 << 20, 8, BLOCK, 1)
        + struct.pack("<II", 0, 8)
        + b"md",  # pool index outside the pool
        _head(7, 1 << 20, 8, BLOCK, 1) + struct.pack("<II", 0, 0) + b"not nixl metadata",
        b"p2kvD1" + bytes(8),  # a completion of a read we never posted
        b"p2kvF1",  # a truncated failure
        b"something else entirely",
    ],
)
def test_malformed_notifications_are_refused_never_raised(
    pair: Pair, message: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    consumer, producer, _ = pair

    def refused() -> bool:
        return any("refused staged read request" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="p2pkv.nixl.transport"):
        consumer.state.agent.send_notif(producer.agent_name, message)
        producer.state.agent.send_notif(consumer.agent_name, message)
        if message.startswith(wire.REQUEST):
            wait_until(
                refused,
                timeout=15.0,
                what="the request to be refused",
                pumps=[producer.progress, consumer.progress],
            )
        for _ in range(50):
            producer.progress()
            consumer.progress()
    assert refused() == message.startswith(wire.REQUEST)
    assert not _serving(producer)
    assert _read(consumer, producer, [2], [3])[0]  # both sides still serve and read


def test_requests_from_an_agent_the_producer_did_not_add_are_ignored(
    make_local: MakeLocal, caplog: pytest.LogCaptureFixture
) -> None:
    stranger = make_local(
        num_blocks=16, block_len=BLOCK, seed=3, staging="always", drain_timeout=0.2
    ).transport
    producer = make_local(num_blocks=16, block_len=BLOCK, seed=4).transport
    stranger.add_peer("p", producer.descriptor())  # the producer never adds it

    def warnings() -> int:
        return sum("ignoring staged read requests" in r.getMessage() for r in caplog.records)

    def pump() -> None:
        producer.progress()
        assert not stranger.poll("p").done

    with caplog.at_level(logging.WARNING, logger="p2pkv.nixl.transport"):
        tid = stranger.read_blocks("p", [0], [0])
        # the request arrives when it arrives on a busy host: wait for its warning, then
        # progress on (a repeated request would warn again)
        wait_until(warnings, timeout=15.0, what="the stranger's request", pumps=[pump])
        for _ in range(200):
            pump()
    assert not _serving(producer)
    assert warnings() == 1
    stranger.cancel([tid])
    assert stranger.staging_usage()["quarantined"] == 1  # never answered: stays quarantined
    assert producer.close() == []  # its agent goes: the stranger's probe sees a disconnect
    wait_until(
        lambda: stranger.staging_usage()["quarantined"] == 0,
        timeout=15.0,
        what="the probe to see the producer gone",
        pumps=[stranger.progress],
    )
    assert stranger.close() == []
