"""The data-plane matrix: series x block sizes x blocks per request x concurrency, one run.

For each block size every series is opened side by side (one target child holds the
receiving endpoints of all cross-process series), then each (batch, concurrency) cell is run
on every series back to back, so the series of a cell are measured minutes apart at most,
not a whole run apart. Ratios are computed per cell: to the raw library of the same
transport, and to memcpy of the same blocks (concurrency 1: memcpy is one thread).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from p2pkv.bench.endpoints import SeriesSpec
from p2pkv.bench.lanes import EndpointLane, Lane, MemcpyLane
from p2pkv.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv.bench.target import LocalTarget, RemoteTarget, page_in
from p2pkv.registry import Registry

__all__ = ["MatrixConfig", "available_series", "run_matrix"]

log = logging.getLogger(__name__)

KiB = 1024
MiB = 1024 * KiB


@dataclass(frozen=True)
class MatrixConfig:
    block_sizes: tuple[int, ...] = (64 * KiB, 256 * KiB, 1 * MiB, 4 * MiB)
    batches: tuple[int, ...] = (1, 4, 16, 64, 256)
    concurrency: tuple[int, ...] = (1, 4)
    reps: int = 5
    warmup: int = 1
    bytes_per_rep: int = 256 * MiB
    max_requests: int = 2000
    region_bytes: int = 1024 * MiB
    transports: tuple[str, ...] | None = None
    """p2pkv data transports to run (None: every available one)."""
    raw: bool = True
    memcpy: bool = True
    contiguous: bool = False
    seed: int = 0
    deadline: float = 60.0

    def requests_for(self, block_size: int, batch: int, concurrency: int) -> int:
        per_request = block_size * batch
        wanted = math.ceil(self.bytes_per_rep / per_request)
        return max(2 * concurrency, min(wanted, self.max_requests))


def available_series(
    registry: Registry, config: MatrixConfig
) -> tuple[list[SeriesSpec], dict[str, str]]:
    """The series this host can run, and why the others cannot (label -> reason)."""
    series: list[SeriesSpec] = []
    skipped: dict[str, str] = {}
    wanted = config.transports
    for name, entry in sorted(registry.entries("data").items()):
        if wanted is not None and name not in wanted:
            continue
        problem = entry.cls.availability()
        if problem is not None:
            skipped[f"p2pkv {name}"] = str(problem)
            continue
        series.append(SeriesSpec("p2pkv", name, entry.cls.capabilities.cross_process))
    if wanted is not None:
        for name in wanted:
            if name not in registry.entries("data"):
                skipped[f"p2pkv {name}"] = "not installed"
    if config.raw:
        for name, cls in sorted(registry.bench_baselines().items()):
            if wanted is not None and name not in wanted:
                continue
            problem = cls.availability() if hasattr(cls, "availability") else None
            if problem is not None:
                skipped[f"raw {name}"] = str(problem)
                continue
            caps = getattr(cls, "capabilities", None)
            series.append(SeriesSpec("raw", name, getattr(caps, "cross_process", True)))
    if config.memcpy:
        series.append(SeriesSpec("memcpy", "memcpy", cross_process=False))
    return series, skipped


def _add_ratios(results: Sequence[CellResult]) -> None:
    def key(r: CellResult, impl: str, transport: str, conc: int) -> tuple[object, ...]:
        return (impl, transport, r.block_size, r.batch, conc)

    by_key = {key(r, r.impl, r.transport, r.concurrency): r for r in results if r.gbps > 0}
    for r in results:
        if r.gbps <= 0:
            continue
        raw = by_key.get(key(r, "raw", r.transport, r.concurrency))
        if r.impl == "p2pkv" and raw is not None:
            r.ratio_raw = r.gbps / raw.gbps
        memcpy = by_key.get(key(r, "memcpy", "memcpy", 1))
        if memcpy is not None and r.impl != "memcpy":
            r.ratio_memcpy = r.gbps / memcpy.gbps


def run_matrix(
    registry: Registry,
    config: MatrixConfig,
    series: Sequence[SeriesSpec],
    on_cell: Callable[[CellResult], None] = lambda r: None,
) -> list[CellResult]:
    """Run every cell on every series; a series that fails to open is reported per cell."""
    rng = np.random.default_rng(config.seed)
    source = page_in(config.region_bytes)
    remote = RemoteTarget(config.region_bytes) if any(s.cross_process for s in series) else None
    local = LocalTarget(config.region_bytes) if any(not s.cross_process for s in series) else None
    results: list[CellResult] = []
    try:
        for block_size in config.block_sizes:
            lanes: dict[str, Lane] = {}
            open_errors: dict[str, str] = {}
            for spec in series:
                lane: Lane
                if spec.impl == "memcpy":
                    assert local is not None
                    lane = MemcpyLane(source, local.state.buf)
                else:
                    target = remote if spec.cross_process else local
                    assert target is not None
                    lane = EndpointLane(spec, registry, source, target)
                try:
                    lane.open(block_size)
                    lanes[spec.label] = lane
                except Exception as exc:
                    log.warning("%s at %d B: open failed: %s", spec.label, block_size, exc)
                    open_errors[spec.label] = f"open failed: {type(exc).__name__}: {exc}"
            for batch in config.batches:
                for conc in config.concurrency:
                    plan = CellPlan(
                        block_size=block_size,
                        batch=batch,
                        concurrency=conc,
                        requests=config.requests_for(block_size, batch, conc),
                        reps=config.reps,
                        warmup=config.warmup,
                        contiguous=config.contiguous,
                        deadline=config.deadline,
                    )
                    for spec in series:
                        if spec.impl == "memcpy" and conc != 1:
                            continue
                        result = _one_cell(spec, lanes.get(spec.label), plan, rng, open_errors)
                        results.append(result)
                        on_cell(result)
            for lane in lanes.values():
                try:
                    lane.close()
                except Exception as exc:
                    log.warning("%s: close failed: %s", lane.spec.label, exc)
    finally:
        if remote is not None:
            remote.shutdown()
        if local is not None:
            local.shutdown()
    _add_ratios(results)
    return results


def _one_cell(
    spec: SeriesSpec,
    lane: Lane | None,
    plan: CellPlan,
    rng: np.random.Generator,
    open_errors: dict[str, str],
) -> CellResult:
    if lane is None:
        return CellResult(
            series=spec.label, impl=spec.impl, transport=spec.transport,
            block_size=plan.block_size, batch=plan.batch, concurrency=plan.concurrency,
            error=open_errors.get(spec.label, "not opened"),
        )
    try:
        return measure_cell(lane, plan, rng)
    except Exception as exc:
        log.warning("%s cell %s failed: %s", spec.label, plan, exc)
        return CellResult(
            series=spec.label, impl=spec.impl, transport=spec.transport,
            block_size=plan.block_size, batch=plan.batch, concurrency=plan.concurrency,
            error=f"{type(exc).__name__}: {exc}",
        )
