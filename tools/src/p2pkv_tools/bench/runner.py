"""Time one cell of the matrix: a lane, a block size, blocks per request, concurrency.

Every request is a *read* (wire 2.0: the consumer owns every write into its region): it
copies source blocks of the peer side's region into destination slots of the initiator's.
A cell picks ``batch x groups`` source and destination slots (scattered at random, as a
block allocator hands them out, or contiguous) and splits them into ``groups`` request-sized
groups: at least ``concurrency``, and enough to span ``working_set`` bytes so consecutive
requests touch different memory (a block copied again and again stays in cache and would
flatter every series). The source slots get key-derived content once per cell (untimed). In
a repetition request ``r`` reads group ``r % groups`` and is submitted once that group's
previous request finished (its destination slots are the reader's until then) and fewer
than ``concurrency`` requests are in flight. A request's latency runs from its submit
(``read_blocks``) to the poll that reports it done; a repetition's throughput is its bytes
over its wall time. After every repetition (warm-up included) the destination slots it read
into are checked byte for byte, in the initiator's process, against the source blocks'
content and consumed, so the next repetition must read them again.

Warm-up repetitions are short (at least 8 requests, 4 per in-flight slot); their median
latency sizes the timed repetitions: ``requests``, or fewer when that many would take longer
than ``rep_seconds`` (a slow series would otherwise take minutes per cell), but never fewer
than two per in-flight slot.

Every repetition is bounded by ``deadline`` seconds (``CellTimeout``); a failed read, a
failure on the source side or a wrong byte makes the cell's ``error`` non-empty instead of
raising.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from p2pkv_tools.bench.lanes import Lane

__all__ = ["CellPlan", "CellResult", "CellTimeout", "measure_cell", "seeds_for"]

_MASK = (1 << 64) - 1


class CellTimeout(TimeoutError):
    """A repetition did not finish within its deadline."""


@dataclass(frozen=True)
class CellPlan:
    block_size: int
    batch: int
    concurrency: int
    requests: int
    reps: int
    warmup: int = 1
    contiguous: bool = False
    deadline: float = 60.0
    working_set: int = 128 * 1024 * 1024
    rep_seconds: float = 0.5
    """Fewer requests than ``requests`` per repetition when the warm-up shows that many
    would take longer than this (slow series); never fewer than 2 per in-flight slot."""

    def groups_within(self, num_blocks: int) -> int:
        """Request-sized slot groups for this cell in a region of ``num_blocks`` (0: too small)."""
        fit = num_blocks // self.batch
        if fit < self.concurrency:
            return 0
        wanted = -(-self.working_set // (self.batch * self.block_size))
        return min(fit, self.requests, max(self.concurrency, wanted))


@dataclass
class CellResult:
    """One row of ``p2pkv bench --json`` (rates in GB/s = 1e9 B/s, latencies in µs)."""

    series: str
    impl: str
    transport: str
    block_size: int
    batch: int
    concurrency: int
    requests: int = 0
    reps: int = 0
    gbps: float = 0.0
    gbps_min: float = 0.0
    gbps_max: float = 0.0
    p50_us: float = 0.0
    p99_us: float = 0.0
    mean_us: float = 0.0
    bytes_moved: int = 0
    bytes_verified: int = 0
    verified: bool = False
    ratio_raw: float | None = None
    ratio_memcpy: float | None = None
    error: str = ""
    skipped: str = ""
    rep_gbps: list[float] = field(default_factory=list)

    def as_row(self) -> dict[str, Any]:
        return asdict(self)


def seeds_for(slots: Sequence[int], block_size: int) -> list[int]:
    """Content seeds of source blocks (distinct per slot and block size, odd)."""
    return [(((s + 1) * 0x9E3779B97F4A7C15) ^ block_size) & _MASK | 1 for s in slots]


def _pick(rng: np.random.Generator, num_blocks: int, need: int, contiguous: bool) -> list[int]:
    if contiguous:
        start = int(rng.integers(0, num_blocks - need + 1))
        return list(range(start, start + need))
    return [int(x) for x in rng.choice(num_blocks, size=need, replace=False)]


def _run_rep(
    lane: Lane,
    local: list[list[int]],
    remote: list[list[int]],
    *,
    requests: int,
    concurrency: int,
    deadline: float,
) -> tuple[float, np.ndarray, int]:
    """One repetition; returns (wall seconds, latencies in seconds, failed requests).

    Past ``deadline`` the reads still in flight are cancelled and ``CellTimeout`` raised."""
    n_groups = len(local)
    busy = [False] * n_groups
    owner: dict[int, tuple[int, float]] = {}  # id -> (group, submit time)
    lat = np.empty(requests)
    finished = submitted = failed_count = 0
    clock = time.perf_counter
    t_begin = clock()
    limit = t_begin + deadline
    while finished < requests:
        while (
            submitted < requests
            and len(owner) < concurrency
            and not busy[g := submitted % n_groups]
        ):
            busy[g] = True
            owner[lane.submit(local[g], remote[g])] = (g, clock())
            submitted += 1
        done, failed = lane.poll()
        if done or failed:
            now = clock()
            for ids, is_failure in ((done, False), (failed, True)):
                for tid in ids:
                    g, t0 = owner.pop(tid)
                    busy[g] = False
                    lat[finished] = now - t0
                    finished += 1
                    failed_count += is_failure
        elif clock() > limit:
            lane.cancel(list(owner))  # final: no late byte lands in a slot reused later
            raise CellTimeout(f"{finished}/{requests} requests finished in {deadline}s")
    return clock() - t_begin, lat, failed_count


@dataclass
class _Layout:
    """A cell's slots: request ``g`` reads source ``remote[g]`` into destination ``local[g]``;
    ``dst``/``seeds`` are every destination slot and the content it must receive, in
    group order."""

    local: list[list[int]]
    remote: list[list[int]]
    dst: list[int]
    seeds: list[int]


def _layout(lane: Lane, plan: CellPlan, n_groups: int, rng: np.random.Generator) -> _Layout:
    """Pick the slots of ``n_groups`` groups and fill the source ones (untimed)."""
    need = plan.batch * n_groups
    src = _pick(rng, lane.num_blocks, need, plan.contiguous)
    dst = _pick(rng, lane.num_blocks, need, plan.contiguous)
    seeds = seeds_for(src, plan.block_size)
    lane.fill(src, seeds)
    b = plan.batch
    return _Layout(
        local=[dst[g * b : (g + 1) * b] for g in range(n_groups)],
        remote=[src[g * b : (g + 1) * b] for g in range(n_groups)],
        dst=dst,
        seeds=seeds,
    )


def _rep(
    lane: Lane, plan: CellPlan, layout: _Layout, requests: int, result: CellResult
) -> tuple[float, np.ndarray, str]:
    """One repetition of ``requests`` reads, then the byte check of the slots it read into.

    Adds to ``result``'s byte counts; returns (wall seconds, latencies, error or "")."""
    used = min(requests, len(layout.local))
    lane.begin_rep()
    try:
        wall, lat, failed = _run_rep(
            lane,
            layout.local[:used],
            layout.remote[:used],
            requests=requests,
            concurrency=plan.concurrency,
            deadline=plan.deadline,
        )
    finally:  # a broken source side explains a timeout better than the timeout does
        source_failures = lane.end_rep()
    n = used * plan.batch
    bad = lane.verify(layout.dst[:n], layout.seeds[:n])
    request_bytes = plan.batch * plan.block_size
    result.bytes_moved += requests * request_bytes
    if failed or bad or source_failures:
        return (
            wall,
            lat,
            (
                f"{failed} failed reads, {len(bad)} wrong blocks, "
                f"{source_failures} failures on the source side"
            ),
        )
    result.bytes_verified += used * request_bytes
    return wall, lat, ""


def _timed_requests(plan: CellPlan, warmup_latencies: np.ndarray) -> int:
    """Requests per timed repetition: ``plan.requests``, capped at about ``rep_seconds``
    by the warm-up's median latency, never below 2 per in-flight slot."""
    per_request = float(np.median(warmup_latencies)) / plan.concurrency
    if per_request <= 0:
        return plan.requests
    fit = math.ceil(plan.rep_seconds / per_request)
    return max(min(plan.requests, 2 * plan.concurrency), min(plan.requests, fit))


def _summarize(result: CellResult, latencies: Sequence[np.ndarray], errors: list[str]) -> None:
    """Fill ``result``'s rates (from ``rep_gbps``), latency percentiles and verdict."""
    rates = np.array(result.rep_gbps)
    pooled = np.concatenate(latencies) * 1e6
    result.gbps = float(np.median(rates))
    result.gbps_min = float(rates.min())
    result.gbps_max = float(rates.max())
    result.p50_us = float(np.percentile(pooled, 50))
    result.p99_us = float(np.percentile(pooled, 99))
    result.mean_us = float(pooled.mean())
    result.error = "; ".join(errors)
    result.verified = not errors


def measure_cell(lane: Lane, plan: CellPlan, rng: np.random.Generator) -> CellResult:
    """Run ``plan`` on an opened ``lane``; never raises for transfer or byte failures.

    A cell that does not fit the region is returned with ``skipped`` set, unmeasured."""
    spec = lane.spec
    result = CellResult(
        series=spec.label,
        impl=spec.impl,
        transport=spec.transport,
        block_size=plan.block_size,
        batch=plan.batch,
        concurrency=plan.concurrency,
        requests=plan.requests,
        reps=plan.reps,
    )
    n_groups = plan.groups_within(lane.num_blocks)
    if n_groups == 0:
        result.skipped = (
            f"needs {plan.batch * plan.concurrency} blocks per side, region holds {lane.num_blocks}"
        )
        return result
    layout = _layout(lane, plan, n_groups, rng)
    errors: list[str] = []
    timed = plan.requests
    for i in range(plan.warmup):
        _, lat, error = _rep(
            lane, plan, layout, min(plan.requests, max(8, 4 * plan.concurrency)), result
        )
        errors += [f"warm-up {i}: {error}"] if error else []
        timed = _timed_requests(plan, lat)
    result.requests = timed
    latencies: list[np.ndarray] = []
    request_bytes = plan.batch * plan.block_size
    for i in range(plan.reps):
        wall, lat, error = _rep(lane, plan, layout, timed, result)
        errors += [f"rep {i}: {error}"] if error else []
        result.rep_gbps.append(timed * request_bytes / wall / 1e9)
        latencies.append(lat)
    _summarize(result, latencies, errors)
    return result
