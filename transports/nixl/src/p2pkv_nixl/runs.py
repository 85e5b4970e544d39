"""Coalescing a read's block pairs into runs: consecutive pairs where both the local and the
remote index advance by one, within one slice of each side (:mod:`p2pkv_nixl.slices`), become
one descriptor of ``n * block_len`` bytes on each side.

Pure numpy over the int64 index arrays (no per-block Python objects); driver-thread agnostic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes

__all__ = ["ONE_SLICE", "descs", "runs"]

ONE_SLICE: Indexes = np.zeros(1, np.int64)
"""The slice starts of a region registered whole."""


def runs(
    local: Indexes, remote: Indexes,
    local_slices: Indexes = ONE_SLICE, remote_slices: Indexes = ONE_SLICE,
) -> tuple[Indexes, Indexes, Indexes]:
    """``(local starts, remote starts, lengths)`` of the maximal runs of ``local``/``remote``
    (equal, non-zero lengths) in which ``local[i+1] == local[i] + 1`` and
    ``remote[i+1] == remote[i] + 1`` and neither crosses the start of a slice of its side
    (``*_slices``: :func:`~p2pkv_nixl.slices.slice_starts`); a scattered read has one run
    per block. A side of one slice costs nothing; else one ``searchsorted`` of its indexes."""
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
    for idxs, bounds in ((local, local_slices), (remote, remote_slices)):
        if len(bounds) > 1:
            breaks |= np.diff(np.searchsorted(bounds, idxs, "right")) != 0
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, len(local)))
    return local[starts], remote[starts], lengths


def descs(base: int, starts: Indexes, lengths: Indexes, block_len: int) -> npt.NDArray[np.uint64]:
    """NIXL's Nx3 transfer descriptors (address, length, device 0) of the runs of blocks at
    ``starts`` in the region at ``base``."""
    out = np.zeros((len(starts), 3), dtype=np.uint64)
    out[:, 0] = base + starts.astype(np.uint64) * np.uint64(block_len)
    out[:, 1] = lengths.astype(np.uint64) * np.uint64(block_len)
    return out
