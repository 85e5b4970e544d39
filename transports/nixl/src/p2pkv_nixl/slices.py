"""A region registered in slices: the layout, and checking a peer's.

Why: RDMA NICs read one huge memory registration at a fraction of line rate (6.0 vs 9.2 GB/s
over one vs two MRs on 100 GbE RoCE), and some silently truncate a registration beyond their
limit, while vLLM CPU tiers are commonly 50-100 GiB. So a region (and the staging pool) is
registered as consecutive *slices* of at most ``slice_bytes`` (data option), in whole blocks:
``per_slice`` blocks each, the last one the rest. NIXL resolves every transfer descriptor to
one registration (a descriptor spanning two is refused, ``NIXL_ERR_NOT_FOUND``), so every
descriptor stays within one slice of each side: prepared lists have one strided row per slice
(NIXL merges contiguous indexes only within a row), and direct READs cut their runs at both
sides' slice boundaries (:func:`p2pkv.runs.coalesce`). Each side slices its own memory and
advertises its slices' block counts in its descriptor; the two layouts need not agree.

Pure functions of block counts; no NIXL calls. The generic slice arithmetic (``per_slice``,
``slice_counts``, ``slice_starts``) is core's, :mod:`p2pkv.runs`, shared with ucx.
"""

from __future__ import annotations

from p2pkv.errors import ConfigError
from p2pkv.runs import per_slice, slice_counts

__all__ = ["MAX_SLICES", "checked_slices", "region_slices"]

MAX_SLICES = 1 << 16
"""Slices a region may have (each is one registration with every backend, and the list
travels in the descriptor): 64 KiB slices of 4 GiB cover 256 TiB."""


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
