"""``p2pkv bench --tier --phases``: where one pull's time goes, and both sides' CPU.

Per block size x blocks per request (``--block-sizes`` x ``--batches``), a fresh producer and
consumer tier (:mod:`~p2pkv_tools.bench.tier_side`, built with ``phases``) run PD requests
one at a time, the store first (the KV is there: what remains is the pull's own cost), over
scattered slots, after a few untimed ones. Each request's ``submit_load`` -> result time is
split at the moments the consumer tier itself reports (its observer hooks, see
:mod:`~p2pkv_tools.bench.tier_phases_side`):

========  ==================================================================================
phase     from -> to
========  ==================================================================================
control   ``submit_load`` -> the data transport's ``read_blocks`` called: the fetch sent and
          crossing, the producer's answer (its tick, the pin, ``ready``), ``ready``
          crossing back, the consumer's tick that reads it
post      inside ``read_blocks`` (on UCX's ``cma`` lane the READ copies there), summed over
          the calls when the load is read in pieces
read      the rest until the tier saw the last read end (on nixl's staged lane: the
          producer's WRITE into the pool and the copy into the slots)
report    read ended -> ``get_finished_jobs`` returned the result
========  ==================================================================================

The phases and each side's process CPU per request are taken over the timed requests,
unprofiled. Then as many requests again run under a cProfile of each driver thread, for its
CPU per request by component (the profile slows Python code: read the shares, not the sum).
Raw NIXL's READ and WRITE of the same blocks (one in flight) run first, in the same run, as
the reference. Every destination byte is checked after the last request.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from p2pkv.addressing import parse_address
from p2pkv.registry import default_registry

from p2pkv_tools.bench.harness import Helper, HelperError
from p2pkv_tools.bench.matrix import MatrixConfig, run_matrix
from p2pkv_tools.bench.netns import Link
from p2pkv_tools.bench.runner import CellResult
from p2pkv_tools.bench.tier_bench import run_baselines
from p2pkv_tools.bench.tier_lane import link_control_options
from p2pkv_tools.bench.tier_side import side_main

__all__ = ["PHASES", "PhaseRow", "PhasesPlan", "measure_phases", "phase_table", "split"]

PHASES = ("control", "post", "read", "report", "total")
PRODUCER, CONSUMER = "producer", "consumer"


@dataclass(frozen=True)
class PhasesPlan:
    """What ``--phases`` runs: the tiers' transports, the cells, requests per cell."""

    control: str
    data: str
    block_sizes: tuple[int, ...]
    batches: tuple[int, ...]
    requests: int = 50
    warmup: int = 5
    region_bytes: int = 1024 * 1024 * 1024
    data_options: Mapping[str, Any] = field(default_factory=dict)
    timeout: float = 60.0
    seed: int = 0

    def region_for(self, nbytes: int) -> int:
        """A side's region for requests of ``nbytes``: ``region_bytes``, or twice the
        request when that is more (its slots are scattered over the region)."""
        return max(self.region_bytes, 2 * nbytes)


@dataclass
class PhaseRow:
    """One cell: phase medians (µs), CPU per request, the raw reference, the check."""

    block_size: int
    batch: int
    requests: int = 0
    phases_us: dict[str, float] = field(default_factory=dict)
    raw_us: dict[str, float] = field(default_factory=dict)
    cpu_us: dict[str, float] = field(default_factory=dict)
    components_us: dict[str, dict[str, float]] = field(default_factory=dict)
    verified: bool = False
    error: str = ""

    @property
    def nbytes(self) -> int:
        return self.block_size * self.batch

    def as_row(self) -> dict[str, Any]:
        return {**asdict(self), "bytes": self.nbytes}


def split(record: Mapping[str, Any]) -> dict[str, float] | None:
    """A finished load's phases in seconds (:data:`PHASES`), from its side's record (submit
    and result times, the phase clock's events); None when no read of it ended. A load read
    in several pieces (a ``ready`` larger than its staging share) posts each in its own
    ``read_blocks`` call: ``post`` sums the calls, ``read`` is the rest between the first
    call and the last read's end."""
    calls = [t for kind, t in record["events"] if kind == "call"]
    posts = [t for kind, t in record["events"] if kind == "posted"]
    ended = [t for kind, t in record["events"] if kind == "ended"]
    if not calls or not ended or len(posts) != len(calls):
        return None
    submitted, result = record["submitted"], record["result"]
    post = sum(b - a for a, b in zip(calls, posts, strict=True))
    return {
        "control": calls[0] - submitted,
        "post": post,
        "read": max(max(ended) - calls[0] - post, 0.0),
        "report": result - max(ended),
        "total": result - submitted,
    }


def _sides(plan: PhasesPlan, row: PhaseRow, link: Link | None) -> list[Helper]:
    """A producer and a consumer side built with ``phases`` (at the link's ends if any)."""
    config = {
        "control": plan.control,
        "data": plan.data,
        "host": "127.0.0.1",
        "port": 0,
        "data_options": dict(plan.data_options),
        "control_options": link_control_options(plan.control, link),
    }
    helpers = []
    for role in (PRODUCER, CONSUMER):
        end = None if link is None else link.source if role == PRODUCER else link.reader
        side_config = config if end is None else {**config, "host": end.address}
        helpers.append(
            Helper(
                side_main,
                (side_config, row.block_size, plan.region_for(row.nbytes), True),
                name=f"p2pkv-bench-phases-{role}",
                daemon=True,
                timeout=plan.timeout,
                placement=end,
            )
        )
    return helpers


def _request(
    producer: Helper,
    consumer: Helper,
    r: int,
    route: tuple[str, int],
    slots: tuple[list[int], list[int]],
    timeout: float,
) -> str:
    """One PD request, store first; its load's outcome (the store waited for too)."""
    remote, local = slots
    producer.call("store", r, remote)
    consumer.call("load", r, *route, local)
    finished = consumer.call("wait", timeout)
    stores = producer.call("wait", timeout, True)
    outcome = finished[0][1] if finished else "no result"
    bad = [o for _, o, _, _ in stores if o != "done"]
    return outcome if outcome != "done" or not bad else f"store {bad[0]}"


def _each(sides: Mapping[str, Helper], op: str, *args: Any) -> dict[str, Any]:
    """``op`` on both sides: role -> reply."""
    return {role: side.call(op, *args) for role, side in sides.items()}


def _timed(
    plan: PhasesPlan,
    sides: Mapping[str, Helper],
    route: tuple[str, int],
    slots: tuple[list[int], list[int]],
    row: PhaseRow,
) -> None:
    """The warm-up, the timed requests (unprofiled: the phases and the CPU per request),
    then as many profiled (the components); their figures into ``row``."""
    consumer = sides[CONSUMER]
    n = plan.requests
    if not _run(plan, sides, route, slots, row, 1, plan.warmup):
        return
    consumer.call("phases")
    cpu = {role: usage[0] for role, usage in _each(sides, "usage").items()}
    if not _run(plan, sides, route, slots, row, plan.warmup + 1, n):
        return
    per = 1e6 / n
    row.cpu_us = {
        role: (usage[0] - cpu[role]) * per for role, usage in _each(sides, "usage").items()
    }
    split_ok = [s for s in map(split, consumer.call("phases")) if s is not None]
    row.requests = len(split_ok)
    row.phases_us = {p: statistics.median(s[p] for s in split_ok) * 1e6 for p in PHASES}
    _each(sides, "profile", True)
    if not _run(plan, sides, route, slots, row, plan.warmup + n + 1, n):
        return
    row.components_us = {
        role: {k: v * per for k, v in seconds.items()}
        for role, seconds in _each(sides, "profile", False).items()
    }


def _run(
    plan: PhasesPlan,
    sides: Mapping[str, Helper],
    route: tuple[str, int],
    slots: tuple[list[int], list[int]],
    row: PhaseRow,
    first: int,
    count: int,
) -> bool:
    """Requests ``first`` .. ``first + count - 1``, one at a time; False (``row.error`` set)
    at the first that fails."""
    for r in range(first, first + count):
        outcome = _request(sides[PRODUCER], sides[CONSUMER], r, route, slots, plan.timeout)
        if outcome != "done":
            row.error = f"request {r}: {outcome}"
            return False
    return True


def _cell(plan: PhasesPlan, row: PhaseRow, link: Link | None) -> None:
    """Run one cell into ``row`` (``error`` set instead of raising on a side's failure)."""
    sides = dict(zip((PRODUCER, CONSUMER), _sides(plan, row, link), strict=True))
    producer, consumer = sides[PRODUCER], sides[CONSUMER]
    try:
        described = _each(sides, "describe")
        route = parse_address(described[PRODUCER][0])
        blocks = min(n for _, n in described.values())
        rng = np.random.default_rng(plan.seed)
        slots = (
            rng.choice(blocks, row.batch, replace=False).tolist(),
            rng.choice(blocks, row.batch, replace=False).tolist(),
        )
        seeds = [plan.seed * 1_000_003 + i + 1 for i in range(row.batch)]
        producer.call("fill", slots[0], seeds)
        _timed(plan, sides, route, slots, row)
        if not row.error:
            bad = consumer.call("verify", slots[1], seeds)
            row.verified = not bad
            row.error = f"{len(bad)} block(s) with wrong bytes" if bad else ""
    except HelperError as exc:
        row.error = str(exc)
    finally:
        for side in reversed(list(sides.values())):
            side.stop()


def _raw(plan: PhasesPlan, link: Link | None) -> dict[tuple[int, int], dict[str, float]]:
    """Raw NIXL READ and WRITE (and memcpy on one host) of every cell, one in flight: p50
    µs per series, by (block size, batch)."""
    largest = max(plan.block_sizes) * max(plan.batches)
    config = MatrixConfig(
        block_sizes=plan.block_sizes,
        batches=plan.batches,
        concurrency=(1,),
        reps=3,
        warmup=1,
        region_bytes=plan.region_for(largest),
        bytes_per_rep=64 * 1024 * 1024,
        memcpy=link is None,
    )
    results: list[CellResult]
    results, _ = run_baselines(
        config, (plan.data,), default_registry(), lambda c, s: run_matrix(c, s, link=link)
    )
    out: dict[tuple[int, int], dict[str, float]] = {}
    for result in results:
        if not result.error:
            out.setdefault((result.block_size, result.batch), {})[result.series] = result.p50_us
    return out


def measure_phases(
    plan: PhasesPlan, link: Link | None = None, progress: Callable[[str], None] = lambda line: None
) -> list[PhaseRow]:
    """Every cell of ``plan``: raw references first, then the tiers (see the module doc)."""
    raw = _raw(plan, link)
    rows = []
    for block in plan.block_sizes:
        for batch in plan.batches:
            row = PhaseRow(block, batch, raw_us=raw.get((block, batch), {}))
            _cell(plan, row, link)
            progress(
                f"{block // 1024} KiB x {batch}: "
                + (row.error or f"total {row.phases_us['total']:.0f} µs")
            )
            rows.append(row)
    return rows


def _top(components: Mapping[str, float], n: int = 4) -> str:
    shown = sorted(((v, k) for k, v in components.items() if k != "thread total"), reverse=True)[:n]
    return ", ".join(f"{k} {v:.0f}" for v, k in shown)


def phase_table(rows: Sequence[PhaseRow]) -> str:
    """The report as a Markdown table (µs; CPU per request; a side's top components)."""
    lines = [
        "| block | blocks | MiB | raw READ / WRITE p50 | tier p50 | control | post | "
        "read | report | CPU/request producer / consumer | consumer thread: top | "
        "producer thread: top |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        raw = " / ".join(
            f"{row.raw_us[k]:.0f}" if k in row.raw_us else "-"
            for k in ("raw nixl", "raw nixl write")
        )
        if row.error:
            lines.append(
                f"| {row.block_size // 1024} KiB | {row.batch} | "
                f"{row.nbytes / 2**20:.1f} | {raw} | FAILED: {row.error} |"
            )
            continue
        ph = row.phases_us
        lines.append(
            f"| {row.block_size // 1024} KiB | {row.batch} | {row.nbytes / 2**20:.1f} | {raw} | "
            + " | ".join(f"{ph[p]:.0f}" for p in ("total", "control", "post", "read", "report"))
            + f" | {row.cpu_us[PRODUCER]:.0f} / {row.cpu_us[CONSUMER]:.0f} | "
            f"{_top(row.components_us[CONSUMER])} | {_top(row.components_us[PRODUCER])} |"
        )
    return "\n".join(lines)


def plan_from(config: MatrixConfig, control: str, data: str, quick: bool) -> PhasesPlan:
    """The plan of ``p2pkv bench --tier --phases``: the matrix's block sizes, batches,
    region and data options; 10 requests per cell with ``--quick``, else 50."""
    plan = PhasesPlan(
        control,
        data,
        config.block_sizes,
        config.batches,
        region_bytes=config.region_bytes,
        data_options=config.options_for(data),
        seed=config.seed,
    )
    return replace(plan, requests=10, warmup=2) if quick else plan
