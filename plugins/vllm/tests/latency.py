"""Summaries of measured latencies, as the idle-source tests report them (docs/vllm.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any


def summary(took: Sequence[float]) -> dict[str, Any]:
    """Count, median, p99 (nearest rank: with fewer than 100 samples, the maximum) and
    maximum of ``took`` (seconds), in milliseconds, and every sample in order."""
    ordered = sorted(took)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "n": len(took),
        "p50_ms": round(statistics.median(took) * 1000, 1),
        "p99_ms": round(p99 * 1000, 1),
        "max_ms": round(ordered[-1] * 1000, 1),
        "ms": [round(t * 1000, 1) for t in took],
    }
