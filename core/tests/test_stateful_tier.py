"""Stateful property test: two and three P2PTiers over fault-injected memory transports.

Hypothesis drives random interleavings of new requests (PD and symmetric), stores, loads in
several rounds, request finishes, clock jumps past every timeout, and faults (drop, delay,
duplicate, reorder, failed submits and completions, killed connections, partitions, peer
restarts). Invariants, checked after every step:

* every submitted job gets exactly one result, and no result names an unknown job;
* a successful load's slots hold exactly the producer's bytes for those keys;
* nothing is ever written outside demanded slots: a slot reserved for key ``k`` only ever
  holds its old bytes or ``k``'s bytes; the source half of every region never changes; a slot
  released by a result that promises quiescence (``transfer_done``/``abort_ack`` seen) never
  changes afterwards;
* like an engine, the model reuses every slot as soon as its load has a result, also after
  PEER_DEAD or ABORT_ACK_TIMEOUT, while the producer's write into it may still be in flight
  (the memory data transport completes writes polls later, and with ``wait_cancel_refuses``
  a dead session's writes keep landing): a load reported DONE must still hold exactly its own
  bytes then and ever after (the tier fences such slots until the producer confirms);
* at the end, once every request finished, faults healed and the tiers polled to quiescence
  (clock past every deadline), no per-request state remains and every job has its result.

Each node's region is split: the lower half holds source blocks (random, never written), the
upper half is where loads land.
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    rule,
    run_state_machine_as_test,
)
from p2pkv.types import Job, LookupResult, Outcome, RequestContext
from p2pkv_memory.faults import Fault, FaultInjector

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
NUM_BLOCKS = 96
SOURCE = NUM_BLOCKS // 2
BLOCK_LEN = 8

# Outcomes whose release promises that the producer no longer writes into the slots.
QUIET = frozenset({
    Outcome.DONE, Outcome.TRANSFER_FAILED, Outcome.SUBMIT_FAILED, Outcome.DEMAND_UNMET,
    Outcome.LOAD_TIMEOUT, Outcome.REQUEST_FINISHED, Outcome.NOTHING_TO_DO, Outcome.NO_ROUTE,
})


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


class TierMachine(RuleBasedStateMachine):
    N_NODES = 2
    harness: Any = None

    requests = Bundle("requests")

    def __init__(self) -> None:
        super().__init__()
        h = self.harness
        self.clock = h.FakeClock()
        self.faults = FaultInjector(seed=0)
        self.ids = itertools.count(1)
        self.kvs = itertools.count(1)
        self.nodes: list[Any] = []
        self.sources: list[Source] = []
        self.loads: dict[int, LoadRec] = {}
        self.free: list[set[int]] = []
        self.quiet: list[dict[int, np.ndarray]] = []
        self.taint: list[dict[int, tuple[set[bytes], np.ndarray]]] = []
        self.reqs: list[Req] = []
        self.retired: list[Any] = []

    @initialize(completion_polls=st.lists(st.sampled_from([0, 1, 2, 12]), min_size=3,
                                          max_size=3),
                refuse=st.booleans(), seed=st.integers(0, 2**16))
    def start(self, completion_polls: list[int], refuse: bool, seed: int) -> None:
        """Per node: how many polls its writes take (a slow node's writes outlive a cut and
        land after a fast node served the same slots again)."""
        self.faults = FaultInjector(seed=seed)
        self.data_options = [{"completion_polls": n, "wait_cancel_refuses": refuse}
                             for n in completion_polls]
        for i in range(self.N_NODES):
            self.nodes.append(self._node(i, port=0))
            self.sources.append(Source(self, i))
            self.free.append(set(range(SOURCE, NUM_BLOCKS)))
            self.quiet.append({})
            self.taint.append({})

    def _node(self, i: int, port: int) -> Any:
        return self.harness.Node(self.clock, faults=self.faults, num_blocks=NUM_BLOCKS,
                                 block_len=BLOCK_LEN, data_options=self.data_options[i],
                                 seed=1000 * i + len(self.retired), port=port)

    # -- requests ---------------------------------------------------------------------------

    @rule(target=requests, pair=st.sampled_from([(0, 1), (1, 0), (0, 2), (2, 1)]),
          n=st.integers(1, 6), probe=st.sampled_from([False, False, True]),
          first=st.sampled_from(["store", "load", "both", "none"]), data=st.data())
    def new_request(self, pair: tuple[int, int], n: int, probe: bool, first: str,
                    data: Any) -> Any:
        prod, cons = (p % self.N_NODES for p in pair)
        if prod == cons:
            cons = (cons + 1) % self.N_NODES
        kv = f"r{next(self.kvs)}"
        keys = [f"{kv}/{i}".encode() for i in range(n)]
        slots = data.draw(st.lists(st.integers(0, SOURCE - 1), min_size=n, max_size=n,
                                   unique=True))
        p, c = self.nodes[prod], self.nodes[cons]
        req = Req(kv, prod, cons, probe, keys, dict(zip(keys, slots, strict=True)),
                  p.producer_ctx(kv), c.consumer_ctx(kv, p, probe=probe))
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

    @rule(req=requests, action=st.sampled_from(["store", "store", "load", "load", "load",
                                                "probe", "finish"]),
          producer_first=st.booleans(), data=st.data())
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
        self.nodes[req.prod].store(next(self.ids), chunk, [req.src[k] for k in chunk],
                                   req.pctx)

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
        taint = self.taint[req.cons]
        for s, k in zip(slots, chunk, strict=True):
            self.quiet[req.cons].pop(s, None)
            if s in taint:  # an earlier producer's write may still land here, and now ours
                keys, snap = taint[s]
                taint[s] = ({*keys, k}, snap)
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

    @rule(rounds=st.integers(1, 4))
    def pump(self, rounds: int) -> None:
        for _ in range(rounds):
            for i in range(self.N_NODES):
                self._tick(i)

    @rule(seconds=st.sampled_from([0.5, 0.5, 3, 5.5, 10.5, 30.5, 61]))
    def advance(self, seconds: float) -> None:
        self.clock.advance(seconds)
        self.pump(2)

    def _tick(self, i: int) -> None:
        """One engine step of node ``i``."""
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
            taint = self.taint[i]
            for j, (k, s) in enumerate(zip(rec.keys, rec.slots, strict=True)):
                want = prod[rec.req.src[k]]
                now = blocks[s]
                if r.outcome is Outcome.DONE:
                    assert (now == want).all(), f"job {r.job_id}: slot {s} lacks {k!r}"
                else:
                    assert ((now == want).all() or (now == rec.before[j]).all()
                            or self._holds_one_of(now, taint.get(s, (set(),))[0])), (
                        f"job {r.job_id} ({r.outcome}): slot {s} holds foreign bytes")
                self.free[i].add(s)  # reused at once, whatever the outcome
                if r.outcome is Outcome.DONE or (r.outcome in QUIET and s not in taint):
                    self.quiet[i][s] = now.copy()
                    taint.pop(s, None)
                else:  # the producer (or an earlier one) may still write there
                    keys, _ = taint.get(s, (set(), now))
                    taint[s] = ({*keys, k}, now.copy())

    # -- faults -----------------------------------------------------------------------------

    @rule(kind=st.sampled_from([Fault.DROP, Fault.DELAY, Fault.DUPLICATE, Fault.REORDER,
                                Fault.FAIL_SUBMIT, Fault.FAIL_COMPLETION, "kill", "partition",
                                "heal", "restart"]),
          node=st.integers(0, 2), other=st.integers(0, 2), count=st.integers(1, 2),
          polls=st.integers(1, 3))
    def fault(self, kind: Any, node: int, other: int, count: int, polls: int) -> None:
        a, b = self.nodes[node % self.N_NODES], self.nodes[other % self.N_NODES]
        if isinstance(kind, Fault):
            self.faults.arm(kind, peer=a.address, count=count, polls=polls)
        elif kind == "kill":
            session = a.tier._sessions.get(b.address)
            if session is not None and session.conn.alive:
                self.faults.kill(session.conn)
        elif kind == "partition":
            if a is not b:
                self.faults.partition(a.address, b.address)
        elif kind == "heal":
            self.heal()
        elif len(self.retired) < 3:
            self.restart(node % self.N_NODES)

    def heal(self) -> None:
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
        self._results(i, [old.results[j] for j in list(self.loads)
                          if j in old.results and self.loads[j].node == i])
        assert not [j for j, rec in self.loads.items() if rec.node == i], "lost a load"
        self.retired.append(old)
        new = self._node(i, port=old.port)
        new.blocks[:] = old.blocks  # the model of both halves carries over
        self.nodes[i] = new

    # -- invariants -------------------------------------------------------------------------

    @invariant()
    def regions_untouched_where_nobody_asked(self) -> None:
        for i, node in enumerate(self.nodes):
            src = node.blocks[:SOURCE]
            assert (src == self._source_of(i)).all(), f"node {i}: source half was written"
            for s, snap in self.quiet[i].items():
                assert (node.blocks[s] == snap).all(), f"node {i}: released slot {s} changed"
            for s, (ks, snap) in self.taint[i].items():
                now = node.blocks[s]
                ok = (now == snap).all() or self._holds_one_of(now, ks)
                assert ok, f"node {i}: slot {s} holds bytes of no key demanded into it"

    def _holds_one_of(self, block: Any, keys: set[bytes]) -> bool:
        return any((block == self._key_bytes(k)).all() for k in keys)

    def _source_of(self, i: int) -> Any:
        if not hasattr(self, "_sources"):
            self._sources: dict[int, Any] = {}
        node = self.nodes[i]
        snap = self._sources.get(id(node))
        if snap is None:
            snap = self._sources[id(node)] = node.blocks[:SOURCE].copy()
        return snap

    def _key_bytes(self, key: bytes) -> Any:
        req = next(r for r in self.reqs if key in r.src)
        return self.nodes[req.prod].blocks[req.src[key]]

    def teardown(self) -> None:
        try:
            if self.nodes:
                self._quiesce()
        finally:
            for node in self.nodes:
                node.shutdown()

    def _quiesce(self) -> None:
        self.heal()
        for req in self.reqs:
            self._finish(req)
        for _ in range(6):
            self.clock.advance(35)
            self.pump(3)
        for node in self.nodes:
            missing = node.submitted - set(node.results)
            assert not missing, f"{node.address}: jobs without a result: {sorted(missing)}"
            assert not node.tier.has_pending_work(), node.tier._state_sizes()
            sizes = node.tier._state_sizes()
            left = {k: v for k, v in sizes.items() if v}
            assert not left, f"{node.address}: per-request state left: {left}"


class TwoTiers(TierMachine):
    N_NODES = 2


class ThreeTiers(TierMachine):
    N_NODES = 3


def _settings(examples: int, steps: int) -> settings:
    scale = 10 if DEEP else 1
    return settings(max_examples=examples * scale, stateful_step_count=steps, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.filter_too_much])


@pytest.mark.hypothesis
@pytest.mark.timeout(3600 if DEEP else 120)
@pytest.mark.parametrize("machine, examples", [(TwoTiers, 30), (ThreeTiers, 20)],
                         ids=["two", "three"])
def test_tiers_keep_their_promises_under_faults(tier_harness: Any, machine: type,
                                                examples: int) -> None:
    machine.harness = tier_harness
    run_state_machine_as_test(machine, settings=_settings(examples, 60))
