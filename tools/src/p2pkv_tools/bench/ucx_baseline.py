"""Throughput of raw ucxx and of the p2pkv ``ucx`` transport alone, measured the same way.

- The raw side is :class:`p2pkv_ucx.baseline.RawUcxxBaseline` (ucxx tag send/receive with
  no p2pkv, consumer-initiated, the ``p2pkv_bench_baselines`` hook's ``raw ucx``), with the
  same ``endpoint_error_handling`` as the transport (option,
  ``P2PKV_UCX_ENDPOINT_ERROR_HANDLING``, default on), so the two share the same UCX lanes.
- :func:`run_raw` and :func:`run_transport` time one series with ``p2pkv bench``'s own cell
  runner: ``num_blocks`` scattered blocks between this process and a child, one request per
  repetition, every repetition's destination bytes checked. They return seconds per
  repetition.

``python -m p2pkv_tools.bench.ucx_baseline`` prints GB/s (10^9 B/s) of raw ucxx, the
transport and memcpy for 256 blocks of 64 KiB, 256 KiB, 1 MiB and 2 MiB, with the ratios,
for endpoint error handling on, off or both. Set ``UCX_NET_DEVICES=lo`` on one host. Needs
p2pkv-ucx.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import numpy as np
from p2pkv.registry import default_registry
from p2pkv_ucx.options import ERROR_HANDLING_ENV

from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.lanes import EndpointLane
from p2pkv_tools.bench.matrix import KiB, MatrixConfig, MiB, available_series, run_matrix
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.target import RemoteTarget, page_in

__all__ = ["compare", "main", "run_raw", "run_transport"]


def _measure(impl: str, block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    registry = default_registry()
    spec = SeriesSpec(impl, "ucx", cross_process=True)
    region_bytes = 2 * num_blocks * block_len  # slots scattered over twice what one rep needs
    target = RemoteTarget(region_bytes)
    try:
        lane = EndpointLane(spec, registry, page_in(region_bytes).data, target)
        lane.open(block_len)
        try:
            plan = CellPlan(
                block_size=block_len,
                batch=num_blocks,
                concurrency=1,
                requests=1,
                reps=repeats,
                warmup=warmup,
            )
            result = measure_cell(lane, plan, np.random.default_rng(0))
        finally:
            lane.close()
    finally:
        target.shutdown()
    if result.error:
        raise RuntimeError(f"{spec.label}: {result.error}")
    return [num_blocks * block_len / (gbps * 1e9) for gbps in result.rep_gbps]


def run_raw(block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    """Seconds per repetition of raw ucxx moving ``num_blocks`` scattered blocks, verified
    (consumer-initiated, like the transport)."""
    return _measure("raw", block_len, num_blocks, repeats, warmup)


def run_transport(block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    """Seconds per repetition of the p2pkv ``ucx`` transport alone, same blocks, verified."""
    return _measure("p2pkv", block_len, num_blocks, repeats, warmup)


def compare(sizes: Sequence[int], num_blocks: int, repeats: int, warmup: int) -> list[CellResult]:
    """Raw ucxx, the ``ucx`` transport and memcpy, side by side per size (``p2pkv bench``)."""
    registry = default_registry()
    config = MatrixConfig(
        block_sizes=tuple(sizes),
        batches=(num_blocks,),
        concurrency=(1,),
        reps=repeats,
        warmup=warmup,
        bytes_per_rep=0,
        region_bytes=2 * num_blocks * max(sizes),
        transports=("ucx",),
    )
    series, skipped = available_series(registry, config)
    for label, reason in skipped.items():
        print(f"skipped {label}: {reason}", file=sys.stderr)
    return run_matrix(config, series)


def _table(results: Sequence[CellResult], mode: str) -> str:
    rows: dict[int, dict[str, CellResult]] = {}
    for r in results:
        rows.setdefault(r.block_size, {})[r.impl] = r
    lines = [
        f"endpoint error handling {mode}: GB/s (median of reps), ratios",
        f"{'block':>8} {'raw ucxx':>9} {'p2pkv ucx':>10} {'memcpy':>8} "
        f"{'ucx/raw':>8} {'ucx/memcpy':>10} {'raw/memcpy':>10}",
    ]
    for size, by_impl in sorted(rows.items()):
        raw, ucx, mem = (by_impl.get(k) for k in ("raw", "p2pkv", "memcpy"))
        g = [x.gbps if x is not None and not x.error else float("nan") for x in (raw, ucx, mem)]
        lines.append(
            f"{_label(size):>8} {g[0]:9.2f} {g[1]:10.2f} {g[2]:8.2f} "
            f"{g[1] / g[0]:8.2f} {g[1] / g[2]:10.2f} {g[0] / g[2]:10.2f}"
        )
        for x in (raw, ucx, mem):
            if x is not None and x.error:
                lines.append(f"         {x.series}: {x.error}")
    return "\n".join(lines)


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2pkv_tools.bench.ucx_baseline",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument(
        "--sizes", default="64K,256K,1M,2M", help="comma-separated block sizes (K/M suffixes)"
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--error-handling", choices=("on", "off", "both"), default="both")
    parser.add_argument("--json", action="store_true", help="print the raw cell results")
    args = parser.parse_args(argv)
    sizes = [_size(s) for s in args.sizes.split(",")]
    modes = ("on", "off") if args.error_handling == "both" else (args.error_handling,)
    saved = os.environ.get(ERROR_HANDLING_ENV)
    try:
        for mode in modes:
            os.environ[ERROR_HANDLING_ENV] = "1" if mode == "on" else "0"  # children inherit
            results = compare(sizes, args.blocks, args.repeats, args.warmup)
            if args.json:
                print(json.dumps([dict(r.as_row(), error_handling=mode) for r in results]))
            else:
                print(_table(results, mode), flush=True)
    finally:
        if saved is None:
            os.environ.pop(ERROR_HANDLING_ENV, None)
        else:
            os.environ[ERROR_HANDLING_ENV] = saved
    return 0


def _size(text: str) -> int:
    text = text.strip().upper()
    scale = {"K": KiB, "M": MiB}.get(text[-1:], 1)
    return int(text[:-1] if scale > 1 else text) * scale


if __name__ == "__main__":
    sys.exit(main())
