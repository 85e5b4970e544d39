"""Bench output: the terminal tables, the JSON document and the plot."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv.bench.runner import CellResult

__all__ = ["format_size", "geomean_ratios", "plot", "print_tables", "series_order"]


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def series_order(results: Sequence[CellResult]) -> list[str]:
    """memcpy first, then each transport's raw baseline followed by its p2pkv series."""
    labels = {r.series for r in results}
    transports = sorted({r.transport for r in results if r.impl != "memcpy"})
    order = ["memcpy"] if "memcpy" in labels else []
    for t in transports:
        order += [lbl for lbl in (f"raw {t}", f"p2pkv {t}") if lbl in labels]
    return order


def geomean_ratios(results: Sequence[CellResult]) -> dict[str, dict[str, float | int]]:
    """Per p2pkv series: geometric mean of the per-cell ratios to raw and to memcpy."""
    out: dict[str, dict[str, float | int]] = {}
    for label in sorted({r.series for r in results if r.impl == "p2pkv"}):
        rows = [r for r in results if r.series == label]
        entry: dict[str, float | int] = {"cells": len(rows)}
        for attr in ("ratio_raw", "ratio_memcpy"):
            vals = [getattr(r, attr) for r in rows if getattr(r, attr)]
            if vals:
                entry[attr] = math.exp(sum(math.log(v) for v in vals) / len(vals))
                entry[f"{attr}_min"] = min(vals)
        out[label] = entry
    return out


def _rate(r: CellResult | None) -> str:
    if r is None:
        return ""
    if r.skipped:
        return "[dim]skip[/]"
    if not r.gbps:
        return "[red]error[/]"
    spread = (r.gbps_max - r.gbps_min) / 2 / r.gbps * 100
    return f"{r.gbps:.2f}[dim]±{spread:.0f}%[/]" + (" [red]![/]" if r.error else "")


def _ratio(value: float | None) -> str:
    if value is None:
        return ""
    color = "green" if value >= 0.95 else "yellow" if value >= 0.7 else "red"
    return f"[{color}]{value:.2f}[/]"


def print_tables(console: Console, results: Sequence[CellResult], title: str) -> None:
    """Throughput table (GB/s, ratios) and per-request latency table (p50/p99 µs)."""
    order = series_order(results)
    p2pkv = [s for s in order if s.startswith("p2pkv ")]
    has_raw = {s for s in p2pkv if f"raw {s.removeprefix('p2pkv ')}" in order}
    index = {(r.series, r.block_size, r.batch, r.concurrency): r for r in results}
    cells = sorted({(r.block_size, r.batch, r.concurrency) for r in results})
    thr = Table(title=f"{title}: GB/s (1e9 B/s), median of repetitions ±half-range",
                title_justify="left")
    lat = Table(title="per-request latency p50 / p99 (µs)", title_justify="left")
    for t in (thr, lat):
        for col in ("block", "batch", "conc"):
            t.add_column(col, justify="right")
    for label in order:
        thr.add_column(label, justify="right")
    for label in p2pkv:
        short = label.removeprefix("p2pkv ")
        if label in has_raw:
            thr.add_column(f"{short}\n/raw", justify="right")
        if "memcpy" in order:
            thr.add_column(f"{short}\n/memcpy", justify="right")
    for label in order:
        if label != "memcpy":
            lat.add_column(label, justify="right")
    for block, batch, conc in cells:
        head = (format_size(block), str(batch), str(conc))
        found = {s: index.get((s, block, batch, conc)) for s in order}
        ratios = []
        for label in p2pkv:
            r = found[label]
            if label in has_raw:
                ratios.append(_ratio(r.ratio_raw if r else None))
            if "memcpy" in order:
                ratios.append(_ratio(r.ratio_memcpy if r else None))
        thr.add_row(*head, *(_rate(found[s]) for s in order), *ratios)
        lat.add_row(*head, *(
            f"{r.p50_us:.0f} / {r.p99_us:.0f}" if r and r.gbps else ""
            for s, r in found.items() if s != "memcpy"
        ))
    console.print(thr)
    console.print(lat)
    for label, g in geomean_ratios(results).items():
        parts = []
        if "ratio_raw" in g:
            parts.append(f"{g['ratio_raw']:.2f}x raw (worst {g['ratio_raw_min']:.2f}x)")
        if "ratio_memcpy" in g:
            parts.append(f"{g['ratio_memcpy']:.2f}x memcpy (worst {g['ratio_memcpy_min']:.2f}x)")
        if parts:
            console.print(f"{label}: geometric mean over {g['cells']} cells: " + ", ".join(parts))
    for r in results:
        if r.error:
            console.print(
                f"[red]{r.series} {format_size(r.block_size)} x{r.batch} c{r.concurrency}:[/] "
                f"{escape(r.error)}"
            )


def plot(results: Sequence[CellResult], path: str, title: str) -> None:
    """Throughput vs block size per series, one panel per batch (concurrency 1), memcpy dashed.

    Needs matplotlib (``pip install 'p2pkv[plot]'``); raises ``ImportError`` otherwise.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    batches = sorted({r.batch for r in results})
    cols = min(3, len(batches))
    rows = math.ceil(len(batches) / cols)
    fig, axes = plt.subplots(
        rows, cols, figsize=(4.6 * cols, 3.6 * rows), squeeze=False, sharey=True
    )
    flat = list(axes.flat)
    for ax in flat[len(batches):]:
        ax.set_visible(False)
    for ax, batch in zip(flat, batches, strict=False):
        for label in series_order(results):
            pts = sorted(
                (r.block_size, r.gbps, r.gbps_min, r.gbps_max)
                for r in results
                if r.series == label and r.batch == batch and r.concurrency == 1 and r.gbps > 0
            )
            if not pts:
                continue
            xs = [p[0] / 1024 for p in pts]
            ys = [p[1] for p in pts]
            err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
            style: dict[str, Any] = (
                {"color": "black", "linestyle": "--"} if label == "memcpy" else {"marker": "o"}
            )
            ax.errorbar(xs, ys, yerr=err, label=label, capsize=2, **style)
        sizes = sorted({r.block_size for r in results})
        ax.set_xscale("log", base=2)
        ax.set_xticks([b / 1024 for b in sizes], [format_size(b) for b in sizes])
        ax.minorticks_off()
        ax.set_xlabel("block size")
        ax.set_title(f"{batch} block(s) per request")
        ax.grid(True, alpha=0.3)
    for row in axes:
        row[0].set_ylabel("GB/s")
    flat[0].legend(fontsize="small")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
