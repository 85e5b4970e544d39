"""The order of ``p2pkv bench --tier``'s cells, and how their rounds combine.

A tier cell's ratio to raw NIXL compares two measurements. Taken a minute apart on a shared
host, a change of load moves the ratio. So each cell runs in :data:`ROUNDS` rounds, the raw
baselines and the tier side by side in each, in ABBA order: raw first in even rounds, the
tier first in odd ones, so a load drift within the cell weighs on both alike. A round is
one data-bench cell (its warm-up, then its share of the repetitions).

A cell's ratio to a raw series is the median of its rounds' ratios (tier GB/s over that
series' GB/s in the same round): each pair compares like with like. The pure functions here
plan the steps and combine the rounds; :mod:`p2pkv_tools.bench.tier_bench` runs them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Literal, TypeVar

import numpy as np

from p2pkv_tools.bench.runner import CellResult

__all__ = ["ROUNDS", "Step", "cell_steps", "merge_rounds", "pair_ratios", "reps_per_round"]

ROUNDS = 2
"""Rounds per cell: two give each ratio a raw run on either side of the tier's."""

StepKind = Literal["raw", "memcpy", "tier"]


@dataclass(frozen=True)
class Step:
    """One measurement of a cell: ``label`` is a raw series' label, ``memcpy``, or an
    arrival order of the tier; ``round`` counts from 0."""

    kind: StepKind
    label: str
    concurrency: int
    round: int


def reps_per_round(reps: int, rounds: int = ROUNDS) -> int:
    """Timed repetitions per round: the run's ``reps`` shared out, at least one."""
    return max(1, math.ceil(reps / rounds))


def cell_steps(
    concurrency: int,
    raw: Sequence[str],
    orders: Sequence[str],
    *,
    memcpy: bool,
    rounds: int = ROUNDS,
) -> list[Step]:
    """The steps of one cell: per round the ``raw`` series and the tier's ``orders``, raw
    first in even rounds and the tier first in odd ones; memcpy (one thread: concurrency 1
    only) once, in the first round, after the raw series. With no raw series the tier runs
    one round (no pair to take)."""
    if not raw:
        return [Step("tier", o, concurrency, 0) for o in orders]
    steps: list[Step] = []
    for r in range(rounds):
        base = [Step("raw", label, concurrency, r) for label in raw]
        if memcpy and r == 0 and concurrency == 1:
            base.append(Step("memcpy", "memcpy", concurrency, r))
        tier = [Step("tier", o, concurrency, r) for o in orders]
        steps += base + tier if r % 2 == 0 else tier + base
    return steps


Row = TypeVar("Row", bound=CellResult)


def merge_rounds(parts: Sequence[Row]) -> Row:
    """One row from a cell's rounds (oldest first): their repetitions' rates pooled (GB/s
    the median of all), bytes and repetitions added up, every error kept. Latencies cannot
    be pooled from percentiles: ``p50_us`` is the median of the rounds' p50s, ``p99_us``
    the highest p99, ``mean_us`` weighted by requests; ``requests`` stays the first
    round's. A skipped first round skips the row."""
    first = parts[0]
    if len(parts) == 1 or first.skipped:
        return first
    measured = [p for p in parts if p.rep_gbps]
    rates = [g for p in measured for g in p.rep_gbps]
    weights = [p.requests * len(p.rep_gbps) for p in measured]
    errors = [f"round {i}: {p.error}" for i, p in enumerate(parts) if p.error]
    return replace(
        first,
        reps=sum(p.reps for p in parts),
        gbps=float(np.median(rates)) if rates else 0.0,
        gbps_min=min(rates, default=0.0),
        gbps_max=max(rates, default=0.0),
        p50_us=float(np.median([p.p50_us for p in measured])) if measured else 0.0,
        p99_us=max((p.p99_us for p in measured), default=0.0),
        mean_us=(
            float(np.average([p.mean_us for p in measured], weights=weights))
            if measured and sum(weights)
            else 0.0
        ),
        bytes_moved=sum(p.bytes_moved for p in parts),
        bytes_verified=sum(p.bytes_verified for p in parts),
        verified=all(p.verified for p in parts),
        error="; ".join(errors),
        rep_gbps=rates,
    )


def pair_ratios(
    tier: Sequence[CellResult], raw: Mapping[str, Sequence[CellResult]]
) -> dict[str, list[float]]:
    """Per raw series, the tier's GB/s over the raw series' GB/s round by round (rounds
    where either measured nothing are left out; a series with no pair is left out)."""
    out: dict[str, list[float]] = {}
    for label, rounds in raw.items():
        pairs = [t.gbps / r.gbps for t, r in zip(tier, rounds, strict=False) if t.gbps > 0 < r.gbps]
        if pairs:
            out[label] = pairs
    return out
