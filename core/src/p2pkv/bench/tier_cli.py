"""``p2pkv bench --tier``: run it, print it, write its JSON and plot (see :mod:`tier_bench`)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from typing import Any

from rich.console import Console
from rich.markup import escape

from p2pkv.bench.hostinfo import describe_host
from p2pkv.bench.matrix import MatrixConfig
from p2pkv.bench.report import plot, print_tables
from p2pkv.bench.tier_bench import check_tier_options, measure_tier, run_baselines
from p2pkv.bench.tier_crossover import crossover
from p2pkv.bench.tier_first_pull import measure_first_pulls
from p2pkv.bench.tier_lane import ORDERS
from p2pkv.bench.tier_report import (
    overload_summary,
    print_cost_model,
    print_crossover,
    print_first_pulls,
    print_overload,
    print_tier_table,
)
from p2pkv.bench.tier_side import DESCRIPTORS_STAT
from p2pkv.registry import default_registry

__all__ = ["FIRST_PULL_PAIRS", "run_tier"]

FIRST_PULL_PAIRS = {True: 1, False: 3}
"""Fresh pairs per first-pull kind (cold, pre-connected), by ``--quick``."""


def run_tier(args: argparse.Namespace, config: MatrixConfig, console: Console,
             notes: Console) -> int:
    """Baselines, the first pulls, then the tier cells; 1 if a cell or a first pull failed or
    a byte did not verify. Bad options raise ``ConfigError``/``TransportUnavailable`` before
    anything runs."""
    from p2pkv.bench.cli import _measure  # the data bench's progress display

    registry = default_registry()
    plan = check_tier_options(args, config, registry)
    started = time.time()
    baselines, unavailable = run_baselines(
        config, plan.data, registry, lambda c, s: _measure(notes, c, s))
    for label, why in unavailable.items():
        notes.print(f"[yellow]{escape(label)} not measured:[/] {escape(why)}")
    first = measure_first_pulls(config, plan.control, plan.data,
                                FIRST_PULL_PAIRS[bool(args.quick)])
    rows = measure_tier(config, plan, baselines, notes)
    elapsed = time.time() - started
    title = f"p2pkv bench --tier ({'quick' if args.quick else 'full'}, {elapsed:.0f} s)"
    cross = (crossover(rows, plan.preset, plan.recompute_rate)
             if plan.preset and plan.recompute_rate else None)
    doc: dict[str, Any] = {
        "host": describe_host(),
        "config": asdict(config),
        "tier": {"control": plan.control, "data": list(plan.data), "orders": list(ORDERS),
                 "descriptors_stat": DESCRIPTORS_STAT},
        "baseline_rows": [r.as_row() for r in baselines],
        "unavailable": unavailable,
        "rows": [r.as_row() for r in rows],
        "first_pull": [f.as_row() for f in first],
        "verified": bool(rows) and all(r.verified for r in rows if not r.skipped),
        "crossover": cross,
        "overload": overload_summary(rows),
        "elapsed_s": round(elapsed, 1),
    }
    if args.json != "-":
        if baselines:
            print_tables(console, baselines, f"{title}: baselines")
        print_tier_table(console, rows, title)
        print_first_pulls(console, first)
        if cross:
            print_crossover(console, cross)
            print_cost_model(console, cross)
        if doc["overload"]:
            print_overload(console, doc["overload"])
    _write(args, doc)
    if args.plot:
        plot([*baselines, *rows], args.plot, title)
        notes.print(f"plot written to {escape(args.plot)}")
    failed = [r for r in [*rows, *baselines] if r.error]
    if failed:
        notes.print(f"[red]{len(failed)} cells failed or moved bytes that did not verify[/] "
                    "(see above)")
    return 1 if failed or any(f.errors for f in first) else 0


def _write(args: argparse.Namespace, doc: dict[str, Any]) -> None:
    if not args.json:
        return
    text = json.dumps(doc, indent=2, sort_keys=True)
    if args.json == "-":
        sys.stdout.write(text + "\n")
    else:
        with open(args.json, "w", encoding="utf-8") as f:
            f.write(text + "\n")
