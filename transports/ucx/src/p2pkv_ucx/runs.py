"""Cutting a read into messages: runs contiguous on both sides, capped in length, within one
slice of each side (see ``slice_bytes`` in :mod:`p2pkv_ucx.options`)."""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["plan_runs"]

IntArray = npt.NDArray[np.int64]


def plan_runs(
    src: IntArray, dst: IntArray, max_run: int, src_slice: int = 0, dst_slice: int = 0
) -> tuple[IntArray, IntArray, IntArray]:
    """Split a read into runs; returns (src starts, dst starts, lengths) per run.

    Block ``i`` continues the run of block ``i - 1`` when both its source and destination
    index are one higher and neither enters a new slice of its side (slices of ``src_slice``
    / ``dst_slice`` blocks from block 0; 0: the side is one slice); a run never exceeds
    ``max_run`` blocks (``max_run == 1`` sends one message per block). The runs cover the
    pairs exactly, in order.
    """
    n = len(src)
    if max_run <= 1 or n <= 1:  # nothing to coalesce (and the hot single-block case)
        return src, dst, np.ones(n, np.int64)
    breaks = (np.diff(src) != 1) | (np.diff(dst) != 1)
    for idxs, blocks in ((src, src_slice), (dst, dst_slice)):
        if blocks:
            breaks |= np.diff(idxs // blocks) != 0
    firsts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(firsts, n))
    if (lengths > max_run).any():
        pieces = -(-lengths // max_run)
        run = np.repeat(np.arange(len(lengths)), pieces)
        offset = (np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_run
        firsts = firsts[run] + offset
        lengths = np.minimum(max_run, lengths[run] - offset)
    return src[firsts], dst[firsts], lengths.astype(np.int64)
