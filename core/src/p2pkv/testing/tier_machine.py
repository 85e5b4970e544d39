"""A transport-parameterised state machine over ``P2PTier``: the protocol's promises, on any
(control, data) transport pair.

Hypothesis drives two or three tiers through random interleavings of new requests (PD and
symmetric), **bursts** (up to twelve PD requests stored and loaded at once, against flow
windows drawn as small as one round or one block, so loads queue in the tier), stores, loads
in several rounds, request finishes, jumps of a fake clock past every timeout, and faults (a
killed session connection, a node restart, a node **frozen** — not ticked for a number of
engine steps while the others' steps and the shared clock go on, as a SIGSTOPped or stalled
peer that then resumes with stale state; with ``faults_enabled`` also dropped, delayed,
duplicated and reordered frames, failed submits and completions, and partitions, injected by
the reference backend's ``FaultInjector`` (:mod:`p2pkv.reference`) around the real
transports).
Invariants, checked after every step:

* every submitted job gets exactly one result, and no result names an unknown job;
* a successful load's slots hold exactly the producer's bytes for those keys;
* nothing is ever written outside demanded slots: a failed load's slot holds its old bytes
  or its key's bytes; the source half of every region never changes;
* **a result is final for the bytes**: like an engine, the model reuses every slot as soon as
  its load has a result, whatever the outcome (PEER_DEAD, LOAD_TIMEOUT, ...), and a slot
  never changes after its result until the model loads into it again — whatever the peer
  does later (frozen, resumed with stale state, restarted);
* at the end, once every request finished, faults healed and the tiers polled to quiescence,
  no per-request state remains and every job has its result.

Usage (``core/tests/test_stateful_tier.py`` runs it over the memory transports with faults,
``tests/conformance`` over zmq + nixl and zmq + ucx)::

    class ZmqNixlTiers(TierMachine):
        control_transport = ZmqControlTransport
        data_transport = NixlDataTransport


    def test_tiers():
        run_state_machine_as_test(ZmqNixlTiers)  # the kit's settings (p2pkv.testing.profiles)

The machine uses the tier's debug views (``peer_connection``, ``state_sizes``) to inject
connection kills and to check that nothing is left behind.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import Bundle, initialize, invariant

from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, ControlTransport, DataSettings, DataTransport
from p2pkv.data_base import allocated_region
from p2pkv.reference.faults import Fault, FaultInjector
from p2pkv.registry import Registry
from p2pkv.testing.machine import KitMachine
from p2pkv.testing.steps import step
from p2pkv.testing.waiting import WaitTimeout, quietly, wait_until
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext

__all__ = ["FakeClock", "TierMachine", "TierNode"]

_INJECTED = ("drop", "delay", "duplicate", "reorder", "fail_submit", "fail_completion")
"""The :class:`~p2pkv.reference.faults.Fault` values the fault rule arms."""


class FakeClock:
    """The tiers' clock: time moves only when a test says so."""

    def __init__(self, start: float = 1000.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


class TierNode:
    """One ``P2PTier`` over fresh instances of the given transports, its region (from the data
    transport's ``allocate_region``) and results.

    ``faults`` (a ``FaultInjector``) wraps both transports when given. ``blocks`` is a
    ``(num_blocks, block_len)`` numpy view of the region, filled from ``seed``. ``collect``
    gathers results and fails the test on a duplicate or unknown job id (exactly once).
    ``config_overrides`` are tier config keys (``timeouts``, ``limits``, ...).
    """

    # keyword-only knobs of a test node, each with a default: a dataclass would only rename them
    def __init__(  # noqa: PLR0913
        self,
        clock: FakeClock,
        *,
        control: type[ControlTransport],
        data: type[DataTransport],
        control_options: Mapping[str, Any] | None = None,
        data_options: Mapping[str, Any] | None = None,
        faults: FaultInjector | None = None,
        num_blocks: int = 64,
        block_len: int = 16,
        seed: int = 0,
        host: str = "127.0.0.1",
        port: int = 0,
        registry: Registry | None = None,
        **config_overrides: Any,
    ) -> None:
        self.clock = clock
        options = dict(data_options or {})
        self.region = allocated_region(data, num_blocks, block_len, options)
        self.blocks = np.frombuffer(self.region, dtype=np.uint8).reshape(num_blocks, block_len)
        self.blocks[:] = np.random.default_rng(seed).integers(0, 256, self.blocks.shape)
        cfg = TierConfig.from_dict(
            {
                "control": control.name,
                "data": data.name,
                "host": host,
                "port": 0,
                **config_overrides,
            }
        )
        ctl: Any = control.create(
            ControlSettings(
                host,
                port,
                max_frame_bytes=cfg.limits.max_frame_bytes,
                options=dict(control_options or {}),
            )
        )
        try:
            dt: Any = data.create(DataSettings(self.region, block_len, options))
        except BaseException:
            ctl.close()
            raise
        if faults is not None:
            ctl = faults.control(ctl)
            dt = faults.data(dt, local=ctl.local_address)
        self.control, self.data = ctl, dt
        self.tier = P2PTier(
            cfg,
            self.region,
            block_len,
            registry=registry or Registry.from_plugins([]),
            clock=clock,
            control=ctl,
            data=dt,
        )
        self.address = self.tier.local_address
        self.host, self.port = parse_address(self.address)
        self.results: dict[int, JobResult] = {}
        self.submitted: set[int] = set()
        self.closed = False

    # -- requests ---------------------------------------------------------------------------

    @staticmethod
    def producer_ctx(kv: str) -> RequestContext:
        return RequestContext(f"prod-{kv}", {"remote_decoder": {"kv_request_id": kv}})

    def consumer_ctx(self, kv: str, source: TierNode, *, probe: bool = False) -> RequestContext:
        key = "remote_kv_source" if probe else "remote_prefiller"
        return RequestContext(
            f"cons-{kv}",
            {
                key: {
                    "kv_request_id": kv,
                    "remote_host": source.host,
                    "remote_port": source.port,
                }
            },
        )

    def store(self, job_id: int, keys: list[bytes], slots: list[int], ctx: RequestContext) -> None:
        self.submitted.add(job_id)
        self.tier.submit_store(Job(job_id, keys, slots, False, ctx))

    def load(self, job_id: int, keys: list[bytes], slots: list[int], ctx: RequestContext) -> None:
        self.submitted.add(job_id)
        self.tier.submit_load(Job(job_id, keys, slots, True, ctx))

    # -- results ----------------------------------------------------------------------------

    def collect(self) -> list[JobResult]:
        got = self.tier.get_finished_jobs()
        self.record(got)
        return got

    def record(self, got: Iterable[JobResult]) -> None:
        for r in got:
            assert r.job_id not in self.results, f"job {r.job_id} reported twice: {r}"
            assert r.job_id in self.submitted, f"result for unknown job {r.job_id}: {r}"
            self.results[r.job_id] = r

    def outcome(self, job_id: int) -> Outcome | None:
        r = self.results.get(job_id)
        return None if r is None else r.outcome

    def shutdown(self) -> None:
        if not self.closed:
            self.closed = True
            self.record(self.tier.shutdown())


@dataclass(eq=False)
class Req:
    kv: str
    prod: int
    cons: int
    probe: bool
    keys: list[bytes]
    src: dict[bytes, int]
    pctx: RequestContext
    cctx: RequestContext
    stored: set[bytes] = field(default_factory=set)
    loaded: set[bytes] = field(default_factory=set)
    done_p: bool = False
    done_c: bool = False


@dataclass
class LoadRec:
    node: int
    req: Req
    keys: list[bytes]
    slots: list[int]
    before: np.ndarray


class Source:
    """A node's LocalHitSource: its symmetric requests' source blocks are local hits."""

    def __init__(self, machine: TierMachine, node: int) -> None:
        self.m, self.node = machine, node
        self.have: dict[bytes, int] = {}

    def begin(self, kv: str) -> object:
        return kv

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        return LookupResult.HIT if key in self.have else LookupResult.MISS

    def pin(self, handle: object, keys: list[bytes]) -> Job:
        job_id = next(self.m.ids)
        self.m.nodes[self.node].submitted.add(job_id)
        return Job(job_id, keys, [self.have[k] for k in keys], False, RequestContext("pin"))

    def end(self, handle: object) -> None:
        pass


class TierMachine(KitMachine):
    """Two or more ``P2PTier`` nodes over any (control, data) transport pair.

    Subclass and set ``control_transport``/``data_transport`` (and their ``*_options``);
    ``faults_enabled = True`` wraps every transport in the reference backend's
    :class:`~p2pkv.reference.faults.FaultInjector` and enables the fault rules.
    ``settle_timeout`` bounds, in real seconds, how long teardown waits for real transports
    to go quiet.
    """

    N_NODES: ClassVar[int] = 2
    control_transport: ClassVar[type[ControlTransport] | None] = None
    data_transport: ClassVar[type[DataTransport] | None] = None
    control_options: ClassVar[Mapping[str, Any]] = {}
    data_options: ClassVar[Mapping[str, Any]] = {}
    faults_enabled: ClassVar[bool] = False
    settle_timeout: ClassVar[float] = 20.0
    num_blocks: ClassVar[int] = 96
    block_len: ClassVar[int] = 8

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        self.clock = FakeClock()
        self.faults: FaultInjector | None = None
        self.node_data_options: list[Mapping[str, Any]] = []
        self.ids = itertools.count(1)
        self.kvs = itertools.count(1)
        self.nodes: list[Any] = []
        self.sources: list[Source] = []
        self.loads: dict[int, LoadRec] = {}
        self.free: list[set[int]] = []
        self.quiet: list[dict[int, np.ndarray]] = []
        self.reqs: list[Req] = []
        self.retired: list[Any] = []
        self.frozen: dict[int, int] = {}
        """Node -> engine steps it still misses (the ``freeze`` fault)."""
        self.flow: dict[str, int] = {}
        """The tier config's ``flow`` windows of this run (drawn small: loads queue)."""

    def draw_data_options(self, data: st.DataObject) -> list[Mapping[str, Any]]:
        """The data options of each node of this run (a restarted node keeps its own);
        override to vary them per example and per node."""
        return [dict(self.data_options)] * self.N_NODES

    @initialize(seed=st.integers(0, 2**16), data=st.data())
    def start(self, seed: int, data: st.DataObject) -> None:
        if self.faults_enabled:
            self.faults = FaultInjector(seed=seed)
        self.node_data_options = self.draw_data_options(data)
        self.flow = {
            "window_rounds": data.draw(st.sampled_from([1, 2, 32]), label="window_rounds"),
            "window_blocks": data.draw(st.sampled_from([1, 4, 4096]), label="window_blocks"),
        }
        for i in range(self.N_NODES):
            self.nodes.append(self._node(i, port=0))
            self.sources.append(Source(self, i))
            self.free.append(set(range(self.source, self.num_blocks)))
            self.quiet.append({})

    @property
    def source(self) -> int:
        """Slots below this hold source blocks (never written); loads land above."""
        return self.num_blocks // 2

    def _node(self, i: int, port: int) -> TierNode:
        control, data = self.control_transport, self.data_transport
        if control is None or data is None:
            raise TypeError(f"{type(self).__name__}: set control_transport and data_transport")
        return TierNode(
            self.clock,
            control=control,
            data=data,
            control_options=self.control_options,
            data_options=self.node_data_options[i],
            faults=self.faults,
            num_blocks=self.num_blocks,
            block_len=self.block_len,
            seed=1000 * i + len(self.retired),
            port=port,
            flow=self.flow,
        )

    # -- requests ---------------------------------------------------------------------------

    @step(
        target=requests,
        pair=st.sampled_from([(0, 1), (1, 0), (0, 2), (2, 1)]),
        n=st.integers(1, 6),
        probe=st.sampled_from([False, False, True]),
        first=st.sampled_from(["store", "load", "both", "none"]),
        data=st.data(),
    )
    def new_request(self, pair: tuple[int, int], n: int, probe: bool, first: str, data: Any) -> Any:
        prod, cons = (p % self.N_NODES for p in pair)
        if prod == cons:
            cons = (cons + 1) % self.N_NODES
        kv = f"r{next(self.kvs)}"
        keys = [f"{kv}/{i}".encode() for i in range(n)]
        slots = data.draw(
            st.lists(st.integers(0, self.source - 1), min_size=n, max_size=n, unique=True)
        )
        p, c = self.nodes[prod], self.nodes[cons]
        req = Req(
            kv,
            prod,
            cons,
            probe,
            keys,
            dict(zip(keys, slots, strict=True)),
            p.producer_ctx(kv),
            c.consumer_ctx(kv, p, probe=probe),
        )
        if probe:
            self.sources[prod].have.update(req.src)
            req.done_p = True  # served from the source's cache: no producer request
        else:
            p.tier.on_new_request(req.pctx)
        c.tier.on_new_request(req.cctx)
        self.reqs.append(req)
        if first in ("store", "both"):
            self.store(req, data)
        if first in ("load", "both"):
            self.load(req, data)
        return req

    @step(pair=st.sampled_from([(0, 1), (1, 0)]), count=st.integers(4, 12), data=st.data())
    def burst(self, pair: tuple[int, int], count: int, data: Any) -> None:
        """``count`` PD requests of one block each, stored and loaded all at once: beyond
        the drawn window they queue in the consumer's tier, each within its deadline."""
        for _ in range(count):
            self.new_request(pair, 1, False, "both", data)

    @step(
        req=requests,
        action=st.sampled_from(["store", "store", "load", "load", "load", "probe", "finish"]),
        producer_first=st.booleans(),
        data=st.data(),
    )
    def act(self, req: Req, action: str, producer_first: bool, data: Any) -> None:
        if action == "store":
            self.store(req, data)
        elif action == "load":
            self.load(req, data)
        elif action == "probe":
            self.probe(req)
        else:
            self._finish(req, producer_first)

    def store(self, req: Req, data: Any) -> None:
        left = [k for k in req.keys if k not in req.stored]
        if req.probe or req.done_p or not left:
            return
        chunk = data.draw(st.lists(st.sampled_from(left), min_size=1, unique=True))
        req.stored.update(chunk)
        self.nodes[req.prod].store(next(self.ids), chunk, [req.src[k] for k in chunk], req.pctx)

    def load(self, req: Req, data: Any) -> None:
        c = self.nodes[req.cons]
        left = [k for k in req.keys if k not in req.loaded]
        if req.done_c or not left:
            return
        if req.probe:
            left = [k for k in left if c.tier.lookup(k, req.cctx) is LookupResult.HIT]
            if not left:
                return  # the lookups just made are the probe; a later load may find hits
        elif data.draw(st.booleans(), label="only stored keys"):
            left = [k for k in left if k in req.stored] or left
        chunk = data.draw(st.lists(st.sampled_from(left), min_size=1, unique=True))
        free = self.free[req.cons]
        if len(free) < len(chunk):
            return
        slots = sorted(free)[: len(chunk)]
        free.difference_update(slots)
        for s in slots:
            self.quiet[req.cons].pop(s, None)
        req.loaded.update(chunk)
        job_id = next(self.ids)
        self.loads[job_id] = LoadRec(req.cons, req, chunk, slots, c.blocks[slots].copy())
        c.load(job_id, chunk, slots, req.cctx)

    def probe(self, req: Req) -> None:
        if req.probe and not req.done_c:
            c = self.nodes[req.cons]
            for k in req.keys:
                c.tier.lookup(k, req.cctx)

    def _finish(self, req: Req, producer_first: bool = True) -> None:
        sides = [("p", req.prod), ("c", req.cons)]
        for side, i in sides if producer_first else sides[::-1]:
            if side == "p" and not req.done_p:
                req.done_p = True
                self.nodes[i].tier.on_request_finished(req.pctx)
            elif side == "c" and not req.done_c:
                req.done_c = True
                self.nodes[i].tier.on_request_finished(req.cctx)

    # -- time and I/O -----------------------------------------------------------------------

    @step(rounds=st.integers(1, 4))
    def pump(self, rounds: int) -> None:
        for _ in range(rounds):
            for i in range(self.N_NODES):
                self._tick(i)

    @step(seconds=st.sampled_from([0.5, 0.5, 3, 5.5, 10.5, 30.5, 61]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.pump(2)

    def _tick(self, i: int) -> None:
        """One engine step of node ``i`` (a frozen node misses it: its step count drops)."""
        missed = self.frozen.get(i)
        if missed:
            self.frozen[i] = missed - 1
            return
        node = self.nodes[i]
        node.tier.serve_lookups(self.sources[i])
        self._results(i, node.collect())
        node.tier.on_schedule_end()

    def _results(self, i: int, results: list[Any]) -> None:
        for r in results:
            rec = self.loads.pop(r.job_id, None)
            if rec is None:
                continue
            blocks = self.nodes[i].blocks
            prod = self.nodes[rec.req.prod].blocks
            for j, (k, s) in enumerate(zip(rec.keys, rec.slots, strict=True)):
                want = prod[rec.req.src[k]]
                now = blocks[s]
                if r.outcome is Outcome.DONE:
                    assert (now == want).all(), f"job {r.job_id}: slot {s} lacks {k!r}"
                else:
                    assert (now == want).all() or (now == rec.before[j]).all(), (
                        f"job {r.job_id} ({r.outcome}): slot {s} holds foreign bytes"
                    )
                self.free[i].add(s)  # reused at once, whatever the outcome
                self.quiet[i][s] = now.copy()  # and final: nothing may land there now

    # -- faults -----------------------------------------------------------------------------

    @step(
        kind=st.sampled_from([*_INJECTED, "kill", "partition", "heal", "restart", "freeze"]),
        node=st.integers(0, 2),
        other=st.integers(0, 2),
        count=st.integers(1, 2),
        polls=st.integers(1, 3),
    )
    def fault(self, kind: str, node: int, other: int, count: int, polls: int) -> None:
        """Injected faults need ``faults_enabled``; kill (a session's connection is closed),
        restart (a node shuts down and comes back on its port) and freeze (the node misses
        ``8 * polls`` engine steps; with ``advance`` between them the clock runs past its
        peers' timeouts meanwhile) work on any transport."""
        a, b = self.nodes[node % self.N_NODES], self.nodes[other % self.N_NODES]
        if kind == "freeze":
            self.frozen[node % self.N_NODES] = 8 * polls
        elif kind in _INJECTED:
            if self.faults is not None:
                self.faults.arm(Fault(kind), peer=a.address, count=count, polls=polls)
        elif kind == "kill":
            conn = a.tier.peer_connection(b.address)
            if conn is not None and conn.alive:
                if self.faults is not None:
                    self.faults.kill(conn)
                else:
                    conn.close()
        elif kind == "partition":
            if a is not b and self.faults is not None:
                self.faults.partition(a.address, b.address)
        elif kind == "heal":
            self.heal()
        elif len(self.retired) < 3:
            self.restart(node % self.N_NODES)

    def heal(self) -> None:
        self.frozen.clear()
        if self.faults is None:
            return
        for a in self.nodes:
            for b in self.nodes:
                self.faults.heal(a.address, b.address)
        self.faults.disarm()

    def restart(self, i: int) -> None:
        old = self.nodes[i]
        for req in self.reqs:
            if i in (req.prod, req.cons):
                self._finish(req)
        old.shutdown()
        self._results(
            i,
            [
                old.results[j]
                for j in list(self.loads)
                if j in old.results and self.loads[j].node == i
            ],
        )
        assert not [j for j, rec in self.loads.items() if rec.node == i], "lost a load"
        self.retired.append(old)
        new = self._node(i, port=old.port)
        new.blocks[:] = old.blocks  # the model of both halves carries over
        self.nodes[i] = new

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def regions_untouched_where_nobody_asked(self) -> None:
        for i, node in enumerate(self.nodes):
            src = node.blocks[: self.source]
            assert (src == self._source_of(i)).all(), f"node {i}: source half was written"
            for s, snap in self.quiet[i].items():
                assert (node.blocks[s] == snap).all(), (
                    f"node {i}: slot {s} changed after its load had a result"
                )

    def _source_of(self, i: int) -> Any:
        if not hasattr(self, "_sources"):
            self._sources: dict[int, Any] = {}
        node = self.nodes[i]
        snap = self._sources.get(id(node))
        if snap is None:
            snap = self._sources[id(node)] = node.blocks[: self.source].copy()
        return snap

    def teardown(self) -> None:
        """Quiesce and check that nothing is left, then shut every node down; after a
        failed step only shut down (no waiting: the failure stays the reported error)."""
        failed = self.teardown_after_failure()
        try:
            if self.nodes and not failed:
                self._quiesce()
        finally:
            for node in self.nodes:
                if failed:
                    quietly(node.shutdown)
                else:
                    node.shutdown()

    def _quiesce(self) -> None:
        self.heal()
        for req in self.reqs:
            self._finish(req)
        for _ in range(6):
            self.clock.advance(35)
            self.pump(3)

        def quiet() -> bool:  # real transports need real time on top of the fake clock
            return all(
                not n.tier.has_pending_work() and n.submitted <= set(n.results) for n in self.nodes
            )

        try:
            wait_until(
                quiet,
                timeout=self.settle_timeout,
                what="every tier to go quiet",
                pumps=[lambda: self.clock.advance(35), lambda: self.pump(1)],
            )
        except WaitTimeout as exc:
            left = {
                n.address: (
                    {k: v for k, v in n.tier.state_sizes().items() if v},
                    sorted(n.submitted - set(n.results)),
                )
                for n in self.nodes
            }
            raise AssertionError(
                f"{exc}; per node (state left, jobs without a result): {left}"
            ) from None
        for node in self.nodes:
            missing = node.submitted - set(node.results)
            assert not missing, f"{node.address}: jobs without a result: {sorted(missing)}"
            assert not node.tier.has_pending_work(), node.tier.state_sizes()
            sizes = node.tier.state_sizes()
            left = {k: v for k, v in sizes.items() if v}
            assert not left, f"{node.address}: per-request state left: {left}"
