"""Slices of a region and runs of a read (``p2pkv.runs``), as the nixl and ucx transports use
them: runs cover a read exactly, coalesce only what is consecutive on both sides, never
cross a slice start of either side and never exceed ``max_run``."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.runs import (
    ONE_SLICE,
    coalesce,
    count_runs,
    per_slice,
    region_slice_starts,
    slice_counts,
    slice_starts,
)
from slice_oracle import cuts

BLOCK = 4096


def _starts(num_blocks: int, every: int) -> np.ndarray:
    return slice_starts(slice_counts(num_blocks, every))


def test_slice_layout_rounds_down_to_whole_blocks_at_least_one() -> None:
    assert per_slice(3 * BLOCK + 100, BLOCK) == 3 and per_slice(10, BLOCK) == 1
    assert slice_counts(16, 3) == (3, 3, 3, 3, 3, 1) and slice_counts(7, 7) == (7,)
    assert slice_starts((3, 3, 1)).tolist() == [0, 3, 6]


def test_a_region_of_one_slice_is_one_slice_and_others_are_cut_whole() -> None:
    assert region_slice_starts(7, 7) is ONE_SLICE and region_slice_starts(7, 100) is ONE_SLICE
    assert region_slice_starts(16, 3).tolist() == [0, 3, 6, 9, 12, 15]
    assert region_slice_starts(4, 0).tolist() == [0, 1, 2, 3]  # at least one block a slice


def test_runs_are_cut_at_both_sides_slice_starts() -> None:
    first, second = np.arange(16, 48), np.arange(32)
    _, _, whole = coalesce(first, second)
    assert whole.tolist() == [32]
    fs, ss, lengths = coalesce(first, second, _starts(64, 3), _starts(64, 5))
    assert len(lengths) == 1 + len(cuts(16, 32, 3) | cuts(0, 32, 5))
    assert lengths.sum() == 32 and (ss - fs == -16).all()
    assert (fs // 3 == (fs + lengths - 1) // 3).all()  # within one slice of the first side
    assert (ss // 5 == (ss + lengths - 1) // 5).all()  # and of the second
    _, _, aligned = coalesce(second, second, _starts(64, 3), _starts(64, 3))
    assert aligned.tolist() == [3] * 10 + [2]  # ceil(32 / 3) runs


def test_max_run_caps_runs_within_a_slice_too() -> None:
    blocks = np.arange(32)
    _, _, capped = coalesce(blocks, blocks, _starts(64, 3), max_run=2)
    assert capped.tolist() == [2, 1] * 10 + [2]
    assert coalesce(blocks, blocks, max_run=1)[2].tolist() == [1] * 32


def test_runs_coalesce_only_what_is_consecutive_on_both_sides() -> None:
    first = np.array([0, 1, 2, 3, 10, 11, 12, 20], np.int64)
    second = np.array([5, 6, 7, 9, 0, 1, 2, 3], np.int64)
    fs, ss, lengths = coalesce(first, second, max_run=64)
    assert list(zip(fs.tolist(), ss.tolist(), lengths.tolist(), strict=True)) == [
        (0, 5, 3),
        (3, 9, 1),
        (10, 0, 3),
        (20, 3, 1),
    ]


@given(st.data(), st.integers(0, 9), st.integers(1, 12), st.integers(1, 12))
def test_runs_cover_the_read_exactly(
    data: st.DataObject, max_run: int, first_every: int, second_every: int
) -> None:
    n = data.draw(st.integers(0, 60))
    first = np.array(data.draw(st.lists(st.integers(0, 79), min_size=n, max_size=n)), np.int64)
    second = np.array(data.draw(st.permutations(range(80)))[:n], np.int64)
    fs, ss, lengths = coalesce(
        first, second, _starts(80, first_every), _starts(80, second_every), max_run
    )
    assert lengths.sum() == n and (lengths >= 1).all()
    if max_run == 0:  # what a transport that only counts its descriptors asks
        assert count_runs(first, second, _starts(80, first_every), _starts(80, second_every)) == (
            len(lengths)
        )
    assert max_run == 0 or (lengths <= max_run).all()
    assert (fs // first_every == (fs + lengths - 1) // first_every).all()
    assert (ss // second_every == (ss + lengths - 1) // second_every).all()
    rebuilt = [
        (int(fs[r] + k), int(ss[r] + k))
        for r in range(len(lengths))
        for k in range(int(lengths[r]))
    ]
    assert rebuilt == list(zip(first.tolist(), second.tolist(), strict=True))
