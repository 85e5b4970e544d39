"""Pull or recompute: the prompt length above which loading a prefix's KV from a peer beats
recomputing it, from ``p2pkv bench --tier``'s measured latencies.

Recomputing ``n`` tokens takes ``n / rate`` seconds (``rate``: prefill tokens/s per GPU, the
``--recompute-rate``). Pulling them takes the tier's latency for ``n x bytes_per_token`` bytes,
where ``bytes_per_token = layers x KV heads x head dim x kv_factor x dtype bytes`` of the
preset (:mod:`p2pkv_tools.demo.presets`). The latency curve is a least-squares line
``latency = fixed + bytes x per_byte`` through the p50 latencies of the concurrency-1 cells
of one arrival order at the measured block size nearest the preset's block, over their
blocks per request (at least two). Pulling wins above
``n* = fixed / (1 / rate - bytes_per_token x per_byte)``; never when the denominator is not
positive (the tier moves a token's KV slower than the GPU recomputes it).

The same fit in the units of llm-d's router (the EPP's ``p2p-source-producer``
``costModel``): ``transferFixedMs`` = ``fixed``, ``transferMicrosecondsPerToken`` =
``bytes_per_token x per_byte``, ``prefillMicrosecondsPerToken`` = ``1 / rate``, and
``minCachedTokenDelta`` = ``n*`` (at least 1, the router's floor). ``sourceWaitMs`` (a busy
source engine) and ``requeueMs`` are not measured here.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from p2pkv_tools.bench.tier_bench import TierCellResult
from p2pkv_tools.demo.presets import ModelPreset

__all__ = ["crossover"]


def _fit(rows: Sequence[TierCellResult], order: str, block_bytes: int) -> tuple[int, Any]:
    """(block size used, points (request bytes, p50 s)) of ``order`` at conc 1."""
    usable = [
        r for r in rows if r.order == order and r.concurrency == 1 and r.verified and r.p50_us > 0
    ]
    sizes = sorted({r.block_size for r in usable}, key=lambda b: (abs(b - block_bytes), -b))
    for size in sizes:
        pts = sorted(
            {(r.block_size * r.batch, r.p50_us / 1e6) for r in usable if r.block_size == size}
        )
        if len({p[0] for p in pts}) >= 2:
            return size, np.array(pts)
    return 0, None


def _one(
    rows: Sequence[TierCellResult], order: str, preset: ModelPreset, rate: float
) -> dict[str, Any]:
    size, pts = _fit(rows, order, preset.block_bytes)
    if pts is None:
        return {
            "order": order,
            "tokens": None,
            "why": "needs verified concurrency-1 cells of two or more blocks per request",
        }
    per_byte, fixed = (float(v) for v in np.polyfit(pts[:, 0], pts[:, 1], 1))
    per_token = preset.block_bytes / preset.tokens_per_block
    gain = 1.0 / rate - per_token * max(per_byte, 0.0)
    out: dict[str, Any] = {
        "order": order,
        "block_size": size,
        "fixed_us": fixed * 1e6,
        "gbps_marginal": 1e-9 / per_byte if per_byte > 0 else None,
    }
    if gain <= 0:
        return {
            **out,
            "tokens": None,
            "why": "pulling a token's KV takes longer than recomputing it: never",
        }
    tokens = max(0, math.ceil(max(fixed, 0.0) / gain))
    return {
        **out,
        "tokens": tokens,
        "cost_model": {
            "prefillMicrosecondsPerToken": round(1e6 / rate, 3),
            "transferMicrosecondsPerToken": round(per_token * max(per_byte, 0.0) * 1e6, 4),
            "transferFixedMs": round(max(fixed, 0.0) * 1e3, 3),
            "minCachedTokenDelta": max(1, tokens),
        },
    }


def crossover(rows: Sequence[TierCellResult], preset: ModelPreset, rate: float) -> dict[str, Any]:
    """The crossover per arrival order (``tokens``: the prompt length above which pulling
    wins, None with ``why`` when it cannot be told or never happens)."""
    orders = sorted({r.order for r in rows})
    return {
        "preset": preset.name,
        "bytes_per_token": preset.block_bytes / preset.tokens_per_block,
        "formula": preset.formula(),
        "recompute_tokens_per_s": rate,
        "orders": [_one(rows, order, preset, rate) for order in orders],
    }
