"""Coalescing a read's block pairs into runs: consecutive pairs where both the local and the
remote index advance by one become one descriptor of ``n * block_len`` bytes on each side.

Pure numpy over the int64 index arrays (no per-block Python objects); driver-thread agnostic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes

__all__ = ["descs", "runs"]


def runs(local: Indexes, remote: Indexes) -> tuple[Indexes, Indexes, Indexes]:
    """``(local starts, remote starts, lengths)`` of the maximal runs of ``local``/``remote``
    (equal, non-zero lengths) in which ``local[i+1] == local[i] + 1`` and
    ``remote[i+1] == remote[i] + 1``; a scattered read has one run per block."""
    breaks = (np.diff(local) != 1) | (np.diff(remote) != 1)
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
