"""Bench output: the terminal tables, the JSON document and the plot."""

from __future__ import annotations

import math
import textwrap
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv_tools.bench.runner import CellResult

__all__ = ["figure", "format_size", "geomean_ratios", "plot", "print_tables", "series_order"]


def format_size(n: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} B"


def series_order(results: Sequence[CellResult]) -> list[str]:
    """memcpy first, then each transport's raw baselines (the baseline, then its variants,
    e.g. ``raw nixl``, ``raw nixl write``) followed by its p2pkv series, then any other
    series (``bench --tier``'s), by name."""
    labels = {r.series for r in results}
    order = ["memcpy"] if "memcpy" in labels else []
    for t in sorted({r.transport for r in results if r.impl != "memcpy"}):
        order += sorted({r.series for r in results if r.impl == "raw" and r.transport == t})
        order += [f"p2pkv {t}"] if f"p2pkv {t}" in labels else []
    return order + sorted(labels - set(order))


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


def _groups(results: Sequence[CellResult]) -> list[tuple[str, list[str]]]:
    """The series of one table each, in :func:`series_order`: per transport its raw
    baselines and p2pkv series, next to memcpy (the reference every table repeats); memcpy
    alone when nothing else ran."""
    order = series_order(results)
    owner = {r.series: r.transport for r in results if r.impl in ("raw", "p2pkv")}
    groups = [
        (t, [s for s in order if s == "memcpy" or owner.get(s) == t])
        for t in dict.fromkeys(owner[s] for s in order if s in owner)
    ]
    return groups or [("memcpy", list(order))]


def _throughput_table(
    title: str,
    labels: Sequence[str],
    index: dict[tuple[Any, ...], CellResult],
    cells: Sequence[tuple[int, int, int]],
) -> Table:
    """GB/s per series of one transport, then p2pkv's ratios to raw and to memcpy."""
    p2pkv = next((s for s in labels if s.startswith("p2pkv ")), None)
    ratios = [
        (attr, col)
        for attr, col, base in (
            ("ratio_raw", "/raw", "raw "),
            ("ratio_memcpy", "/memcpy", "memcpy"),
        )
        if p2pkv and any(s.startswith(base) for s in labels)
    ]
    table = Table(title=title, title_justify="left")
    for col in ("block", "batch", "conc", *labels, *(f"p2pkv\n{c}" for _, c in ratios)):
        table.add_column(col, justify="right")
    for block, batch, conc in cells:
        found = {s: index.get((s, block, batch, conc)) for s in labels}
        own = found.get(p2pkv or "")
        table.add_row(
            format_size(block),
            str(batch),
            str(conc),
            *(_rate(found[s]) for s in labels),
            *(_ratio(getattr(own, attr) if own else None) for attr, _ in ratios),
        )
    return table


def _latency_table(
    title: str,
    labels: Sequence[str],
    index: dict[tuple[Any, ...], CellResult],
    cells: Sequence[tuple[int, int, int]],
) -> Table:
    """Per-request p50 / p99 µs of each series but memcpy."""
    table = Table(title=title, title_justify="left")
    for col in ("block", "batch", "conc", *labels):
        table.add_column(col, justify="right")
    for block, batch, conc in cells:
        rows = [index.get((s, block, batch, conc)) for s in labels]
        table.add_row(
            format_size(block),
            str(batch),
            str(conc),
            *(f"{r.p50_us:.0f} / {r.p99_us:.0f}" if r and r.gbps else "" for r in rows),
        )
    return table


def print_tables(console: Console, results: Sequence[CellResult], title: str) -> None:
    """Per transport, a throughput table (GB/s, ratios to raw and memcpy) and a per-request
    latency table (p50/p99 µs): at most nine columns each (nixl's: two raw baselines), so
    they fit 100 columns."""
    index = {(r.series, r.block_size, r.batch, r.concurrency): r for r in results}
    cells = sorted({(r.block_size, r.batch, r.concurrency) for r in results})
    console.print(f"{title}: GB/s = 1e9 B/s, median of the repetitions ±half their range")
    for transport, labels in _groups(results):
        console.print(_throughput_table(f"{transport}: GB/s", labels, index, cells))
        timed = [s for s in labels if s != "memcpy"]
        if timed:
            console.print(
                _latency_table(
                    f"{transport}: per-request latency p50 / p99 (µs)", timed, index, cells
                )
            )
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
    """Write :func:`figure` of ``results`` to ``path`` as a PNG.

    Needs matplotlib (``pip install 'p2pkv-tools[plot]'``); raises ``ImportError`` otherwise.
    """
    fig = figure(results, title)  # selects the Agg backend before pyplot loads
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=120)
    plt.close(fig)


def figure(results: Sequence[CellResult], title: str) -> Any:
    """Throughput vs block size, one panel per cell shape: a row per concurrency and a
    column per batch, so every concurrency measured is shown. The GB/s axis is logarithmic
    and shared, so slow and fast series both stay readable and comparable across panels;
    memcpy (measured at concurrency 1 only) is the dashed reference in every panel; one
    legend for all panels sits below them. Uses matplotlib's Agg backend (no display)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, LogLocator

    batches = sorted({r.batch for r in results})
    concs = sorted({r.concurrency for r in results if r.impl != "memcpy"}) or [1]
    fig, axes = plt.subplots(
        len(concs),
        len(batches),
        figsize=(1.0 + 3.4 * len(batches), 1.4 + 2.8 * len(concs)),
        squeeze=False,
        sharex=True,
        sharey=True,
        layout="constrained",
    )
    sizes = sorted({r.block_size for r in results})
    for row, conc in zip(axes, concs, strict=True):
        for ax, batch in zip(row, batches, strict=True):
            _panel(ax, results, batch, conc)
            ax.set_title(f"batch {batch}, concurrency {conc}", fontsize="medium")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.yaxis.set_major_locator(LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(lambda y, _: f"{y:g}"))
            ax.set_xticks(
                [b / 1024 for b in sizes], [format_size(b) for b in sizes], fontsize="small"
            )
            ax.minorticks_off()
            ax.margins(x=0.12)  # end ticks of neighbouring panels stay apart
            ax.grid(True, which="major", alpha=0.3)
        row[0].set_ylabel("GB/s (log scale)")
    for ax in axes[-1]:
        ax.set_xlabel("block size")
    handles: dict[str, Any] = {}
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels(), strict=True):
            handles.setdefault(label, handle)
    order = [label for label in series_order(results) if label in handles]
    per_row = max(1, min(len(order), int(fig.get_figwidth() / 1.9)))  # entries fit the width
    fig.legend(
        [handles[label] for label in order],
        order,
        loc="outside lower center",
        ncols=per_row,
        frameon=False,
    )
    note = (
        "every concurrency measured, one row each (concurrency = requests in flight, "
        "batch = blocks per request); memcpy, measured at concurrency 1 only, is the "
        "dashed reference in every panel"
    )
    width = int(fig.get_figwidth() * 13)
    fig.suptitle(f"{title}\n{textwrap.fill(note, width)}", fontsize="medium")
    return fig


def _panel(ax: Any, results: Sequence[CellResult], batch: int, conc: int) -> None:
    """One panel: each series' median GB/s per block size with its min..max as error bars."""
    for label in series_order(results):
        pts = sorted(
            (r.block_size, r.gbps, r.gbps_min, r.gbps_max)
            for r in results
            if r.series == label
            and r.batch == batch
            and r.gbps > 0
            and r.concurrency == (1 if r.impl == "memcpy" else conc)
        )
        if not pts:
            continue
        err = [[p[1] - p[2] for p in pts], [p[3] - p[1] for p in pts]]
        style: dict[str, Any] = (
            {"color": "black", "linestyle": "--"} if label == "memcpy" else {"marker": "o"}
        )
        ax.errorbar(
            [p[0] / 1024 for p in pts],
            [p[1] for p in pts],
            yerr=err,
            label=label,
            capsize=2,
            **style,
        )
