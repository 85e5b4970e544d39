"""A harness for tier tests: tiers over the reference memory transports on one fake clock.

:class:`Node` is one :class:`~p2pkv.tier.P2PTier` with its own region (numpy view
``blocks``), over the reference backend's memory transports, optionally wrapped by a
:class:`~p2pkv.reference.faults.FaultInjector`. ``Node.collect`` gathers results and fails
the test on a duplicate or unknown job id (exactly once). :class:`Cluster` makes nodes on one
:class:`~p2pkv.testing.tier_machine.FakeClock`. :class:`RawPeer` is a peer driven by hand,
frame by frame. The functions pump the nodes until a condition holds, within a bound.

Everything runs in this process: no thread, no socket, no sleep. A test of a real transport
uses :class:`~p2pkv.testing.tier_machine.TierNode` with that transport instead.

Usage::

    from p2pkv.testing.harness import Cluster, keys, pump

    cluster = Cluster()
    producer, consumer = cluster(), cluster()
    ...
    cluster.close()
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

from p2pkv.config import Limits, TierConfig
from p2pkv.contracts import ControlSettings, DataSettings, DataTransport
from p2pkv.hookspecs import PLUGIN_API_VERSION, hookimpl
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR, Hello, Message, Unknown, decode, encode
from p2pkv.reference.control import MemoryConnection, MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.reference.faults import FaultInjector
from p2pkv.registry import Registry
from p2pkv.testing.tier_machine import FakeClock, TierNode
from p2pkv.types import LookupResult, RequestContext

__all__ = [
    "REGISTRY",
    "Cluster",
    "Node",
    "RawPeer",
    "advance",
    "assert_clean",
    "config",
    "keys",
    "probe_until",
    "pump",
    "pump_until",
]


class _ReferencePlugin:
    """The reference memory transports as an in-process plugin named ``memory``."""

    P2PKV_PLUGIN_API = PLUGIN_API_VERSION

    @staticmethod
    @hookimpl
    def p2pkv_transports() -> list[type[Any]]:
        return [MemoryControlTransport, MemoryDataTransport]


REGISTRY = Registry.from_plugins([("memory", _ReferencePlugin)])
"""A registry that knows the reference transports as ``memory`` (and no entry point)."""


def config(**overrides: Any) -> TierConfig:
    """A tier config over the memory transports on loopback; ``overrides`` are config keys."""
    d: dict[str, Any] = {"control": "memory", "data": "memory", "host": "127.0.0.1", "port": 0}
    d.update(overrides)
    return TierConfig.from_dict(d)


class Node(TierNode):
    """One tier over the memory transports (optionally fault-injected), its region and the
    results it reported (see :class:`~p2pkv.testing.tier_machine.TierNode`).
    ``config_overrides`` are tier config keys (``timeouts``, ``limits``, ``flow``, ...)."""

    def __init__(
        self,
        clock: FakeClock,
        *,
        faults: FaultInjector | None = None,
        num_blocks: int = 64,
        block_len: int = 16,
        data_options: Mapping[str, Any] | None = None,
        seed: int = 0,
        port: int = 0,
        **config_overrides: Any,
    ) -> None:
        super().__init__(
            clock,
            control=MemoryControlTransport,
            data=MemoryDataTransport,
            data_options=data_options,
            faults=faults,
            num_blocks=num_blocks,
            block_len=block_len,
            seed=seed,
            port=port,
            registry=REGISTRY,
            **config_overrides,
        )
        self.limits: Limits = config(**config_overrides).limits
        """The limits this node's tier runs with."""


class Cluster:
    """Makes nodes on one fake clock (``cluster(**node_kwargs)``); ``close`` shuts them
    down. Node seeds default to their index, so regions differ."""

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
    """A peer of ``node`` driven by hand: a bare memory control connection and a region.

    A context manager: ``with RawPeer(node) as peer:`` closes both transports after."""

    def __init__(self, node: Node) -> None:
        self.node = node
        self.ctl = MemoryControlTransport.create(ControlSettings("127.0.0.1", 0))
        self.conn: MemoryConnection = self.ctl.connect(node.address)
        self.data: DataTransport = MemoryDataTransport.create(
            DataSettings(memoryview(bytearray(64 * 16)), 16)
        )

    def __enter__(self) -> RawPeer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.ctl.close()
        self.data.close()

    def hello(self, address: str = "", epoch: int = 1) -> Hello:
        """A hello that ``node`` accepts (from ``address``: this peer's own by default)."""
        return Hello(
            (WIRE_MAJOR, WIRE_MINOR),
            epoch,
            address or self.ctl.local_address,
            self.data.descriptor(),
            self.data.num_blocks,
            self.data.block_len,
            "",
            "",
        )

    def send(self, *msgs: Message | bytes) -> list[Message | Unknown]:
        """Send messages (or raw frames), let the node answer; returns what it sent back."""
        for m in msgs:
            self.conn.send(m if isinstance(m, bytes) else encode(m))
        pump([self.node], 2)
        self.ctl.poll()
        return [decode(f, self.node.limits) for f in self.conn.recv()]


def pump(nodes: Iterable[TierNode], rounds: int = 6) -> None:
    """Tick every node ``rounds`` times, collecting results."""
    nodes = list(nodes)
    for _ in range(rounds):
        for n in nodes:
            n.collect()


def pump_until(nodes: Iterable[TierNode], cond: Callable[[], object], rounds: int = 50) -> None:
    """Tick until ``cond()`` holds; fails the test after ``rounds`` passes."""
    nodes = list(nodes)
    for _ in range(rounds):
        if cond():
            return
        for n in nodes:
            n.collect()
    assert cond(), "condition not reached within the pump budget"


def advance(clock: FakeClock, nodes: Iterable[TierNode], seconds: float, rounds: int = 4) -> None:
    """Move the clock ``seconds`` on, then pump ``rounds`` times."""
    clock.advance(seconds)
    pump(nodes, rounds)


def keys(kv: str, n: int, start: int = 0) -> list[bytes]:
    """``n`` distinct block keys of request ``kv``."""
    return [f"{kv}/{i}".encode() for i in range(start, start + n)]


def probe_until(
    node: TierNode, key: bytes, ctx: RequestContext, others: Iterable[TierNode], rounds: int = 10
) -> LookupResult:
    """Symmetric lookup: call, flush at schedule end, pump, until not RETRY."""
    others = list(others)
    for _ in range(rounds):
        res = node.tier.lookup(key, ctx)
        if res is not LookupResult.RETRY:
            return res
        node.tier.on_schedule_end()
        pump([node, *others], 2)
    return node.tier.lookup(key, ctx)


def assert_clean(*nodes: TierNode) -> None:
    """No per-request state is left (the tombstones of finished producers excepted, which
    expire by their deadline, and their timers)."""
    for n in nodes:
        sizes = n.tier.state_sizes()
        expiring = ("tombstones",)
        left = {k: v for k, v in sizes.items() if v and k not in (*expiring, "timers")}
        assert not left, f"{n.address}: state left behind: {left}"
        assert sizes["timers"] == sum(sizes[k] for k in expiring), sizes
