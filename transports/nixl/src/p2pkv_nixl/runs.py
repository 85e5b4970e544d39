"""NIXL transfer descriptors of a read's runs: each run of consecutive blocks
(:func:`p2pkv.runs.coalesce`, cut at both sides' slice starts) becomes one descriptor of
``n * block_len`` bytes on each side.

Pure numpy over the int64 index arrays (no per-block Python objects); driver-thread agnostic.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes

__all__ = ["descs"]


def descs(base: int, starts: Indexes, lengths: Indexes, block_len: int) -> npt.NDArray[np.uint64]:
    """NIXL's Nx3 transfer descriptors (address, length, device 0) of the runs of blocks at
    ``starts`` in the region at ``base``."""
    out = np.zeros((len(starts), 3), dtype=np.uint64)
    out[:, 0] = base + starts.astype(np.uint64) * np.uint64(block_len)
    out[:, 1] = lengths.astype(np.uint64) * np.uint64(block_len)
    return out
