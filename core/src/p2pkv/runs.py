"""Slices of a region and runs of a read: the block arithmetic data transports share.

A transport may register its region in *slices* (consecutive groups of whole blocks, so no
registration exceeds what a NIC or a library handles well) and move a read as *runs*
(consecutive blocks on both sides, one descriptor or message each). A run never crosses the
start of a slice of either side, since one transfer resolves to one registration per side.

The slice size is the data option ``slice_bytes`` of each transport that slices; its default
is :data:`SLICE_BYTES` unless the environment variable :data:`SLICE_BYTES_ENV` gives another
(:func:`default_slice_bytes`), and an explicit option beats both.

Pure numpy over int64 index arrays (no per-block Python objects); no transport calls;
thread-agnostic.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt

from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError

SLICE_BYTES = 7 * 2**29
"""The default largest registration: 3.5 GiB. Reads from one RDMA registration larger than
about 4 GiB ran at 6.0 instead of 9.3 GB/s on 100 GbE RoCE, and LMCache registers slices of
at most 3.5 GiB (docs/configuration.md, "Large CPU tiers")."""
SLICE_BYTES_ENV = "P2PKV_SLICE_BYTES"
"""Environment variable that replaces :data:`SLICE_BYTES` as the default (whole bytes)."""


def default_slice_bytes(environ: Mapping[str, str] | None = None) -> int:
    """The default of data option ``slice_bytes``: :data:`SLICE_BYTES_ENV` in ``environ``
    (default ``os.environ``) when set, else :data:`SLICE_BYTES`. ``ConfigError`` naming the
    variable when it is not a positive whole number of bytes."""
    raw = (os.environ if environ is None else environ).get(SLICE_BYTES_ENV)
    if raw is None:
        return SLICE_BYTES
    text = raw.strip()
    if not text.isdigit() or int(text) < 1:
        raise ConfigError(
            f"{SLICE_BYTES_ENV}={raw!r}: give the largest registration in whole "
            f"bytes, at least 1 (e.g. {SLICE_BYTES} for 3.5 GiB)"
        )
    return int(text)


ONE_SLICE: Indexes = np.zeros(1, np.int64)
"""The slice starts of a region registered whole."""


def per_slice(slice_bytes: int, block_len: int) -> int:
    """Blocks per slice: ``slice_bytes`` rounded down to whole blocks, at least one."""
    return max(1, slice_bytes // block_len)


def slice_counts(num_blocks: int, blocks: int) -> tuple[int, ...]:
    """The block counts of ``num_blocks`` cut into slices of ``blocks`` (the last the rest)."""
    full, rest = divmod(num_blocks, blocks)
    return (blocks,) * full + ((rest,) if rest else ())


def slice_starts(counts: Sequence[int]) -> Indexes:
    """The first block of each slice of ``counts``, ascending: block ``i`` lies in slice
    ``searchsorted(starts, i, "right") - 1``."""
    return np.concatenate(([0], np.cumsum(counts[:-1], dtype=np.int64))).astype(np.int64)


def region_slice_starts(num_blocks: int, blocks: int) -> Indexes:
    """The slice starts (:func:`slice_starts`) of a region of ``num_blocks`` cut into slices
    of ``blocks`` (at least one block each, the last the rest): :data:`ONE_SLICE` itself when
    one slice holds the whole region (``blocks >= num_blocks``), so :func:`coalesce` pays
    nothing for that side."""
    if blocks >= num_blocks:
        return ONE_SLICE
    return slice_starts(slice_counts(num_blocks, max(1, blocks)))


def coalesce(
    first: Indexes,
    second: Indexes,
    first_slices: Indexes = ONE_SLICE,
    second_slices: Indexes = ONE_SLICE,
    max_run: int = 0,
) -> tuple[Indexes, Indexes, Indexes]:
    """``(first starts, second starts, lengths)`` of the runs of the block pairs
    ``(first[i], second[i])``, in order, covering the pairs exactly.

    Pair ``i`` continues the run of pair ``i - 1`` when both indexes are one higher and
    neither enters a new slice of its side (``*_slices``: :func:`slice_starts`; a side of
    one slice costs nothing, else one ``searchsorted``); a run is at most ``max_run`` pairs
    (0: unbounded; 1: one run per pair). A scattered read has one run per block.
    """
    n = len(first)
    if n <= 1 or max_run == 1:  # nothing to coalesce (and the hot single-block case)
        return first, second, np.ones(n, np.int64)
    breaks = _breaks(first, second, first_slices, second_slices)
    starts = np.flatnonzero(np.concatenate(([True], breaks)))
    lengths = np.diff(np.append(starts, n))
    if max_run > 1 and (lengths > max_run).any():
        pieces = -(-lengths // max_run)
        run = np.repeat(np.arange(len(lengths)), pieces)
        offset = (np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)) * max_run
        starts = starts[run] + offset
        lengths = np.minimum(max_run, lengths[run] - offset)
    return first[starts], second[starts], lengths.astype(np.int64)


def count_runs(
    first: Indexes,
    second: Indexes,
    first_slices: Indexes = ONE_SLICE,
    second_slices: Indexes = ONE_SLICE,
) -> int:
    """How many runs :func:`coalesce` makes of the same pairs with ``max_run`` 0, without
    building them: a transport that only counts its descriptors pays one pass."""
    if len(first) <= 1:
        return len(first)
    return 1 + int(np.count_nonzero(_breaks(first, second, first_slices, second_slices)))


def _breaks(
    first: Indexes, second: Indexes, first_slices: Indexes, second_slices: Indexes
) -> npt.NDArray[np.bool_]:
    """Per pair after the first: True where it starts a new run (see :func:`coalesce`)."""
    breaks: npt.NDArray[np.bool_] = (np.diff(first) != 1) | (np.diff(second) != 1)
    for idxs, bounds in ((first, first_slices), (second, second_slices)):
        if len(bounds) > 1:
            breaks |= np.diff(np.searchsorted(bounds, idxs, "right")) != 0
    return breaks
