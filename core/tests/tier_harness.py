"""Test harness for P2PTier tests: tiers over the memory transports, a fake clock, helpers.

Importable by name (pytest's ``pythonpath``, root pyproject.toml); tests take it from the
``tier_harness`` fixture (core/tests/conftest.py).

``Node`` is one tier with its own region (numpy view ``blocks``) over a memory control and a
memory data transport, optionally wrapped by a :class:`FaultInjector`. ``Node.collect``
gathers results and fails the test on a duplicate or unknown job id (exactly-once).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import p2pkv_memory.plugin as memory_plugin
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, DataSettings
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR, Hello, decode, encode
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.reference.faults import FaultInjector
from p2pkv.registry import Registry
from p2pkv.testing.tier_machine import FakeClock, TierNode
from p2pkv.types import LookupResult, RequestContext

REGISTRY = Registry.from_plugins([("memory", memory_plugin)])


def config(**overrides: Any) -> TierConfig:
    d: dict[str, Any] = {"control": "memory", "data": "memory", "host": "127.0.0.1", "port": 0}
    d.update(overrides)
    return TierConfig.from_dict(d)


class Node(TierNode):
    """One tier over the memory transports (optionally fault-injected), its region and the
    results it reported (see :class:`p2pkv.testing.tier_machine.TierNode`)."""

    def __init__(self, clock: FakeClock, *, faults: FaultInjector | None = None,
                 num_blocks: int = 64, block_len: int = 16,
                 data_options: Mapping[str, Any] | None = None, seed: int = 0,
                 port: int = 0, **config_overrides: Any) -> None:
        super().__init__(clock, control=MemoryControlTransport, data=MemoryDataTransport,
                         data_options=data_options, faults=faults, num_blocks=num_blocks,
                         block_len=block_len, seed=seed, port=port, registry=REGISTRY,
                         **config_overrides)


class Cluster:
    """Makes nodes on one fake clock (``cluster(**node_kwargs)``); ``close`` shuts them down."""

    def __init__(self) -> None:
        self.clock = FakeClock()
        self.made: list[Node] = []

    def __call__(self, **kw: Any) -> Node:
        kw.setdefault("seed", len(self.made))
        node = Node(self.clock, **kw)
        self.made.append(node)
        return node

    def close(self) -> None:
        for node in self.made:
            node.shutdown()


class RawPeer:
    """A hand-driven peer of ``node``: a bare memory control connection and data region."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.ctl = MemoryControlTransport.create(ControlSettings("127.0.0.1", 0))
        self.conn = self.ctl.connect(node.address)
        self.data = MemoryDataTransport.create(DataSettings(memoryview(bytearray(64 * 16)), 16))

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctl.close()
        self.data.close()

    def hello(self, address: str = "", epoch: int = 1) -> Hello:
        return Hello((WIRE_MAJOR, WIRE_MINOR), epoch, address or self.ctl.local_address,
                     self.data.descriptor(), self.data.num_blocks, self.data.block_len, "", "")

    def send(self, *msgs: Any) -> list[Any]:
        """Send messages, let the node answer; returns what it sent back."""
        for m in msgs:
            self.conn.send(m if isinstance(m, bytes) else encode(m))
        pump([self.node], 2)
        self.ctl.poll()
        return [decode(f, self.node.tier._config.limits) for f in self.conn.recv()]


def pump(nodes: Iterable[Node], rounds: int = 6) -> None:
    """Tick every node ``rounds`` times, collecting results."""
    nodes = list(nodes)
    for _ in range(rounds):
        for n in nodes:
            n.collect()


def pump_until(nodes: Iterable[Node], cond: Any, rounds: int = 50) -> None:
    """Tick until ``cond()`` holds; fails the test after ``rounds`` passes."""
    nodes = list(nodes)
    for _ in range(rounds):
        if cond():
            return
        for n in nodes:
            n.collect()
    assert cond(), "condition not reached within the pump budget"


def advance(clock: FakeClock, nodes: Iterable[Node], seconds: float, rounds: int = 4) -> None:
    clock.advance(seconds)
    pump(nodes, rounds)


def keys(kv: str, n: int, start: int = 0) -> list[bytes]:
    return [f"{kv}/{i}".encode() for i in range(start, start + n)]


def probe_until(node: Node, key: bytes, ctx: RequestContext, others: Iterable[Node],
                rounds: int = 10) -> LookupResult:
    """Symmetric lookup: call, flush at schedule end, pump, until not RETRY."""
    others = list(others)
    for _ in range(rounds):
        res = node.tier.lookup(key, ctx)
        if res is not LookupResult.RETRY:
            return res
        node.tier.on_schedule_end()
        pump([node, *others], 2)
    return node.tier.lookup(key, ctx)


def assert_clean(*nodes: Node) -> None:
    """No per-request state left (tombstones of finished producers, which expire by their
    deadline, and their timers excepted)."""
    for n in nodes:
        sizes = n.tier.state_sizes()
        expiring = ("tombstones",)
        left = {k: v for k, v in sizes.items() if v and k not in (*expiring, "timers")}
        assert not left, f"{n.address}: state left behind: {left}"
        assert sizes["timers"] == sum(sizes[k] for k in expiring), sizes
