"""``p2pkv bench --tier``: submit_load to the result through two real tiers, next to the raw
library and memcpy measured in the same run, cell by cell.

Per data transport (default ``nixl``; it and the control transport, default ``zmq``, must
cross processes), per block size a producer and a consumer tier are started
(:class:`~p2pkv_tools.bench.tier_lane.TierLane`) beside the data bench's groups of the raw
baseline of the same library (progress thread off; for nixl both ``raw nixl``, a READ posted
by the reader, and ``raw nixl write``, a WRITE posted by the source when the reader asks)
and memcpy (:func:`p2pkv_tools.bench.matrix.series_groups`). Every (blocks per request,
concurrency) cell then runs in rounds, raw and tier side by side in each
(:mod:`~p2pkv_tools.bench.tier_rounds`), the tier in both arrival orders. A tier cell's
ratio to a raw series is the median of its rounds' ratios; ``ratio_raw`` is to the fastest
raw series of the cell, and ``ratio_memcpy`` to memcpy (concurrency 1) of the same block
size and blocks per request.

With ``--netns`` (optionally ``--rate``) every cross-process side — both tiers, and the raw
baseline's reader and target — runs at an end of one veth link between two network
namespaces, UCX over TCP (:mod:`p2pkv_tools.bench.netns`), so tier and raw cross the same link.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from p2pkv.cli import usable_transport
from p2pkv.config import Flow
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry, default_registry
from rich.console import Console
from rich.markup import escape

from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.groups import Group
from p2pkv_tools.bench.matrix import (
    MatrixConfig,
    add_ratios,
    available_series,
    measure_series,
    memcpy_by_cell,
    open_all,
    series_groups,
)
from p2pkv_tools.bench.netns import Link, Traffic, check_tools
from p2pkv_tools.bench.report import format_size
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.tier_lane import ORDERS, TierLane
from p2pkv_tools.bench.tier_rounds import (
    Step,
    cell_steps,
    merge_rounds,
    pair_ratios,
    reps_per_round,
)
from p2pkv_tools.demo.presets import ModelPreset, resolve_preset

__all__ = [
    "OVERLOAD_FACTOR",
    "TIER_FLAGS",
    "TierCellResult",
    "TierPlan",
    "TierRun",
    "check_tier_options",
    "measure_tier",
    "overload_concurrency",
    "run_baselines",
    "tier_requested",
]

TIER_FLAGS = {
    "tier_control": "--tier-control",
    "recompute_rate": "--recompute-rate",
    "preset": "--preset",
    "tp": "--tp",
    "overload": "--overload",
    "netns": "--netns",
    "rate": "--rate",
    "phases": "--phases",
}
"""Options that only ``--tier`` reads (argparse dest -> flag)."""


@dataclass
class TierCellResult(CellResult):
    """One row of ``p2pkv bench --tier --json``: a data-bench row (``impl`` ``tier``, the
    consumer's submit_load -> result latency) plus the arrival order and the cost per
    request on each side (process CPU time over the timed repetitions' requests)."""

    order: str = ""
    overload: bool = False
    """An overload cell: more requests offered at once than the flow window holds."""
    producer_cpu_us: float = 0.0
    consumer_cpu_us: float = 0.0
    descriptors_per_request: float | None = None
    """From the consumer tier's ``descriptors_posted`` stat; None when the tier has none."""
    raw_series: str | None = None
    """The raw baseline ``ratio_raw`` is against: the fastest in this cell (``raw nixl`` or
    ``raw nixl write``); None without one."""
    ratios_raw: dict[str, float] = field(default_factory=dict)
    """GB/s over each raw baseline measured in this cell, by its series label: the median
    of ``pair_ratios``."""
    pair_ratios: dict[str, list[float]] = field(default_factory=dict)
    """Per raw series, this row's GB/s over the series' in each round of the cell."""


@dataclass(frozen=True)
class TierPlan:
    """What ``--tier`` runs, validated."""

    control: str
    data: tuple[str, ...]
    preset: ModelPreset | None
    recompute_rate: float | None
    overload: bool = False
    netns: bool = False
    """Both sides (and the raw baseline's) in network namespaces joined by a veth."""
    rate_bits: int | None = None
    """``--rate``: the veth shaped to this many bits/s each way."""


def tier_requested(args: argparse.Namespace) -> bool:
    """``--tier`` or an option only it reads was given (:func:`check_tier_options` then
    refuses the latter without the former)."""
    return bool(args.tier) or any(getattr(args, d) is not None for d in TIER_FLAGS)


def check_tier_options(
    args: argparse.Namespace, config: MatrixConfig, registry: Registry
) -> TierPlan:
    """The tier plan, or ``ConfigError``/``TransportUnavailable`` naming the flag to fix."""
    if not args.tier:
        used = next(flag for dest, flag in TIER_FLAGS.items() if getattr(args, dest) is not None)
        raise ConfigError(f"{used} is an option of the tier bench: add --tier")
    if args.control:
        raise ConfigError("--tier and --control are two benchmarks: give one of them")
    name = args.tier_control or "zmq"
    control = usable_transport(registry, "control", name)
    if not control.capabilities.cross_process:
        raise ConfigError(
            f"--tier-control {name} is process-local: the tier bench runs "
            "two processes; use a cross-process one such as zmq"
        )
    data = config.transports or ("nixl",)
    for transport in data:
        if not usable_transport(registry, "data", transport).capabilities.cross_process:
            raise ConfigError(
                f"--transports {transport} is process-local: the tier bench runs "
                "two processes; use a cross-process one such as nixl"
            )
    _check_link_options(args)
    preset = None
    if args.recompute_rate is not None:
        preset = resolve_preset(args.preset or "llama-3-8b", tp=args.tp)
    elif args.preset is not None or args.tp is not None:
        flag = "--preset" if args.preset is not None else "--tp"
        raise ConfigError(
            f"{flag} needs --recompute-rate TOKENS_PER_S (the crossover "
            "compares pulling with recomputing)"
        )
    return TierPlan(
        name, data, preset, args.recompute_rate, bool(args.overload), bool(args.netns), args.rate
    )


def _check_link_options(args: argparse.Namespace) -> None:
    """``--rate`` only with ``--netns``; ``--netns`` only as root with iproute2
    (``ConfigError`` naming the flag or what is missing)."""
    if args.rate is not None and not args.netns:
        raise ConfigError(
            "--rate shapes the link of --netns: add --netns (on one host "
            "the sides share memory, there is no link to shape)"
        )
    if args.netns:
        check_tools(shaped=args.rate is not None)


def run_baselines(
    config: MatrixConfig,
    data: Sequence[str],
    registry: Registry,
    measure: Callable[[MatrixConfig, list[Any]], list[CellResult]],
) -> tuple[list[CellResult], dict[str, str]]:
    """Raw baselines of ``data`` and memcpy over ``config``'s matrix (``measure`` runs it);
    (results, label -> why a series could not run)."""
    base = replace(config, transports=tuple(data))
    series, unavailable = available_series(registry, base)
    series = [s for s in series if s.impl != "p2pkv"]
    return (measure(base, series) if series else []), unavailable


def _plan(config: MatrixConfig, block: int, batch: int, conc: int) -> CellPlan:
    return CellPlan(
        block_size=block,
        batch=batch,
        concurrency=conc,
        requests=config.requests_for(block, batch, conc),
        reps=config.reps,
        warmup=config.warmup,
        contiguous=config.contiguous,
        deadline=config.deadline,
        rep_seconds=config.rep_seconds,
    )


def _tier_cell(lane: TierLane, plan: CellPlan, order: str, seed: list[int]) -> TierCellResult:
    """One cell in one arrival order, with the consumer's latencies and both sides' CPU."""
    lane.reset(order)
    try:
        base = measure_cell(lane, plan, np.random.default_rng(seed))
    except Exception as exc:  # a side died: the cell fails, the run goes on
        base = CellResult(
            series="",
            impl="tier",
            transport=lane.spec.transport,
            block_size=plan.block_size,
            batch=plan.batch,
            concurrency=plan.concurrency,
            error=f"{type(exc).__name__}: {exc}",
        )
    row = TierCellResult(
        **{**asdict(base), "series": f"tier {lane.spec.transport} {order}"}, order=order
    )
    lat = lane.latencies(plan.reps) * 1e6
    if lat.size:
        row.p50_us, row.p99_us = (float(v) for v in np.percentile(lat, [50, 99]))
        row.mean_us = float(lat.mean())
    usage = lane.usage(plan.reps)
    requests = sum(u.requests for u in usage)
    if requests and not base.skipped:
        row.producer_cpu_us = sum(u.producer_cpu_s for u in usage) / requests * 1e6
        row.consumer_cpu_us = sum(u.consumer_cpu_s for u in usage) / requests * 1e6
        counts = [u.descriptors for u in usage]
        if all(c is not None for c in counts):
            row.descriptors_per_request = sum(c or 0 for c in counts) / requests
    return row


OVERLOAD_FACTOR = 4
"""Requests an overload cell offers at once, in units of the tier's ``flow.window_rounds``."""


def overload_concurrency() -> int:
    """How many requests an overload cell keeps in flight (the default flow window x4)."""
    return OVERLOAD_FACTOR * Flow().window_rounds


def measure_tier(
    config: MatrixConfig,
    plan: TierPlan,
    notes: Console,
    link: Link | None = None,
    traffic: Traffic | None = None,
) -> TierRun:
    """Every tier cell of every data transport, both orders (and with ``plan.overload`` an
    overload cell per block size and batch, stores first), interleaved with the raw
    baselines and memcpy of the same cell (:mod:`~p2pkv_tools.bench.tier_rounds`); the
    cross-process sides across ``link`` when given, their bytes counted in ``traffic``'s
    ``baselines`` and ``tier`` phases.

    A lane that cannot start fails its block size's cells (``error``); the run goes on."""
    run = TierRun([], {}, [])
    traffic = traffic or Traffic(None)
    registry = default_registry()
    started = time.time()
    for i, data in enumerate(plan.data):
        base = replace(config, transports=(data,), memcpy=config.memcpy and i == 0)
        series, unavailable = available_series(registry, base)
        run.unavailable.update(unavailable)
        cells = _TransportCells(
            base, plan, [s for s in series if s.impl != "p2pkv"], notes, traffic, started
        )
        groups = series_groups(base, cells.series, link)
        lane = TierLane(
            plan.control, data, config.region_bytes, cells.timeout, config.options_for(data), link
        )
        try:
            for block in config.block_sizes:
                cells.block(groups, lane, block, run)
        finally:  # also when interrupted: the sides end before their namespaces do
            lane.close()
            for g in groups:
                g.shutdown()
    add_ratios(run.baselines)
    memcpy = memcpy_by_cell(run.baselines)
    for r in run.rows:
        base_row = memcpy.get((r.block_size, r.batch))
        r.ratio_memcpy = r.gbps / base_row.gbps if base_row and r.gbps > 0 else None
    return run


@dataclass
class TierRun:
    """What :func:`measure_tier` measured: the raw and memcpy rows (rounds merged), the
    series that could not run (label -> why), and the tier rows."""

    baselines: list[CellResult]
    unavailable: dict[str, str]
    rows: list[TierCellResult]


@dataclass
class _TransportCells:
    """Runs one data transport's cells, a block size at a time, on its opened groups and
    tier lane, and reports each row on ``notes`` as its cell ends."""

    config: MatrixConfig
    plan: TierPlan
    series: list[SeriesSpec]
    notes: Console
    traffic: Traffic
    started: float

    @property
    def timeout(self) -> float:
        return self.config.deadline * (self.config.reps + self.config.warmup + 2)

    def block(self, groups: Sequence[Group], lane: TierLane, block: int, run: TierRun) -> None:
        """Open ``groups`` and ``lane`` for ``block`` (a lane that cannot start fails every
        tier cell with the reason), then every cell of that block size."""
        owner = {s.label: g for g in groups for s in g.series}
        open_errors = open_all(groups, block)
        try:
            lane.open(block)
            opened = ""
        except Exception as exc:
            opened = f"tier sides failed to start: {type(exc).__name__}: {exc}"
        for batch in self.config.batches:
            for conc in self.config.concurrency:
                self._cell(
                    owner, open_errors, lane, opened, _plan(self.config, block, batch, conc), run
                )
            if self.plan.overload:
                cell = _plan(self.config, block, batch, overload_concurrency())
                (row,) = self._tier_rounds(
                    lane, opened, cell, [Step("tier", ORDERS[0], cell.concurrency, 0)]
                )
                row.overload = True
                run.rows.append(row)
                self._note(row)
        for g in groups:
            try:
                g.close()
            except Exception as exc:
                labels = ", ".join(s.label for s in g.series)
                self.notes.print(f"[yellow]closing {escape(labels)}:[/] {escape(str(exc))}")

    def _cell(
        self,
        owner: Mapping[str, Group],
        open_errors: Mapping[str, str],
        lane: TierLane,
        opened: str,
        cell: CellPlan,
        run: TierRun,
    ) -> None:
        """One cell's rounds, then its merged rows, each tier row's ratios from the pairs."""
        raw = [s for s in self.series if s.impl == "raw"]
        steps = cell_steps(
            cell.concurrency,
            [s.label for s in raw],
            ORDERS,
            memcpy=any(s.impl == "memcpy" for s in self.series),
        )
        rounds = 1 + max(s.round for s in steps)
        parts = replace(cell, reps=reps_per_round(cell.reps, rounds))
        seed = (self.config.seed, cell.block_size, cell.batch, cell.concurrency)
        measured: dict[str, list[CellResult]] = {}
        tier: dict[str, list[TierCellResult]] = {}
        spec = {s.label: s for s in self.series}
        for step in steps:
            if step.kind == "tier":
                tier.setdefault(step.label, []).extend(
                    self._tier_rounds(lane, opened, parts, [step])
                )
                continue
            with self.traffic.phase("baselines"):
                result = measure_series(
                    owner[step.label], spec[step.label], parts, seed, open_errors
                )
            measured.setdefault(step.label, []).append(result)
        for results in measured.values():
            run.baselines.append(merge_rounds(results))
            self._note(run.baselines[-1])
        raws = {s.label: measured[s.label] for s in raw}
        for order_rows in tier.values():
            row = merge_rounds(order_rows)
            _pair(row, order_rows, raws)
            run.rows.append(row)
            self._note(row)

    def _tier_rounds(
        self, lane: TierLane, opened: str, cell: CellPlan, steps: Sequence[Step]
    ) -> list[TierCellResult]:
        """The tier rows of ``steps`` (arrival orders) on ``lane``, or failed rows naming
        why the lane did not open."""
        rows = []
        seed = [self.config.seed, cell.block_size, cell.batch, cell.concurrency]
        for step in steps:
            if opened:
                rows.append(_failed_tier_row(lane, cell, step.label, opened))
                continue
            with self.traffic.phase("tier"):
                rows.append(_tier_cell(lane, cell, step.label, seed))
        return rows

    def _note(self, row: CellResult) -> None:
        overload = " overload" * bool(getattr(row, "overload", False))
        ratio = row.ratio_raw
        self.notes.print(
            f"{escape(row.series)} {format_size(row.block_size)} x{row.batch} "
            f"c{row.concurrency}{overload}: {row.gbps:.2f} GB/s"
            + (f", {ratio:.2f}x raw" if row.impl == "tier" and ratio is not None else "")
            + f", {time.time() - self.started:.0f} s"
        )


def _failed_tier_row(lane: TierLane, cell: CellPlan, order: str, error: str) -> TierCellResult:
    data = lane.spec.transport
    return TierCellResult(
        series=f"tier {data} {order}",
        impl="tier",
        transport=data,
        block_size=cell.block_size,
        batch=cell.batch,
        concurrency=cell.concurrency,
        error=error,
        order=order,
    )


def _pair(
    row: TierCellResult, rounds: Sequence[TierCellResult], raws: Mapping[str, Sequence[CellResult]]
) -> None:
    """``row``'s ratios from its rounds paired with the raw series' rounds: per series the
    median of the pairs (``ratios_raw``), ``ratio_raw`` the lowest of them (the fastest
    raw way, named in ``raw_series``), every pair kept in ``pair_ratios``."""
    row.pair_ratios = pair_ratios(rounds, raws)
    row.ratios_raw = {s: float(np.median(p)) for s, p in row.pair_ratios.items()}
    if row.ratios_raw:
        row.raw_series = min(row.ratios_raw, key=lambda s: row.ratios_raw[s])
        row.ratio_raw = row.ratios_raw[row.raw_series]
