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
from multiprocessing.connection import Connection, wait
from typing import Any

import psutil
from chaos_node import Again, NodeSpec, Recorded, node_main
from p2pkv.testing.child import Child, stop_all
from p2pkv_tools.demo.roles import Evicted, Loaded, Stored, Submitted
from p2pkv_tools.demo.workload import DemoRequest, PromptDistribution, make_stream

__all__ = [
    "HEARTBEAT",
    "MEASUREMENTS",
    "Cluster",
    "Flow",
    "Node",
    "Outstanding",
    "Stream",
    "Usage",
    "admit_held",
    "all_done",
    "live_reads",
    "measured",
    "not_done",
    "region_blocks",
    "requests",
    "stall_reads",
    "tier_config",
]

START_TIMEOUT = 60.0  # a node loads NIXL/UCX on a busy 2-core machine

MEASUREMENTS: list[str] = []
"""What the scenarios measured (timings, counts), printed in pytest's terminal summary."""


def measured(line: str) -> None:
    """Record one line of measurements for the terminal summary."""
    MEASUREMENTS.append(line)


HEARTBEAT = {
    "heartbeat_interval": 0.2,
    "heartbeat_timeout": 1.0,
    "heartbeat_ttl": 1.0,
    "connect_timeout": 2.0,
}
"""Short control-plane heartbeats: a silent peer is dead about a second after it fell silent."""


def tier_config(
    host: str = "127.0.0.1",
    *,
    port: int = 0,
    timeouts: dict[str, float] | None = None,
    control: dict[str, Any] | None = None,
    data: dict[str, Any] | None = None,
    limits: dict[str, int] | None = None,
    data_transport: str = "nixl",
) -> dict[str, Any]:
    """A zmq + nixl (or ``data_transport``) tier config with short heartbeats (ephemeral port
    unless given)."""
    return {
        "control": "zmq",
        "data": data_transport,
        "host": host,
        "port": port,
        "control_options": {**HEARTBEAT, **(control or {})},
        "data_options": {"drain_timeout": 2.0, **(data or {})},
        "timeouts": {"shutdown_drain": 3.0, **(timeouts or {})},
        "limits": dict(limits or {}),
    }


def requests(
    count: int,
    *,
    max_blocks: int,
    orders: dict[str, float],
    run_id: str,
    first_index: int = 0,
    seed: int = 0,
) -> list[DemoRequest]:
    """``count`` requests of 1..``max_blocks`` blocks with unique ids and indexes."""
    stream = make_stream(
        count,
        PromptDistribution("uniform", 1, max_blocks * 16 + 15),
        tokens_per_block=16,
        max_blocks=max_blocks,
        orders=orders,
        seed=seed,
        run_id=run_id,
    )
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
        self.stopping = False
        """The harness asked the node to stop (its exit is expected)."""
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
            self.stopping = True  # it ended by itself, and said why
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

    def died(self) -> str | None:
        """How the node's process ended, if it did without being killed or stopped by us."""
        if self.killed_at is not None or self.stopping or self.child.process.is_alive():
            return None
        code = self.child.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit {code}"
        return f"{self.name} (pid {self.pid}) died unexpectedly: {how}"


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
    submitted: dict[str, float] = field(default_factory=dict)
    """Node name -> when it took its half (its ``Submitted`` event)."""
    again: list[Again] = field(default_factory=list)
    """Results of ``load_again`` commands (second loads of the same keys)."""

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
        return (
            f"#{self.req.index} {self.req.kv_request_id} {self.req.order} "
            f"{self.producer.name}->{self.consumer.name}: "
            f"load={load.outcome + ' ' + load.detail if load else None} "
            f"store={store.outcome + ' ' + store.detail if store else None} "
            f"evicted={self.evicted} undelivered={self.undeliverable}"
        )


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

    def send_loads(self, recs: Iterable[Req]) -> None:
        """Send the load halves of producer-first requests (kept back by ``hold_loads``)."""
        by_node: dict[Node, list[tuple[Any, ...]]] = {}
        for rec in recs:
            by_node.setdefault(rec.consumer, []).append(("load", rec.req, rec.producer.address))
        for node, cmds in by_node.items():
            if not node.send(("batch", cmds)):
                for cmd in cmds:
                    self.reqs[cmd[1].index].undeliverable.append(f"load to {node.name}")

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
        if isinstance(ev, Again):
            rec.again.append(ev)
        elif isinstance(ev, Submitted):
            rec.submitted[node.name] = ev.at
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
                    out.append(
                        f"{ev.bad_blocks} of {ev.blocks} blocks had wrong bytes: {r.describe()}"
                    )
                if ev.outcome == "done" and ev.blocks != r.req.hits:
                    out.append(f"loaded {ev.blocks} blocks, expected {r.req.hits}: {r.describe()}")
        return out


class Stream:
    """Keeps up to ``window`` of ``reqs`` in flight between ``producer`` and ``consumer``,
    admitting more (in one pipe message per node) as earlier ones finish."""

    def __init__(
        self,
        cluster: Cluster,
        reqs: Iterable[DemoRequest],
        producer: Node,
        consumer: Node,
        window: int,
    ) -> None:
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
        self.cluster.wait(lambda: self.step(0.01), timeout=timeout, what=what, recs=self.active)


class Cluster:
    """Nodes and the flow between them. Use ``with Cluster() as c:``; every node is stopped
    (killed if need be) on exit."""

    def __init__(self) -> None:
        self.nodes: list[Node] = []
        self.flow = Flow()

    def __enter__(self) -> Cluster:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_all([node.child for node in self.nodes], timeout=5.0)  # at once: 65 in fan-in

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
            assert isinstance(conn, Connection)
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

    def wait(
        self,
        condition: Callable[[], object],
        *,
        timeout: float,
        what: str,
        recs: Iterable[Req] | None = None,
    ) -> None:
        """Pump until ``condition()`` holds; ``Outstanding`` after ``timeout`` seconds, listing
        the unfinished requests of ``recs`` (default: all)."""
        started = time.monotonic()
        while not condition():
            waited = time.monotonic() - started
            if (
                waited > timeout
                or any(n.fatal for n in self.nodes)
                or any(n.died() for n in self.nodes)
            ):
                raise Outstanding(
                    f"{what}: not reached (waited {waited:.1f}s of {timeout}s); "
                    f"{self.flow.outstanding(recs)}{self._fatal()}"
                )
            self.pump(0.02)

    def _fatal(self) -> str:
        lines = [f"{n.name}: {f}" for n in self.nodes for f in n.fatal]
        lines += [d for n in self.nodes if (d := n.died())]
        return ("\nnode failures:\n  " + "\n  ".join(lines)) if lines else ""

    def reply(self, node: Node, cmd: tuple[Any, ...], kind: str, timeout: float) -> Any:
        """Send ``cmd`` and pump until ``node`` answers with ``kind``; returns its payload."""
        node.replies.clear()
        if not node.send(cmd):
            raise AssertionError(f"{node.name} is gone; cannot send {cmd[0]}")
        self.wait(
            lambda: any(r[0] == kind for r in node.replies) or not node.alive,
            timeout=timeout,
            what=f"{node.name} answering {cmd[0]}",
        )
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

    def canary(self, node: Node, op: str, timeout: float = 10.0) -> dict[str, Any]:
        """A canary op on ``node`` (``chaos_node``: failed, free, check, release)."""
        rep: dict[str, Any] = self.reply(node, ("canary", op), "canary", timeout)
        return rep

    def watch_canaries(
        self, nodes: Sequence[Node], seconds: float, *, step: Callable[[], object] = lambda: None
    ) -> int:
        """Check the canaries of ``nodes`` again and again for ``seconds`` while they keep
        ticking (``step`` runs between checks: routing, new requests); fails at the first
        changed byte. Returns how many checks were made."""
        checks = 0
        end = time.monotonic() + seconds
        while True:
            for node in nodes:
                rep = self.canary(node, "check")
                checks += 1
                assert not rep["changed"], (
                    f"{rep['changed_bytes']} canary byte(s) changed in {len(rep['changed'])} of "
                    f"{node.name}'s {rep['slots']} canaried slots ({rep['changed'][:10]}): a "
                    f"transfer wrote into slots its engine had been handed back"
                )
            if time.monotonic() >= end:
                return checks
            step()
            self.pump(0.05)

    def stop(
        self,
        node: Node,
        timeout: float = 30.0,
        on_stopping: Callable[[], object] = lambda: None,
        resume: Sequence[Node] = (),
    ) -> dict[str, Any]:
        """Shut the node's tier down (its leftovers arrive as ordinary events) and end it.
        ``resume``: paused nodes (``node`` among them, possibly) resumed right after the stop
        command went out, so a paused node shuts down with what was in flight when it
        stopped. ``on_stopping`` runs as soon as the node says its shutdown is starting."""
        node.replies.clear()
        node.stopping = True
        if not node.send(("stop",)):
            raise AssertionError(f"{node.name} is gone; cannot stop it")
        for other in resume:
            other.child.resume()
        self.wait(
            lambda: any(r[0] == "stopping" for r in node.replies) or not node.alive,
            timeout=timeout,
            what=f"{node.name} starting its shutdown",
        )
        on_stopping()
        self.wait(
            lambda: any(r[0] == "stopped" for r in node.replies) or not node.alive,
            timeout=timeout,
            what=f"{node.name} shutting down",
        )
        stopped = [r for r in node.replies if r[0] == "stopped"]
        if not stopped:
            node.child.process.join(timeout)
            code = node.child.process.exitcode
            raise AssertionError(
                f"{node.name} died while shutting down (exit code {code}){self._fatal()}"
            )
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
            return all(
                not r["pending_work"] and not any(r["state_sizes"].values()) for r in reports
            )

        deadline = time.monotonic() + timeout
        while not quiet():
            if time.monotonic() > deadline:
                leftover = {
                    n.name: {k: v for k, v in r["state_sizes"].items() if v}
                    for n, r in zip(nodes, reports, strict=True)
                }
                raise Outstanding(f"{what}: state left after {timeout}s: {leftover}")
            self.pump(0.05)
        return reports


def region_blocks(reqs: Iterable[DemoRequest]) -> int:
    """Slots a region needs to hold all of ``reqs`` at once."""
    return sum(r.num_blocks for r in reqs)


def all_done(recs: Iterable[Req]) -> bool:
    """Every load and every store (symmetric requests: no store half) ended DONE."""
    return all(
        r.load_outcome == "done" and (r.req.order == "symmetric" or r.store_outcome == "done")
        for r in recs
    )


def not_done(recs: Iterable[Req]) -> list[str]:
    return [r.describe() for r in recs if not all_done([r])]


def live_reads(node: Node, source: str | None = None) -> set[int]:
    """Reads a recording ``node`` reported posted (from ``source``) and not yet ended."""
    live: dict[int, str] = {}
    for e in node.data_log:
        op = e[1]
        if op == "read" and (source is None or e[3] == source):
            live[e[2]] = e[3]
        elif op in ("end", "cancel"):
            live.pop(e[2], None)
        elif op in ("remove_peer", "add_peer"):
            live = {t: p for t, p in live.items() if p != e[2]}
        elif op == "close":
            live.clear()
    return set(live)


def admit_held(
    c: Cluster,
    groups: Sequence[tuple[Sequence[DemoRequest], Node, Node]],
    *,
    warm: int,
    timeout: float,
) -> list[list[Req]]:
    """Admit consumer-first requests (one group per producer/consumer pair) with their store
    halves held until every load is submitted, then release the first ``warm`` of each group and
    wait until those are done: sessions up, data endpoints wired. The rest stay held (for
    ``stall_reads`` or ``Flow.release_stores``). Returns each group's records."""
    c.flow.hold_stores = True
    recs = [c.flow.admit(reqs, producer, consumer) for reqs, producer, consumer in groups]
    total = sum(len(r) for r in recs)
    c.wait(lambda: len(c.flow.held) >= total, timeout=timeout, what=f"{total} loads submitted")
    first = [r for group in recs for r in group[:warm]]
    chosen = {id(r) for r in first}
    c.flow.release_stores(lambda r: id(r) in chosen)
    c.wait(
        lambda: all_done(first),
        timeout=timeout,
        what=f"the first {warm} requests of each group",
        recs=first,
    )
    return recs


def stall_reads(
    c: Cluster, reader: Node, source: Node, release: Iterable[Req], timeout: float
) -> set[int]:
    """Release the held stores of ``release`` and have ``source`` paused (SIGSTOP) right after
    the (recording) ``reader`` posted reads from it for half of its own blocks: the reader
    itself stops it (``pause_on_read``), so the reads it posts next (offers already on their
    way), and the latest before, are still live. Returns the reads from ``source`` live once
    ``reader`` answered a report with ``source`` paused. With UCX on TCP (and always with the
    two-sided ucx transport) a read needs its source's progress, so they stay in flight until
    the caller resumes (or kills) ``source``; keep the pause below the heartbeat timeout.
    ``timeout`` bounds only a failure (the reader never read from ``source``): on success
    the reader has stopped ``source`` the moment it posted those reads."""
    release = list(release)
    wanted = {id(r) for r in release}
    ours = region_blocks([r.req for r in release if r.consumer is reader and r.producer is source])
    c.reply(
        reader,
        ("pause_on_read", source.pid, source.address, max(1, ours // 2)),
        "pause_on_read",
        timeout=10.0,
    )
    c.flow.hold_stores = False
    c.flow.release_stores(lambda r: id(r) in wanted)
    try:
        c.wait(
            lambda: any(e[1] == "paused_source" for e in reader.data_log),
            timeout=timeout,
            what=f"{reader.name} reading from {source.name}",
        )
    finally:
        source.child.pause()  # already stopped by the reader, or it never read: stop it now
    c.report(reader)  # every entry the reader logged before now has arrived
    return live_reads(reader, source.address)
