"""The demo's two engines: a producer (prefiller) and a consumer (decoder) driving a P2PTier.

Each role owns a synthetic KV region (``num_slots`` blocks of the model's block size, from the
data transport's ``allocate_region``) and a :class:`p2pkv.tier.P2PTier`, and drives it the way
a serving engine's scheduler does:

- producer (PD): ``on_new_request`` -> fill the request's slots -> ``submit_store`` -> on the
  store job's result, ``on_request_finished`` and free the slots;
- producer (symmetric): the blocks sit in a local prefix cache; ``serve_lookups`` every step
  answers the consumer's probes from it and pins hits into store jobs;
- consumer: ``on_new_request`` -> ``lookup`` each key (PD: HIT at once; symmetric: RETRY
  until the batched probe flushed by ``on_schedule_end`` is answered) -> ``submit_load`` into
  its own free slots -> on the result, verify every byte -> ``on_request_finished``.

Every step ends with ``get_finished_jobs`` and ``on_schedule_end``. Commands arrive from the
orchestrator (:mod:`p2pkv_tools.demo.orchestrator`) as tuples and events go back as tuples; a
role is single-threaded and never blocks longer than ``idle_wait``.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.registry import default_registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext

from p2pkv_tools.bench.data_transport import transport_region
from p2pkv_tools.demo.content import BlockRegion
from p2pkv_tools.demo.workload import DemoRequest

__all__ = [
    "ConsumerRole",
    "Event",
    "Evicted",
    "Loaded",
    "Pinned",
    "ProducerRole",
    "RoleSetup",
    "Stored",
    "Submitted",
]


@dataclass(frozen=True)
class Submitted:
    """A side took its half of request ``index`` (at ``at``, ``time.monotonic``)."""

    index: int
    at: float


@dataclass(frozen=True)
class Stored:
    """The producer's store job of request ``index`` got its result."""

    index: int
    outcome: str
    detail: str = ""


@dataclass(frozen=True)
class Pinned:
    """A store job the producer's hit source pinned for request ``index`` got its result."""

    index: int
    outcome: str
    detail: str = ""


@dataclass(frozen=True)
class Evicted:
    """The producer dropped request ``index``'s blocks from its prefix cache."""

    index: int


@dataclass(frozen=True)
class Loaded:
    """The consumer's load of request ``index`` got its result and was verified.

    ``submitted_at``/``done_at`` are ``time.monotonic`` (comparable across processes on one
    host); ``bad_blocks`` counts blocks whose bytes did not match their keys."""

    index: int
    outcome: str
    submitted_at: float
    done_at: float
    blocks: int
    bad_blocks: int = 0
    detail: str = ""


Event = Submitted | Stored | Pinned | Evicted | Loaded


@dataclass(frozen=True)
class RoleSetup:
    """What a role process is built from (picklable)."""

    tier_config: dict[str, Any]
    block_len: int
    num_slots: int
    seed: int = 0
    log_level: int = logging.WARNING
    """Log level of a role process (the orchestrator passes its own)."""


class _Engine:
    """A region, its slot allocator and a tier: what both roles share."""

    def __init__(self, setup: RoleSetup) -> None:
        self.block_len = setup.block_len
        config = TierConfig.from_dict(setup.tier_config)
        self.view = transport_region(  # pre-faulted: no page fault once the clock runs
            default_registry().transport("data", config.data),
            setup.num_slots,
            setup.block_len,
            config.data_options,
        )
        """The region, as the data transport's ``allocate_region`` returned it."""
        self.buf = np.frombuffer(self.view, dtype=np.uint8)
        self.region = BlockRegion(self.buf, setup.block_len)
        free = np.random.default_rng(setup.seed).permutation(setup.num_slots)
        self._free: list[int] = [int(s) for s in free]  # scattered, like a block allocator
        self.tier = self.make_tier(config)
        self._job_ids = itertools.count(1)
        self.cpu_started = time.process_time()

    def make_tier(self, config: TierConfig) -> P2PTier:
        """Build the tier over this engine's region (a subclass may build it with transports
        of its own, e.g. wrapped to record or inject faults)."""
        return P2PTier(config, self.view, self.block_len)

    @property
    def address(self) -> str:
        return self.tier.local_address

    def take_slots(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"region full: need {n} slots, {len(self._free)} free")
        taken, self._free = self._free[-n:], self._free[:-n]
        return taken

    def free_slots(self, slots: Sequence[int]) -> None:
        self._free.extend(slots)

    def next_job_id(self) -> int:
        return next(self._job_ids)

    def stats(self) -> dict[str, Any]:
        return {
            "cpu_s": time.process_time() - self.cpu_started,
            "tier": dict(self.tier.stats()),
        }

    def shutdown(self) -> list[JobResult]:
        return self.tier.shutdown()


@dataclass
class _Cached:
    """A symmetric request's blocks in the producer's prefix cache."""

    index: int
    slots: list[int]
    by_key: dict[bytes, int]
    pinned: set[int] = field(default_factory=set)
    evict: bool = False


class ProducerRole(_Engine):
    """The prefiller (see the module docstring)."""

    def __init__(self, setup: RoleSetup) -> None:
        super().__init__(setup)
        self._stores: dict[int, tuple[DemoRequest, RequestContext, list[int]]] = {}
        self._cache: dict[str, _Cached] = {}
        self._pins: dict[int, str] = {}  # pinned store job id -> kv_request_id

    def handle(self, cmd: tuple[Any, ...]) -> list[Event]:
        op = cmd[0]
        if op == "store":
            return self._store(cmd[1])
        if op == "cache":
            return self._put_cache(cmd[1])
        if op == "evict":
            return self._evict(cmd[1])
        raise ValueError(f"producer: unknown command {op!r}")

    def _store(self, req: DemoRequest) -> list[Event]:
        ctx = RequestContext(
            req_id=f"p-{req.kv_request_id}",
            kv_transfer_params={"remote_decoder": {"kv_request_id": req.kv_request_id}},
        )
        self.tier.on_new_request(ctx)
        slots = self.take_slots(req.num_blocks)
        self.region.fill(slots, req.keys)  # the prefill "computes" the KV blocks
        job = Job(self.next_job_id(), req.keys, slots, is_load=False, ctx=ctx)
        self._stores[job.job_id] = (req, ctx, slots)
        self.tier.submit_store(job)
        return [Submitted(req.index, time.monotonic())]

    def _put_cache(self, req: DemoRequest) -> list[Event]:
        keys = req.keys[: req.hits]
        slots = self.take_slots(len(keys))
        self.region.fill(slots, keys)
        self._cache[req.kv_request_id] = _Cached(
            req.index, slots, dict(zip(keys, slots, strict=True))
        )
        return [Submitted(req.index, time.monotonic())]

    def _evict(self, req: DemoRequest) -> list[Event]:
        entry = self._cache.get(req.kv_request_id)
        if entry is None:
            return [Evicted(req.index)]
        entry.evict = True
        return self._maybe_evict(req.kv_request_id)

    def _maybe_evict(self, kv: str) -> list[Event]:
        entry = self._cache[kv]
        if not entry.evict or entry.pinned:
            return []
        del self._cache[kv]
        self.free_slots(entry.slots)
        return [Evicted(entry.index)]

    def step(self) -> list[Event]:
        self.tier.serve_lookups(_CacheSource(self))
        events: list[Event] = []
        for result in self.tier.get_finished_jobs():
            events.extend(self._finished(result))
        self.tier.on_schedule_end()
        return events

    def _finished(self, result: JobResult) -> list[Event]:
        stored = self._stores.pop(result.job_id, None)
        if stored is not None:
            req, ctx, slots = stored
            self.tier.on_request_finished(ctx)
            self.free_slots(slots)
            return [Stored(req.index, result.outcome.value, result.detail)]
        kv = self._pins.pop(result.job_id, None)
        if kv is None or kv not in self._cache:
            return []
        entry = self._cache[kv]
        entry.pinned.discard(result.job_id)
        return [Pinned(entry.index, result.outcome.value, result.detail), *self._maybe_evict(kv)]

    def cached(self, kv_request_id: str) -> _Cached | None:
        return self._cache.get(kv_request_id)

    def pinned(self, kv_request_id: str, job: Job) -> None:
        """Record a store job the hit source pinned for ``kv_request_id``."""
        self._cache[kv_request_id].pinned.add(job.job_id)
        self._pins[job.job_id] = kv_request_id

    @property
    def busy(self) -> bool:
        return bool(self._stores or self._pins)


class _CacheSource:
    """The producer's prefix cache as a ``LocalHitSource`` (valid during one serve call)."""

    def __init__(self, producer: ProducerRole) -> None:
        self._p = producer

    def begin(self, kv_request_id: str) -> object:
        return kv_request_id

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        entry = self._p.cached(str(handle))
        return LookupResult.HIT if entry is not None and key in entry.by_key else LookupResult.MISS

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        kv = str(handle)
        entry = self._p.cached(kv)
        if entry is None:
            raise KeyError(f"{kv} is not cached")
        job = Job(
            self._p.next_job_id(),
            list(keys),
            [entry.by_key[k] for k in keys],
            is_load=False,
            ctx=RequestContext(req_id=f"serve-{kv}"),
        )
        self._p.pinned(kv, job)
        return job

    def end(self, handle: object) -> None:
        return None


@dataclass
class _Load:
    req: DemoRequest
    ctx: RequestContext
    keys: list[bytes] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    job_id: int = 0
    started: float = 0.0


class ConsumerRole(_Engine):
    """The decoder (see the module docstring)."""

    def __init__(self, setup: RoleSetup) -> None:
        super().__init__(setup)
        self._loads: dict[int, _Load] = {}  # job id -> load
        self._probing: list[_Load] = []

    def handle(self, cmd: tuple[Any, ...]) -> list[Event]:
        op = cmd[0]
        if op in ("load", "probe"):
            return self._begin(cmd[1], cmd[2], probe=op == "probe")
        raise ValueError(f"consumer: unknown command {op!r}")

    def _begin(self, req: DemoRequest, producer: str, *, probe: bool) -> list[Event]:
        host, port = parse_address(producer)
        route = {"kv_request_id": req.kv_request_id, "remote_host": host, "remote_port": port}
        key = "remote_kv_source" if probe else "remote_prefiller"
        load = _Load(
            req, RequestContext(req_id=f"c-{req.kv_request_id}", kv_transfer_params={key: route})
        )
        self.tier.on_new_request(load.ctx)
        if probe:
            self._probing.append(load)
            return [Submitted(req.index, time.monotonic()), *self._probe(load)]
        now = time.monotonic()
        return [Submitted(req.index, now), *self._submit(load, list(req.keys), looked_up=False)]

    def _probe(self, load: _Load) -> list[Event]:
        """Look up keys in order; stop at the first MISS (a prefix hit, as engines use it)."""
        hits = []
        for key in load.req.keys:
            res = self.tier.lookup(key, load.ctx)
            if res is LookupResult.RETRY:
                return []
            if res is LookupResult.MISS:
                break
            hits.append(key)
        self._probing.remove(load)
        if not hits:
            self.tier.on_request_finished(load.ctx)
            now = time.monotonic()
            return [Loaded(load.req.index, Outcome.NOTHING_TO_DO.value, now, now, 0)]
        return self._submit(load, hits, looked_up=True)

    def _submit(self, load: _Load, keys: list[bytes], *, looked_up: bool) -> list[Event]:
        if not looked_up:
            for key in keys:  # PD consumer: eager HIT for every key
                if self.tier.lookup(key, load.ctx) is not LookupResult.HIT:
                    self.tier.on_request_finished(load.ctx)
                    now = time.monotonic()
                    return [Loaded(load.req.index, "lookup_miss", now, now, 0, 0, key.hex())]
        load.keys = keys
        load.slots = self.take_slots(len(keys))
        load.job_id = self.next_job_id()
        load.started = time.monotonic()
        self._loads[load.job_id] = load
        self.tier.submit_load(Job(load.job_id, keys, load.slots, is_load=True, ctx=load.ctx))
        return []

    def step(self) -> list[Event]:
        events: list[Event] = []
        for load in list(self._probing):
            events.extend(self._probe(load))
        for result in self.tier.get_finished_jobs():
            events.extend(self._finished(result))
        self.tier.on_schedule_end()
        return events

    def _finished(self, result: JobResult) -> list[Event]:
        load = self._loads.pop(result.job_id, None)
        if load is None:
            return []
        done_at = time.monotonic()
        bad = 0
        if result.outcome is Outcome.DONE:
            bad = len(self.region.verify(load.slots, load.keys))
        else:  # never trust a failed load's slots: poison them for the next user
            self.region.poison(load.slots)
        self.tier.on_request_finished(load.ctx)
        self.free_slots(load.slots)
        return [
            Loaded(
                load.req.index,
                result.outcome.value,
                load.started,
                done_at,
                len(load.keys),
                bad,
                result.detail,
            )
        ]

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._probing)
