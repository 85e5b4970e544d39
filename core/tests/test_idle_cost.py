"""A quiet tier's work per engine step does not grow with its sessions (issue 48, item 1).

One tier (memory transports) with S ready, quiet sessions: S hand-driven peers, each its own
memory control transport, handshaken and then silent. The work of one engine step (a tick,
``get_finished_jobs``, ``has_pending_work``, ``needs_engine``, ``on_schedule_end``,
``serve_lookups`` and ``stats``) is counted as Python calls (``sys.setprofile``: calls of
Python functions and of C functions), never timed. Stated bound: with 1,000 sessions a step
makes at most :data:`FACTOR` times the calls it makes with 10 (measured: the same count).
Half of each tier's sessions are dialed by it, half by the peers, so idle-reaper timers and
inbound sessions both take part.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import Any

import pytest
from p2pkv.contracts import ControlSettings, DataSettings
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR, Hello, HelloAck, decode, encode
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.types import LocalHitSource

FACTOR = 1.1
"""A step with 1,000 quiet sessions makes at most this many times the calls of one with 10."""
STEPS = 50


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


class QuietPeer:
    """A peer that completes the handshake with ``node`` and then says nothing."""

    def __init__(self, node: Any, data: MemoryDataTransport) -> None:
        self.ctl = MemoryControlTransport.create(ControlSettings("127.0.0.1", 0))
        self.node = node
        self.data = data
        self.conn: Any = None

    def dial(self) -> None:
        """Dial ``node`` and send our hello."""
        self.conn = self.ctl.connect(self.node.address)
        self.conn.send(self._hello())

    def answer(self) -> None:
        """Take the connection ``node`` dialed (or ours), answer its hello."""
        for conn in self.ctl.poll():
            self.conn = conn
            conn.send(self._hello())
        for frame in self.conn.recv():
            msg = decode(frame, self.node.tier._config.limits)
            if isinstance(msg, Hello):
                self.conn.send(encode(HelloAck(msg.epoch)))

    def _hello(self) -> bytes:
        data = self.data
        return encode(
            Hello(
                (WIRE_MAJOR, WIRE_MINOR),
                7,
                self.ctl.local_address,
                data.descriptor(),
                data.num_blocks,
                data.block_len,
                "",
                "",
            )
        )

    def close(self) -> None:
        self.ctl.close()


class NoHits(LocalHitSource):
    """A hit source with nothing cached (no lookup ever reaches it in a quiet tier)."""

    def begin(self, kv_request_id: str) -> object:
        return kv_request_id

    def lookup(self, handle: object, key: bytes) -> Any:
        raise AssertionError("a quiet tier has no lookup to serve")

    def pin(self, handle: object, keys: Sequence[bytes]) -> Any:
        raise AssertionError("a quiet tier has no lookup to serve")

    def end(self, handle: object) -> None:
        pass


def quiet_tier(h: Any, cluster: Any, sessions: int) -> Iterator[Any]:
    node = cluster(peers={"max_dialed": 2 * sessions})
    region = bytearray(node.data.num_blocks * node.data.block_len)
    data = MemoryDataTransport.create(DataSettings(memoryview(region), node.data.block_len))
    peers = [QuietPeer(node, data) for _ in range(sessions)]
    try:
        for i, peer in enumerate(peers):
            if i % 2:
                peer.dial()
            else:
                node.tier.connect(peer.ctl.local_address)
        for _ in range(4):
            node.tier.tick()
            for peer in peers:
                peer.answer()
        h.pump_until([node], lambda: node.tier.stats()["sessions_ready"] == sessions)
        yield node
    finally:
        for peer in peers:
            peer.close()
        data.close()


def engine_step(tier: Any, source: LocalHitSource) -> None:
    tier.tick()
    assert tier.get_finished_jobs() == []
    assert not tier.has_pending_work()
    assert not tier.needs_engine()
    tier.on_schedule_end()
    tier.serve_lookups(source)
    tier.stats()


def calls(work: Callable[[], object]) -> int:
    """Python calls (and C calls) ``work`` makes."""
    made = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal made
        if event in ("call", "c_call"):
            made += 1

    sys.setprofile(count)
    try:
        work()
    finally:
        sys.setprofile(None)
    return made


def calls_per_step(tier: Any) -> float:
    source = NoHits()
    for _ in range(3):  # what the first steps learn (sessions seen idle) is not the steady state
        engine_step(tier, source)

    def steps() -> None:
        for _ in range(STEPS):
            engine_step(tier, source)

    return calls(steps) / STEPS


def test_a_quiet_step_costs_the_same_with_1000_sessions_as_with_10(h: Any, cluster: Any) -> None:
    costs = {}
    for sessions in (10, 1000):
        for node in quiet_tier(h, cluster, sessions):
            costs[sessions] = calls_per_step(node.tier)
    assert costs[1000] <= FACTOR * costs[10], costs
