"""Cutting a read into messages: runs contiguous on both sides, capped in length."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["plan_runs"]

IntArray = npt.NDArray[np.int64]


def plan_runs(src: IntArray, dst: IntArray, max_run: int) -> tuple[IntArray, IntArray, IntArray]:
    """Split a read into runs; returns (src starts, dst starts, lengths) per run.

    Block ``i`` continues the run of block ``i - 1`` when both its source and destination
    index are one higher; a run never exceeds ``max_run`` blocks (``max_run == 1`` sends one
    message per block). The runs cover the pairs exactly, in order.
    """
    n = len(src)
    if max_run <= 1 or n <= 1:  # nothing to coalesce (and the hot single-block case)
        return src, dst, np.ones(n, np.int64)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    firsts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(firsts, n))
    if (lengths > max_run).any():
        pieces = -(-lengths // max_run)
        run = np.repeat(np.arange(len(lengths)), pieces)
        offset = (np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_run
        firsts = firsts[run] + offset
        lengths = np.minimum(max_run, lengths[run] - offset)
    return src[firsts], dst[firsts], lengths.astype(np.int64)
