"""``p2pkv bench --tier``: run it, print it, write its JSON and plot (see :mod:`tier_bench`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry
from rich.console import Console
from rich.markup import escape

from p2pkv_tools.bench.hostinfo import describe_host
from p2pkv_tools.bench.matrix import MatrixConfig
from p2pkv_tools.bench.netns import Link, Traffic, open_link
from p2pkv_tools.bench.report import plot, print_tables
from p2pkv_tools.bench.runner import CellResult
from p2pkv_tools.bench.tier_bench import (
    TierCellResult,
    TierPlan,
    check_tier_options,
    measure_tier,
)
from p2pkv_tools.bench.tier_crossover import crossover
from p2pkv_tools.bench.tier_first_pull import FirstPull, measure_first_pulls
from p2pkv_tools.bench.tier_lane import ORDERS, link_control_options
from p2pkv_tools.bench.tier_phases import measure_phases, phase_table, plan_from
from p2pkv_tools.bench.tier_report import (
    link_summary,
    overload_summary,
    print_cost_model,
    print_crossover,
    print_first_pulls,
    print_overload,
    print_tier_table,
)
from p2pkv_tools.bench.tier_side import DESCRIPTORS_STAT

__all__ = ["FIRST_PULL_PAIRS", "run_tier"]

FIRST_PULL_PAIRS = {True: 1, False: 3}
"""Fresh pairs per first-pull kind (cold, pre-connected), by ``--quick``."""
PHASES_CELLS = ((64 * 1024, 2304 * 1024), (1, 32, 256))
"""``--phases``' default block sizes and batches: one 64 KiB block (the fixed cost), and
gpt-oss-120b's 32-token vLLM block (2.25 MiB) x 1, 32 and 256 (8,192 tokens, 576 MiB)."""


def run_tier(
    args: argparse.Namespace, config: MatrixConfig, console: Console, notes: Console
) -> int:
    """The first pulls, then the tier cells beside the raw baselines, on one host or
    (``--netns``) across a veth link built first and removed at the end, however the run
    ends; 1 if a cell or a
    first pull failed or a byte did not verify. Bad options, and a link that cannot be
    built, raise ``ConfigError``/``TransportUnavailable`` before anything runs."""
    plan = check_tier_options(args, config, default_registry())
    with open_link(plan.rate_bits) if plan.netns else nullcontext() as link:
        if args.phases:
            return _run_phases(args, config, plan, link, console, notes)
        return _run(args, config, plan, link, console, notes)


def _run_phases(
    args: argparse.Namespace,
    config: MatrixConfig,
    plan: TierPlan,
    link: Link | None,
    console: Console,
    notes: Console,
) -> int:
    """``--phases`` (:mod:`~p2pkv_tools.bench.tier_phases`): one data transport, the
    matrix's block sizes and batches (defaults: :data:`PHASES_CELLS`); 1 if a cell failed."""
    if len(plan.data) != 1:
        raise ConfigError("--phases profiles one data transport: give one in --transports")
    cells = replace(
        config,
        block_sizes=args.block_sizes or PHASES_CELLS[0],
        batches=args.batches or PHASES_CELLS[1],
    )
    link_doc = link.describe() if link else _one_host_link()
    notes.print(f"link: {escape(link_summary(link_doc))}")
    phases = plan_from(cells, plan.control, plan.data[0], bool(args.quick))
    started = time.time()
    rows = measure_phases(phases, link, lambda line: notes.print(escape(line)))
    doc = {
        "host": describe_host(),
        "link": link_doc,
        "plan": asdict(phases),
        "rows": [row.as_row() for row in rows],
        "elapsed_s": round(time.time() - started, 1),
    }
    if args.json != "-":
        console.print(escape(phase_table(rows)))
    _write(args, doc)
    return 1 if any(row.error for row in rows) else 0


@dataclass
class _Measured:
    """Everything a run measured; ``carried``: bytes over the link per phase (``--netns``)."""

    baselines: list[CellResult]
    unavailable: dict[str, str]
    first: list[FirstPull]
    rows: list[TierCellResult]
    carried: dict[str, int | None]


def _measure_all(
    args: argparse.Namespace,
    config: MatrixConfig,
    plan: TierPlan,
    link: Link | None,
    notes: Console,
) -> _Measured:
    """The first pulls, then the tier cells with the raw baselines and memcpy beside them,
    cell by cell (:func:`~p2pkv_tools.bench.tier_bench.measure_tier`)."""
    traffic = Traffic(link)
    with traffic.phase("first_pull"):
        first = measure_first_pulls(
            config, plan.control, plan.data, FIRST_PULL_PAIRS[bool(args.quick)], link
        )
    run = measure_tier(config, plan, notes, link, traffic)
    for label, why in run.unavailable.items():
        notes.print(f"[yellow]{escape(label)} not measured:[/] {escape(why)}")
    return _Measured(run.baselines, run.unavailable, first, run.rows, traffic.phases)


def _run(
    args: argparse.Namespace,
    config: MatrixConfig,
    plan: TierPlan,
    link: Link | None,
    console: Console,
    notes: Console,
) -> int:
    started = time.time()
    link_doc = link.describe() if link else _one_host_link()
    notes.print(f"link: {escape(link_summary(link_doc))}")
    m = _measure_all(args, config, plan, link, notes)
    elapsed = time.time() - started
    if link:
        link_doc["carried_bytes"] = m.carried
    title = (
        f"p2pkv bench --tier{' --netns' if link else ''} "
        f"({'quick' if args.quick else 'full'}, {elapsed:.0f} s)"
    )
    doc: dict[str, Any] = {
        "host": describe_host(),
        "config": asdict(config),
        "link": link_doc,
        "tier": {
            "control": plan.control,
            "data": list(plan.data),
            "orders": list(ORDERS),
            "descriptors_stat": DESCRIPTORS_STAT,
            "control_options": link_control_options(plan.control, link),
        },
        "baseline_rows": [r.as_row() for r in m.baselines],
        "unavailable": m.unavailable,
        "rows": [r.as_row() for r in m.rows],
        "first_pull": [f.as_row() for f in m.first],
        "verified": bool(m.rows) and all(r.verified for r in m.rows if not r.skipped),
        "crossover": (
            crossover(m.rows, plan.preset, plan.recompute_rate)
            if plan.preset and plan.recompute_rate
            else None
        ),
        "overload": overload_summary(m.rows),
        "elapsed_s": round(elapsed, 1),
    }
    if args.json != "-":
        _print(console, doc, m, title)
    _write(args, doc)
    if args.plot:
        plot([*m.baselines, *m.rows], args.plot, title)
        notes.print(f"plot written to {escape(args.plot)}")
    failed = [r for r in [*m.rows, *m.baselines] if r.error]
    if failed:
        notes.print(
            f"[red]{len(failed)} cells failed or moved bytes that did not verify[/] (see above)"
        )
    return 1 if failed or any(f.errors for f in m.first) else 0


def _one_host_link() -> dict[str, Any]:
    """The JSON's ``link`` without ``--netns``: both sides on this host, UCX as configured."""
    return {
        "kind": "one host",
        "UCX_TLS": os.environ.get("UCX_TLS"),
        "UCX_NET_DEVICES": os.environ.get("UCX_NET_DEVICES"),
    }


def _print(console: Console, doc: dict[str, Any], m: _Measured, title: str) -> None:
    """The report's tables, the link they were measured over first."""
    console.print(f"{title}: {escape(link_summary(doc['link']))}")
    if m.baselines:
        print_tables(console, m.baselines, f"{title}: baselines")
    print_tier_table(console, m.rows, title)
    print_first_pulls(console, m.first)
    if doc["crossover"]:
        print_crossover(console, doc["crossover"])
        print_cost_model(console, doc["crossover"])
    if doc["overload"]:
        print_overload(console, doc["overload"])


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if not args.json:
        return
    text = json.dumps(doc, indent=2, sort_keys=True)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
