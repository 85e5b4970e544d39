"""The data-plane matrix: series x block sizes x blocks per request x concurrency, one run.

For each block size every series is opened side by side (see :mod:`p2pkv_tools.bench.groups` for
which process each runs in), then each (batch, concurrency) cell is run on every series back
to back, with the same slot placement, so they are measured seconds apart, not a whole run
apart. Ratios are computed per cell: to the raw library of the same transport (the fastest of
its raw series in that cell, when its baseline has variants: :func:`raw_by_cell`), and to
memcpy of the same blocks (concurrency 1: memcpy is one thread).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv.logs import module_logger
from p2pkv.registry import Registry

from p2pkv_tools.bench.data_transport import RegionSource
from p2pkv_tools.bench.endpoints import SeriesSpec, baseline_variants
from p2pkv_tools.bench.groups import Group, LaneGroup, WorkerGroup, failed_cell
from p2pkv_tools.bench.hostinfo import environ_restored
from p2pkv_tools.bench.netns import Link
from p2pkv_tools.bench.runner import CellPlan, CellResult

__all__ = [
    "CellKey",
    "MatrixConfig",
    "add_ratios",
    "available_series",
    "measure_series",
    "memcpy_by_cell",
    "open_all",
    "raw_by_cell",
    "run_matrix",
    "series_groups",
]

log = module_logger(__name__)

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
    min_requests_per_inflight: int = 2
    """At least this many requests per in-flight slot, however big the requests."""
    region_bytes: int = 1024 * MiB
    transports: tuple[str, ...] | None = None
    """p2pkv data transports to run (None: every available one)."""
    data_options: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    """Transport name -> its ``data_options`` (and its ``allocate_region``'s); none: {}."""
    raw: bool = True
    memcpy: bool = True
    contiguous: bool = False
    seed: int = 0
    deadline: float = 60.0
    rep_seconds: float = 0.5

    def options_for(self, transport: str) -> dict[str, Any]:
        """The ``data_options`` of p2pkv data transport ``transport`` in this run."""
        return dict(self.data_options.get(transport, {}))

    def requests_for(self, block_size: int, batch: int, concurrency: int) -> int:
        per_request = block_size * batch
        wanted = math.ceil(self.bytes_per_rep / per_request)
        return max(self.min_requests_per_inflight * concurrency, min(wanted, self.max_requests))


def available_series(
    registry: Registry, config: MatrixConfig
) -> tuple[list[SeriesSpec], dict[str, str]]:
    """The series this host can run, and why the others cannot (label -> reason).

    Availability checks run with the environment restored afterwards (see
    :func:`p2pkv_tools.bench.hostinfo.environ_restored`)."""
    with environ_restored():
        return _available_series(registry, config)


def _available_series(
    registry: Registry, config: MatrixConfig
) -> tuple[list[SeriesSpec], dict[str, str]]:
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
            if wanted is None or name in wanted:
                series += _raw_series(name, cls, skipped)
    if config.memcpy:
        series.append(SeriesSpec("memcpy", "memcpy", cross_process=False))
    return series, skipped


def _raw_series(name: str, cls: type[Any], skipped: dict[str, str]) -> list[SeriesSpec]:
    """The raw series of baseline ``name``: itself, then each of its ``variants`` (the
    baseline's placement: cross-process unless its ``capabilities`` say otherwise); one that
    cannot run here is added to ``skipped`` with the reason instead."""
    caps = getattr(cls, "capabilities", None)
    cross = getattr(caps, "cross_process", True)
    out = []
    for variant, impl in [("", cls), *sorted(baseline_variants(cls).items())]:
        spec = SeriesSpec("raw", name, cross, variant)
        problem = impl.availability() if hasattr(impl, "availability") else None
        if problem is not None:
            skipped[spec.label] = str(problem)
        else:
            out.append(spec)
    return out


CellKey = tuple[str, int, int, int]
"""(transport, block size, batch, concurrency)."""


def raw_by_cell(results: Sequence[CellResult]) -> dict[CellKey, list[CellResult]]:
    """The raw baselines' measured rows (GB/s above 0) per transport and cell, fastest
    first: a ratio "to raw" is to the first, the fastest way the library moved those blocks
    in that cell (e.g. ``raw nixl``'s READ or ``raw nixl write``'s WRITE)."""
    out: dict[CellKey, list[CellResult]] = {}
    for r in results:
        if r.impl == "raw" and r.gbps > 0:
            out.setdefault((r.transport, r.block_size, r.batch, r.concurrency), []).append(r)
    for rows in out.values():
        rows.sort(key=lambda r: -r.gbps)
    return out


def memcpy_by_cell(results: Sequence[CellResult]) -> dict[tuple[int, int], CellResult]:
    """memcpy's measured rows (concurrency 1, GB/s above 0) by (block size, batch)."""
    return {
        (r.block_size, r.batch): r
        for r in results
        if r.impl == "memcpy" and r.concurrency == 1 and r.gbps > 0
    }


def add_ratios(results: Sequence[CellResult]) -> None:
    """A p2pkv row's ``ratio_raw`` (to the fastest raw series of its transport in the cell);
    every row's but memcpy's ``ratio_memcpy`` (to memcpy at concurrency 1)."""
    raws = raw_by_cell(results)
    memcpy = memcpy_by_cell(results)
    for r in results:
        if r.gbps <= 0:
            continue
        raw = raws.get((r.transport, r.block_size, r.batch, r.concurrency))
        if r.impl == "p2pkv" and raw:
            r.ratio_raw = r.gbps / raw[0].gbps
        base = memcpy.get((r.block_size, r.batch))
        if base is not None and r.impl != "memcpy":
            r.ratio_memcpy = r.gbps / base.gbps


def series_groups(
    config: MatrixConfig, series: Sequence[SeriesSpec], link: Link | None = None
) -> list[Group]:
    """The series of a transport (p2pkv and raw) form a group, in this process when they
    are in-process, else in a worker (with ``link``: the worker at its reader end, the
    worker's target at its source end); memcpy is a group of its own, in this process. A
    group's regions come from its p2pkv transport's ``allocate_region`` (plain memory for
    memcpy and a raw baseline alone)."""
    by_transport: dict[tuple[bool, str], list[SeriesSpec]] = {}
    for s in series:
        by_transport.setdefault((s.cross_process, s.transport), []).append(s)
    timeout = config.deadline * (config.reps + config.warmup + 2)
    groups: list[Group] = []
    try:
        for (remote, name), specs in by_transport.items():
            p2pkv = any(s.impl == "p2pkv" for s in specs)
            source = RegionSource(name if p2pkv else None, config.options_for(name))
            groups.append(
                WorkerGroup(specs, config.region_bytes, source, timeout, link)
                if remote
                else LaneGroup(specs, config.region_bytes, source)
            )
    except Exception:
        for g in groups:
            g.shutdown()
        raise
    return groups


def open_all(groups: Sequence[Group], block_size: int) -> dict[str, str]:
    """Open every group's series for ``block_size``, the groups in parallel; returns
    label -> why a series could not open."""
    open_errors: dict[str, str] = {}
    begun = []
    for g in groups:
        try:
            g.begin_open(block_size)
            begun.append(g)
        except Exception as exc:
            open_errors.update({s.label: str(exc) for s in g.series})
    for g in begun:
        try:
            open_errors.update(g.end_open())
        except Exception as exc:
            open_errors.update({s.label: str(exc) for s in g.series})
    return open_errors


def measure_series(
    group: Group,
    spec: SeriesSpec,
    plan: CellPlan,
    seed: Sequence[int],
    open_errors: Mapping[str, str],
) -> CellResult:
    """``spec``'s cell on its opened ``group``; a failed cell (never raises) when the series
    could not open (``open_errors``) or its measurement raised."""
    if spec.label in open_errors:
        return failed_cell(spec, plan, open_errors[spec.label])
    try:
        return group.measure(spec.label, plan, seed)
    except Exception as exc:
        return failed_cell(spec, plan, f"{type(exc).__name__}: {exc}")


def run_matrix(
    config: MatrixConfig,
    series: Sequence[SeriesSpec],
    on_cell: Callable[[CellResult], None] = lambda r: None,
    link: Link | None = None,
) -> list[CellResult]:
    """Run every cell on every series; a series that fails to open is reported per cell.
    With ``link`` (:mod:`p2pkv_tools.bench.netns`) the cross-process series read over it.

    The series of a cell run back to back with the same slot placement (one seed per cell)."""
    groups = series_groups(config, series, link)
    owner = {s.label: g for g in groups for s in g.series}
    results: list[CellResult] = []
    try:
        for block_size in config.block_sizes:
            open_errors = open_all(groups, block_size)
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
                        rep_seconds=config.rep_seconds,
                    )
                    seed = (config.seed, block_size, batch, conc)
                    for spec in series:
                        if spec.impl == "memcpy" and conc != 1:
                            continue
                        result = measure_series(owner[spec.label], spec, plan, seed, open_errors)
                        results.append(result)
                        on_cell(result)
            for g in groups:
                try:
                    g.close()
                except Exception as exc:
                    log.warning("closing %s: %s", [s.label for s in g.series], exc)
    finally:
        for g in groups:
            g.shutdown()
    add_ratios(results)
    return results
