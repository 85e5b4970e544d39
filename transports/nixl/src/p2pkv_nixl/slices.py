"""A region registered in slices: the layout, and checking a peer's.

Why: RDMA NICs read one huge memory registration at a fraction of line rate (6.0 vs 9.2 GB/s
over one vs two MRs on 100 GbE RoCE), and some silently truncate a registration beyond their
limit, while vLLM CPU tiers are commonly 50-100 GiB. So a region (and the staging pool) is
registered as consecutive *slices* of at most ``slice_bytes`` (data option), in whole blocks:
``per_slice`` blocks each, the last one the rest. NIXL resolves every transfer descriptor to
one registration (a descriptor spanning two is refused, ``NIXL_ERR_NOT_FOUND``), so every
descriptor stays within one slice of each side: prepared lists have one strided row per slice
(NIXL merges contiguous indexes only within a row), and direct READs cut their runs at both
sides' slice boundaries (:func:`p2pkv_nixl.runs.runs`). Each side slices its own memory and
advertises its slices' block counts in its descriptor; the two layouts need not agree.

Pure functions of block counts; no NIXL calls.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError

__all__ = [
    "MAX_SLICES", "checked_slices", "per_slice", "region_slices", "slice_counts", "slice_starts",
]

MAX_SLICES = 1 << 16
"""Slices a region may have (each is one registration with every backend, and the list
travels in the descriptor): 64 KiB slices of 4 GiB cover 256 TiB."""


def per_slice(slice_bytes: int, block_len: int) -> int:
    """Blocks per slice: ``slice_bytes`` rounded down to whole blocks, at least one."""
    return max(1, slice_bytes // block_len)


def region_slices(num_blocks: int, block_len: int, slice_bytes: int) -> tuple[int, ...]:
    """The slice counts of our region under data option ``slice_bytes``; ``ConfigError``
    when that makes more than :data:`MAX_SLICES` slices."""
    blocks = per_slice(slice_bytes, block_len)
    if -(-num_blocks // blocks) > MAX_SLICES:
        raise ConfigError(
            f"nixl data option 'slice_bytes' {slice_bytes} cuts the region of {num_blocks} "
            f"blocks of {block_len} B into more than {MAX_SLICES} registrations; raise it"
        )
    return slice_counts(num_blocks, blocks)


def slice_counts(num_blocks: int, blocks: int) -> tuple[int, ...]:
    """The block counts of ``num_blocks`` cut into slices of ``blocks`` (the last the rest)."""
    full, rest = divmod(num_blocks, blocks)
    return (blocks,) * full + ((rest,) if rest else ())


def slice_starts(counts: Sequence[int]) -> Indexes:
    """The first block of each slice, ascending (int64): block ``i`` lies in slice
    ``searchsorted(starts, i, "right") - 1``."""
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).astype(np.int64)


def checked_slices(counts: object, num_blocks: int) -> tuple[int, ...]:
    """A peer's slice list for its region of ``num_blocks``: a non-empty list of at most
    :data:`MAX_SLICES` positive integers summing to ``num_blocks``; ``ValueError`` saying
    what is wrong otherwise."""
    if not isinstance(counts, (list, tuple)) or not 0 < len(counts) <= MAX_SLICES:
        raise ValueError(f"is not a list of 1..{MAX_SLICES} block counts")
    checked = tuple(n for n in counts if isinstance(n, int) and not isinstance(n, bool) and n > 0)
    if len(checked) != len(counts):
        raise ValueError("has a block count that is not a positive integer")
    if sum(checked) != num_blocks:
        raise ValueError(f"covers {sum(checked)} blocks, the region has {num_blocks}")
    return checked
