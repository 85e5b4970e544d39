"""The data bench's matrix run with its progress display (``p2pkv bench``, and the baselines
of ``p2pkv bench --tier``)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.matrix import KiB, MatrixConfig, run_matrix
from p2pkv_tools.bench.netns import Link
from p2pkv_tools.bench.runner import CellResult

__all__ = ["measure_matrix"]


def measure_matrix(
    notes: Console, config: MatrixConfig, series: list[SeriesSpec], link: Link | None = None
) -> list[CellResult]:
    """Run the matrix (its cross-process series across ``link`` when given) with a progress
    bar on ``notes`` (stderr), or, when that is not a terminal, a progress line every 20
    cells."""
    total = sum(
        1
        for _ in config.block_sizes
        for _ in config.batches
        for c in config.concurrency
        for s in series
        if not (s.impl == "memcpy" and c != 1)
    )
    started = time.time()
    with Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=notes,
        transient=True,
    ) as progress:
        task = progress.add_task("bench", total=total)
        done = [0]

        def on_cell(r: CellResult) -> None:
            what = f"{r.series} {r.block_size // KiB} KiB x{r.batch} c{r.concurrency}"
            progress.update(task, advance=1, description=escape(what))
            done[0] += 1
            if not notes.is_terminal and (done[0] % 20 == 0 or done[0] == total):
                notes.print(
                    f"{done[0]}/{total} cells, last: {escape(what)}, {time.time() - started:.0f} s"
                )

        return run_matrix(config, series, on_cell, link)
