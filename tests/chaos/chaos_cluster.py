"""The parent side of the chaos suite: nodes in child processes and a router that plays the
PD proxy between them, recording when every half of every request ended and how.

``Cluster`` owns the nodes (always killed on exit), multiplexes their pipes and routes their
events to a ``Flow``: per request, the producer half (``stored`` event) and the consumer half
(``loaded``), each with the child's timestamp. Every wait is bounded; a timeout raises an
``AssertionError`` that lists what was still outstanding.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import wait
from typing import Any

import psutil
from chaos_node import NodeSpec, Recorded, node_main
from p2pkv.demo.roles import Evicted, Loaded, Stored, Submitted
from p2pkv.demo.workload import DemoRequest, PromptDistribution, make_stream
from p2pkv.testing.child import Child

__all__ = [
    "HEARTBEAT", "MEASUREMENTS", "Cluster", "Flow", "Node", "Outstanding", "Stream", "Usage",
    "admit_held", "all_done", "live_writes", "measured", "not_done", "region_blocks", "requests",
    "stall_writes", "tier_config",
]

START_TIMEOUT = 60.0  # a node loads NIXL/UCX on a busy 2-core machine

MEASUREMENTS: list[str] = []
"""What the scenarios measured (timings, counts), printed in pytest's terminal summary."""


def measured(line: str) -> None:
    """Record one line of measurements for the terminal summary."""
    MEASUREMENTS.append(line)

HEARTBEAT = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "heartbeat_ttl": 1.0,
             "connect_timeout": 2.0}
"""Short control-plane heartbeats: a silent peer is dead about a second after it fell silent."""


def tier_config(host: str = "127.0.0.1", *, port: int = 0,
                timeouts: dict[str, float] | None = None, control: dict[str, Any] | None = None,
                data: dict[str, Any] | None = None, limits: dict[str, int] | None = None,
                data_transport: str = "nixl") -> dict[str, Any]:
    """A zmq + nixl (or ``data_transport``) tier config with short heartbeats (ephemeral port
    unless given)."""
    return {
        "control": "zmq", "data": data_transport, "host": host, "port": port,
        "control_options": {**HEARTBEAT, **(control or {})},
        "data_options": {"drain_timeout": 2.0, **(data or {})},
        "timeouts": {"shutdown_drain": 3.0, **(timeouts or {})},
        "limits": dict(limits or {}),
    }


def requests(count: int, *, max_blocks: int, orders: dict[str, float], run_id: str,
             first_index: int = 0, seed: int = 0) -> list[DemoRequest]:
    """``count`` requests of 1..``max_blocks`` blocks with unique ids and indexes."""
    stream = make_stream(count, PromptDistribution("uniform", 1, max_blocks * 16 + 15),
                         tokens_per_block=16, max_blocks=max_blocks, orders=orders,
                         seed=seed, run_id=run_id)
    return [replace(r, index=r.index + first_index) for r in stream]


class Outstanding(AssertionError):
    """A bounded wait expired; the message lists what was still outstanding."""


@dataclass(frozen=True)
class Usage:
    """A process's resource use (psutil)."""

    rss: int
    fds: int
    threads: int

    @classmethod
    def of(cls, pid: int) -> Usage:
        p = psutil.Process(pid)
        return cls(p.memory_info().rss, p.num_fds(), p.num_threads())


class Node:
    """A chaos node (``chaos_node.node_main``) in a spawned child."""

    def __init__(self, name: str, spec: NodeSpec) -> None:
        self.name = name
        self.spec = spec
        self.child = Child(node_main, spec, name=f"chaos-{name}")
        self.address = ""
        self.pid = 0
        self.gone_at: float | None = None
        """When the pipe closed (the process ended), by the parent's clock."""
        self.killed_at: float | None = None
        self.replies: list[tuple[Any, ...]] = []
        self.data_log: list[tuple[Any, ...]] = []
        """Recorder entries streamed by a recording node."""
        self.fatal: list[str] = []

    @property
    def conn(self) -> Any:
        return self.child._conn  # the parent's end: multiplexed with the other nodes' pipes

    @property
    def alive(self) -> bool:
        return self.gone_at is None

    def start(self) -> Node:
        self.child.start()
        return self

    def ready(self) -> Node:
        """Wait for the node's ready message (its address and pid)."""
        msg = self.child.recv(START_TIMEOUT, f"{self.name}'s ready message")
        if msg[0] != "ready":
            raise AssertionError(f"{self.name} did not start: {msg}")
        self.address, self.pid = msg[1], msg[2]
        return self

    def send(self, cmd: tuple[Any, ...]) -> bool:
        """Send a command; False if the node is gone."""
        if not self.alive:
            return False
        try:
            self.child.send(cmd)
        except (BrokenPipeError, OSError):
            self.gone_at = time.monotonic()
            return False
        return True

    def kill(self) -> float:
        """SIGKILL the node; returns the time just before the signal."""
        self.killed_at = time.monotonic()
        self.child.kill()
        return self.killed_at

    def usage(self) -> Usage:
        return Usage.of(self.pid)


@dataclass(eq=False)
class Req:
    """One request and what happened to each of its halves (child timestamps)."""

    req: DemoRequest
    producer: Node
    consumer: Node
    admitted: float
    loaded: list[Loaded] = field(default_factory=list)
    stored: list[tuple[float, Stored]] = field(default_factory=list)
    """Store results with the time the node sent them."""
    evicted: bool = False
    undeliverable: list[str] = field(default_factory=list)
    """Commands the router could not deliver (their node was gone)."""

    @property
    def load_outcome(self) -> str | None:
        return self.loaded[0].outcome if self.loaded else None

    @property
    def store_outcome(self) -> str | None:
        return self.stored[0][1].outcome if self.stored else None

    @property
    def finished(self) -> bool:
        """Both halves ended (symmetric: loaded and evicted)."""
        if not self.loaded:
            return False
        return self.evicted if self.req.order == "symmetric" else bool(self.stored)

    def describe(self) -> str:
        load = self.loaded[0] if self.loaded else None
        store = self.stored[0][1] if self.stored else None
        return (f"#{self.req.index} {self.req.kv_request_id} {self.req.order} "
                f"{self.producer.name}->{self.consumer.name}: "
                f"load={load.outcome + ' ' + load.detail if load else None} "
                f"store={store.outcome + ' ' + store.detail if store else None} "
                f"evicted={self.evicted} undelivered={self.undeliverable}")


class Flow:
    """Routes each request's halves between its producer and consumer (as the PD proxy does)
    and records the results."""

    def __init__(self) -> None:
        self.reqs: dict[int, Req] = {}
        self.hold_stores = False
        """Keep the store half of consumer-first requests until ``release_stores``."""
        self.held: list[Req] = []
        self.hold_loads = False
        """Never send the load half of producer-first requests (a consumer that never asks)."""

    def admit(self, reqs: Iterable[DemoRequest], producer: Node, consumer: Node) -> list[Req]:
        """Start requests (one pipe message per node)."""
        to: dict[Node, list[tuple[Any, ...]]] = {producer: [], consumer: []}
        recs = []
        for req in reqs:
            rec = self.reqs[req.index] = Req(req, producer, consumer, time.monotonic())
            recs.append(rec)
            if req.order == "consumer_first":
                to[consumer].append(("load", req, producer.address))
            elif req.order == "producer_first":
                to[producer].append(("store", req))
            else:
                to[producer].append(("cache", req))
        for node, cmds in to.items():
            if cmds and not node.send(("batch", cmds)):
                for cmd in cmds:
                    self.reqs[cmd[1].index].undeliverable.append(f"{cmd[0]} to {node.name}")
        return recs

    def release_stores(self, which: Callable[[Req], bool] = lambda r: True) -> list[Req]:
        """Send the held stores of the requests ``which`` selects to their producers."""
        out = [r for r in self.held if which(r)]
        self.held = [r for r in self.held if not which(r)]
        by_node: dict[Node, list[tuple[Any, ...]]] = {}
        for rec in out:
            by_node.setdefault(rec.producer, []).append(("store", rec.req))
        for node, cmds in by_node.items():
            if not node.send(("batch", cmds)):
                for cmd in cmds:
                    self.reqs[cmd[1].index].undeliverable.append(f"store to {node.name}")
        return out

    def _send(self, rec: Req, node: Node, cmd: tuple[Any, ...]) -> None:
        if not node.send(cmd):
            rec.undeliverable.append(f"{cmd[0]} to {node.name}")

    def on_event(self, node: Node, t: float, ev: Any) -> None:
        if isinstance(ev, Recorded):
            node.data_log.append(ev.entry)
            return
        rec = self.reqs.get(ev.index)
        if rec is None:
            return
        req = rec.req
        if isinstance(ev, Submitted):
            if node is rec.consumer and req.order == "consumer_first":
                if self.hold_stores:
                    self.held.append(rec)
                else:
                    self._send(rec, rec.producer, ("store", req))
            elif node is rec.producer and req.order == "producer_first":
                if not self.hold_loads:
                    self._send(rec, rec.consumer, ("load", req, rec.producer.address))
            elif node is rec.producer and req.order == "symmetric":
                self._send(rec, rec.consumer, ("probe", req, rec.producer.address))
        elif isinstance(ev, Stored):
            rec.stored.append((t, ev))
        elif isinstance(ev, Loaded):
            rec.loaded.append(ev)
            if req.order == "symmetric":
                self._send(rec, rec.producer, ("evict", req))
        elif isinstance(ev, Evicted):
            rec.evicted = True

    def outstanding(self, recs: Iterable[Req] | None = None, limit: int = 20) -> str:
        """The unfinished requests (of ``recs``, default all), described."""
        open_ = [r for r in (self.reqs.values() if recs is None else recs) if not r.finished]
        lines = [r.describe() for r in open_[:limit]]
        more = f"\n  ... and {len(open_) - limit} more" if len(open_) > limit else ""
        return f"{len(open_)} request(s) unfinished:\n  " + "\n  ".join(lines) + more

    def problems(self, recs: Iterable[Req] | None = None) -> list[str]:
        """Wrong bytes, wrong block counts, or a half that ended more than once."""
        out = []
        for r in self.reqs.values() if recs is None else recs:
            if len(r.loaded) > 1 or len(r.stored) > 1:
                out.append(f"reported twice: {r.describe()}")
            for ev in r.loaded:
                if ev.bad_blocks:
                    out.append(f"{ev.bad_blocks} of {ev.blocks} blocks had wrong bytes: "
                               f"{r.describe()}")
                if ev.outcome == "done" and ev.blocks != r.req.hits:
                    out.append(f"loaded {ev.blocks} blocks, expected {r.req.hits}: "
                               f"{r.describe()}")
        return out


class Stream:
    """Keeps up to ``window`` of ``reqs`` in flight between ``producer`` and ``consumer``,
    admitting more (in one pipe message per node) as earlier ones finish."""

    def __init__(self, cluster: Cluster, reqs: Iterable[DemoRequest], producer: Node,
                 consumer: Node, window: int) -> None:
        self.cluster = cluster
        self.pending = list(reqs)[::-1]  # popped from the end: first request first
        self.producer = producer
        self.consumer = consumer
        self.window = window
        self.active: list[Req] = []
        self.admitted: list[Req] = []

    def step(self, timeout: float = 0.0) -> bool:
        """Route events (waiting at most ``timeout``), top the window up; True when every
        request finished."""
        self.cluster.pump(timeout)
        self.active = [r for r in self.active if not r.finished]
        room = min(self.window - len(self.active), len(self.pending))
        if room > 0:
            batch = [self.pending.pop() for _ in range(room)]
            recs = self.cluster.flow.admit(batch, self.producer, self.consumer)
            self.active.extend(recs)
            self.admitted.extend(recs)
        return not self.pending and not self.active

    @property
    def finished(self) -> int:
        return len(self.admitted) - len(self.active)

    def run(self, timeout: float, what: str) -> None:
        """Step until every request finished; ``Outstanding`` after ``timeout`` seconds."""
        self.cluster.wait(lambda: self.step(0.01), timeout=timeout, what=what,
                          recs=self.active)


class Cluster:
    """Nodes and the flow between them. Use ``with Cluster() as c:``; every node is stopped
    (killed if need be) on exit."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.flow = Flow()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        for node in self.nodes:
            node.child.stop(timeout=5.0)

    def start(self, *specs: tuple[str, NodeSpec]) -> list[Node]:
        """Start nodes (in parallel) and wait until each is ready."""
        nodes = [Node(name, spec) for name, spec in specs]
        self.nodes.extend(nodes)
        for node in nodes:
            node.start()
        return [node.ready() for node in nodes]

    # -- pumping --------------------------------------------------------------------------

    def pump(self, timeout: float = 0.05) -> int:
        """Handle what the nodes sent, waiting at most ``timeout`` for the first message;
        returns the number of messages handled."""
        live = {n.conn: n for n in self.nodes if n.alive}
        if not live:
            return 0
        handled = 0
        for conn in wait(list(live), timeout=timeout):
            node = live[conn]
            try:
                while conn.poll(0):
                    self._handle(node, conn.recv())
                    handled += 1
            except (EOFError, OSError):
                node.gone_at = time.monotonic()
        return handled

    def _handle(self, node: Node, msg: tuple[Any, ...]) -> None:
        kind = msg[0]
        if kind == "events":
            t = msg[1]
            for ev in msg[2]:
                self.flow.on_event(node, t, ev)
        elif kind == "fatal":
            node.fatal.append(str(msg[1]))
        else:
            node.replies.append(msg)

    def wait(self, condition: Callable[[], object], *, timeout: float, what: str,
             recs: Iterable[Req] | None = None) -> None:
        """Pump until ``condition()`` holds; ``Outstanding`` after ``timeout`` seconds, listing
        the unfinished requests of ``recs`` (default: all)."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline or any(n.fatal for n in self.nodes):
                raise Outstanding(f"{what}: not reached within {timeout}s; "
                                  f"{self.flow.outstanding(recs)}{self._fatal()}")
            self.pump(0.02)

    def _fatal(self) -> str:
        lines = [f"{n.name}: {f}" for n in self.nodes for f in n.fatal]
        return ("\nnode failures:\n  " + "\n  ".join(lines)) if lines else ""

    def reply(self, node: Node, cmd: tuple[Any, ...], kind: str, timeout: float) -> Any:
        """Send ``cmd`` and pump until ``node`` answers with ``kind``; returns its payload."""
        node.replies.clear()
        if not node.send(cmd):
            raise AssertionError(f"{node.name} is gone; cannot send {cmd[0]}")
        self.wait(lambda: any(r[0] == kind for r in node.replies) or not node.alive,
                  timeout=timeout, what=f"{node.name} answering {cmd[0]}")
        for r in node.replies:
            if r[0] == kind:
                return r[2]
        raise AssertionError(f"{node.name} died before answering {cmd[0]}{self._fatal()}")

    def report(self, node: Node, timeout: float = 10.0) -> dict[str, Any]:
        rep: dict[str, Any] = self.reply(node, ("report",), "report", timeout)
        return rep

    def live_rss(self, node: Node, timeout: float = 10.0) -> int:
        """The node's RSS after GC and ``malloc_trim`` (``chaos_node.live_rss``)."""
        return int(self.reply(node, ("memory",), "memory", timeout))

    def stop(self, node: Node, timeout: float = 30.0,
             on_stopping: Callable[[], object] = lambda: None) -> dict[str, Any]:
        """Shut the node's tier down (its leftovers arrive as ordinary events) and end it.
        ``on_stopping`` runs as soon as the node says its shutdown is starting."""
        self.reply(node, ("stop",), "stopping", timeout)
        on_stopping()
        self.wait(lambda: any(r[0] == "stopped" for r in node.replies) or not node.alive,
                  timeout=timeout, what=f"{node.name} shutting down")
        stopped = [r for r in node.replies if r[0] == "stopped"]
        if not stopped:
            raise AssertionError(f"{node.name} died while shutting down{self._fatal()}")
        rep: dict[str, Any] = stopped[0][2]
        node.child.process.join(timeout)
        node.gone_at = node.gone_at or time.monotonic()
        return rep

    def settle(self, nodes: Sequence[Node], *, timeout: float, what: str) -> list[dict[str, Any]]:
        """Wait until every node reports no pending work and every per-request structure
        empty; returns the last reports."""
        reports: list[dict[str, Any]] = []

        def quiet() -> bool:
            nonlocal reports
            reports = [self.report(n) for n in nodes]
            return all(not r["pending_work"] and not any(r["state_sizes"].values())
                       for r in reports)

        deadline = time.monotonic() + timeout
        while not quiet():
            if time.monotonic() > deadline:
                leftover = {n.name: {k: v for k, v in r["state_sizes"].items() if v}
                            for n, r in zip(nodes, reports, strict=True)}
                raise Outstanding(f"{what}: state left after {timeout}s: {leftover}")
            self.pump(0.05)
        return reports




def region_blocks(reqs: Iterable[DemoRequest]) -> int:
    """Slots a region needs to hold all of ``reqs`` at once."""
    return sum(r.num_blocks for r in reqs)


def all_done(recs: Iterable[Req]) -> bool:
    """Every load and every store (symmetric requests: no store half) ended DONE."""
    return all(r.load_outcome == "done" and (r.req.order == "symmetric"
               or r.store_outcome == "done") for r in recs)


def not_done(recs: Iterable[Req]) -> list[str]:
    return [r.describe() for r in recs if not all_done([r])]


def live_writes(node: Node, to: str | None = None) -> set[int]:
    """Writes a recording ``node`` reported posted (to ``to``) and not yet ended."""
    live: set[int] = set()
    for e in node.data_log:
        if e[1] == "write" and (to is None or e[3] == to):
            live.add(e[2])
        elif e[1] in ("end", "cancel"):
            live.discard(e[2])
    return live


def admit_held(c: Cluster, groups: Sequence[tuple[Sequence[DemoRequest], Node, Node]], *,
               warm: int, timeout: float) -> list[list[Req]]:
    """Admit consumer-first requests (one group per producer/consumer pair) with their store
    halves held until every load is submitted, then release the first ``warm`` of each group and
    wait until those are done: sessions up, data endpoints wired. The rest stay held (for
    ``stall_writes`` or ``Flow.release_stores``). Returns each group's records."""
    c.flow.hold_stores = True
    recs = [c.flow.admit(reqs, producer, consumer) for reqs, producer, consumer in groups]
    total = sum(len(r) for r in recs)
    c.wait(lambda: len(c.flow.held) >= total, timeout=timeout, what=f"{total} loads submitted")
    first = [r for group in recs for r in group[:warm]]
    chosen = {id(r) for r in first}
    c.flow.release_stores(lambda r: id(r) in chosen)
    c.wait(lambda: all_done(first), timeout=timeout,
           what=f"the first {warm} requests of each group", recs=first)
    return recs


def stall_writes(c: Cluster, writer: Node, target: Node, release: Iterable[Req],
                 timeout: float) -> set[int]:
    """Pause ``target``, release the held stores of ``release``, and return once the
    (recording) ``writer`` reports writes into ``target`` in flight. With UCX on TCP a write
    needs its target's progress to complete, so they stay in flight until the caller resumes
    (or kills) ``target``; keep ``timeout`` below the heartbeat timeout."""
    target.child.pause()
    wanted = {id(r) for r in release}
    c.flow.hold_stores = False
    c.flow.release_stores(lambda r: id(r) in wanted)
    c.wait(lambda: live_writes(writer, target.address), timeout=timeout,
           what=f"{writer.name} writing into paused {target.name}")
    return live_writes(writer, target.address)
