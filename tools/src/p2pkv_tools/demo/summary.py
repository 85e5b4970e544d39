"""The demo's result: a summary dict (for ``--json``) and its terminal table."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv_tools.demo.orchestrator import RequestRecord

__all__ = ["print_summary", "summarize"]


def summarize(
    records: Sequence[RequestRecord],
    wall_s: float,
    block_len: int,
    side_stats: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Counts, bytes, throughput, latency percentiles and failures of a finished run."""
    loads = [r.loaded for r in records if r.loaded is not None]
    blocks = sum(ev.blocks for ev in loads)
    done = [
        r
        for r in records
        if r.loaded is not None and r.loaded.outcome == "done" and r.loaded.blocks
    ]
    load_s = np.array([r.loaded.done_at - r.loaded.submitted_at for r in done if r.loaded])
    transfer_s = np.array(
        [
            r.loaded.done_at - max(r.loaded.submitted_at, r.store_submitted or 0.0)
            for r in done
            if r.loaded
        ]
    )
    failed = [r for r in records if r.problems or not r.finished]
    nbytes = blocks * block_len
    requests = len(records)

    def ms(samples: np.ndarray) -> dict[str, float]:
        if not samples.size:
            return {"p50": 0.0, "p99": 0.0, "max": 0.0}
        return {
            q: float(np.percentile(samples, p) * 1e3)
            for q, p in (("p50", 50), ("p99", 99), ("max", 100))
        }

    cpu = {side: float(s.get("cpu_s", 0.0)) for side, s in side_stats.items()}
    return {
        "requests": requests,
        "by_order": dict(Counter(r.req.order for r in records)),
        "blocks": blocks,
        "bytes": nbytes,
        "block_bytes": block_len,
        "wall_s": wall_s,
        "throughput_gbps": nbytes / wall_s / 1e9 if wall_s > 0 else 0.0,
        "transfer_latency_ms": ms(transfer_s),
        "load_latency_ms": ms(load_s),
        "failures": len(failed),
        "mismatched_blocks": sum(ev.bad_blocks for ev in loads),
        "failure_details": {str(r.req.index): r.problems or ["unfinished"] for r in failed},
        "cpu_s": cpu,
        "tier_stats": {side: dict(s.get("tier", {})) for side, s in side_stats.items()},
    }


def print_summary(console: Console, summary: Mapping[str, Any], title: str) -> None:
    table = Table(title=title, title_justify="left", show_header=False)
    table.add_column("what")
    table.add_column("value", justify="right")
    orders = ", ".join(f"{k} {v}" for k, v in sorted(summary["by_order"].items()))
    lat = summary["transfer_latency_ms"]
    load = summary["load_latency_ms"]
    failures = summary["failures"]
    rows = [
        ("requests", f"{summary['requests']} ({orders})"),
        ("blocks", f"{summary['blocks']:,} x {summary['block_bytes']:,} B"),
        ("bytes moved", f"{summary['bytes'] / 1e9:.2f} GB"),
        ("wall time", f"{summary['wall_s']:.2f} s"),
        ("throughput", f"{summary['throughput_gbps']:.2f} GB/s"),
        ("transfer latency per request p50 / p99", f"{lat['p50']:.1f} / {lat['p99']:.1f} ms"),
        (
            "load latency (submit_load to result) p50 / p99",
            f"{load['p50']:.1f} / {load['p99']:.1f} ms",
        ),
        ("bytes verified", "every byte of every loaded block"),
        ("failures", "[green]0[/]" if not failures else f"[red]{failures}[/]"),
    ]
    for what, value in rows:
        table.add_row(what, value)
    console.print(table)
    for index, problems in list(summary["failure_details"].items())[:20]:
        console.print(f"[red]request {index}:[/] {escape('; '.join(problems))}")
