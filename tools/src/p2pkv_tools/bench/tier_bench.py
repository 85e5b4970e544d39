"""``p2pkv bench --tier``: submit_load to the result through two real tiers, next to the raw
library and memcpy measured in the same run.

Per data transport (default ``nixl``; it and the control transport, default ``zmq``, must
cross processes), per block size a producer and a consumer tier are started
(:class:`~p2pkv_tools.bench.tier_lane.TierLane`), and every (blocks per request, concurrency) cell
is timed in both arrival orders by the data bench's runner. The raw baseline of the same
library (progress thread off; for nixl both ``raw nixl``, a READ posted by the reader, and
``raw nixl write``, a WRITE posted by the source when the reader asks) and memcpy run first,
over the same matrix, through the data bench (:func:`p2pkv_tools.bench.matrix.run_matrix`); each
tier cell's ratios are against the fastest raw cell (:func:`p2pkv_tools.bench.matrix.raw_by_cell`)
and the memcpy cell (concurrency 1) of the same block size and blocks per request.

With ``--netns`` (optionally ``--rate``) every cross-process side — both tiers, and the raw
baseline's reader and target — runs at an end of one veth link between two network
namespaces, UCX over TCP (:mod:`p2pkv_tools.bench.netns`), so tier and raw cross the same link.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
from p2pkv.cli import usable_transport
from p2pkv.config import Flow
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry
from rich.console import Console
from rich.markup import escape

from p2pkv_tools.bench.matrix import MatrixConfig, available_series, memcpy_by_cell, raw_by_cell
from p2pkv_tools.bench.netns import Link, check_tools
from p2pkv_tools.bench.report import format_size
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.tier_lane import ORDERS, TierLane
from p2pkv_tools.demo.presets import ModelPreset, resolve_preset

__all__ = [
    "OVERLOAD_FACTOR",
    "TIER_FLAGS",
    "TierCellResult",
    "TierPlan",
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
    """GB/s over each raw baseline measured in this cell, by its series label."""


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


def _add_ratios(rows: Sequence[TierCellResult], baselines: Sequence[CellResult]) -> None:
    """Each measured tier row's ratios: to every raw baseline of its cell (``ratios_raw``),
    ``ratio_raw`` to the fastest of them (named in ``raw_series``), and to memcpy."""
    raws, memcpy = raw_by_cell(baselines), memcpy_by_cell(baselines)
    for r in rows:
        if r.gbps <= 0:
            continue
        cell = raws.get((r.transport, r.block_size, r.batch, r.concurrency), [])
        r.ratios_raw = {raw.series: r.gbps / raw.gbps for raw in cell}
        r.raw_series = cell[0].series if cell else None
        r.ratio_raw = r.ratios_raw[cell[0].series] if cell else None
        base = memcpy.get((r.block_size, r.batch))
        r.ratio_memcpy = r.gbps / base.gbps if base else None


OVERLOAD_FACTOR = 4
"""Requests an overload cell offers at once, in units of the tier's ``flow.window_rounds``."""


def overload_concurrency() -> int:
    """How many requests an overload cell keeps in flight (the default flow window x4)."""
    return OVERLOAD_FACTOR * Flow().window_rounds


def measure_tier(
    config: MatrixConfig,
    plan: TierPlan,
    baselines: Sequence[CellResult],
    notes: Console,
    link: Link | None = None,
) -> list[TierCellResult]:
    """Every tier cell of every data transport, both orders (and with ``plan.overload`` an
    overload cell per block size and batch, stores first), with ratios to ``baselines``;
    the two sides across ``link`` when given.

    A lane that cannot start fails its block size's cells (``error``); the run goes on."""
    rows: list[TierCellResult] = []
    timeout = config.deadline * (config.reps + config.warmup + 2)
    started = time.time()
    for data in plan.data:
        lane = TierLane(
            plan.control, data, config.region_bytes, timeout, config.options_for(data), link
        )
        try:
            for block in config.block_sizes:
                rows += _block_rows(lane, config, plan, block, notes, started)
        finally:
            lane.close()  # also when interrupted: the sides end before their namespaces do
    _add_ratios(rows, baselines)
    return rows


def _block_rows(
    lane: TierLane, config: MatrixConfig, plan: TierPlan, block: int, notes: Console, started: float
) -> list[TierCellResult]:
    """The cells of one block size on ``lane``, opened here (when it cannot start, every
    cell fails with the reason), each reported on ``notes`` as it ends."""
    data = lane.spec.transport
    try:
        lane.open(block)
        opened = ""
    except Exception as exc:
        opened = f"tier sides failed to start: {type(exc).__name__}: {exc}"
    rows = []
    for batch in config.batches:
        for cell, order, overload in _cells(config, plan, block, batch):
            row = (
                _tier_cell(lane, cell, order, [config.seed, block, batch, cell.concurrency])
                if not opened
                else TierCellResult(
                    series=f"tier {data} {order}",
                    impl="tier",
                    transport=data,
                    block_size=block,
                    batch=batch,
                    concurrency=cell.concurrency,
                    error=opened,
                    order=order,
                )
            )
            row.overload = overload
            rows.append(row)
            notes.print(
                f"tier {escape(data)} {format_size(block)} x{batch} "
                f"c{cell.concurrency} {order}{' overload' * overload}: "
                f"{row.gbps:.2f} GB/s, {time.time() - started:.0f} s"
            )
    return rows


def _cells(
    config: MatrixConfig, plan: TierPlan, block: int, batch: int
) -> list[tuple[CellPlan, str, bool]]:
    """The cells of one (block size, batch): every concurrency in both orders, then the
    overload cell (stores first: a prefiller ahead of its decoder) when asked for."""
    cells = [
        (_plan(config, block, batch, conc), order, False)
        for conc in config.concurrency
        for order in ORDERS
    ]
    if plan.overload:
        cells.append((_plan(config, block, batch, overload_concurrency()), ORDERS[0], True))
    return cells
