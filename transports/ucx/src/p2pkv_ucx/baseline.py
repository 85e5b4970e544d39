"""Throughput of raw ucxx and of the p2pkv ``ucx`` transport alone, measured the same way.

- :class:`RawUcxxBaseline` is ucxx tag send/receive with no p2pkv, in the transport's
  direction (wire 2: the consumer reads): ``read_blocks`` posts one receive per block straight
  into its slot (tag: read id and position) and sends the source one small request naming the
  source blocks; the source's ``progress``/``poll`` answers with one message per block. No
  staging, no validation, no coalescing. It is duck-typed like a ``DataTransport`` (the
  ``p2pkv_bench_baselines`` hook offers it to ``p2pkv bench`` as ``raw ucx``), with the same
  ``endpoint_error_handling`` as the transport (option, ``P2PKV_UCX_ENDPOINT_ERROR_HANDLING``,
  default on), so the two are compared on the same UCX lanes.
- :func:`run_raw` and :func:`run_transport` time one series with ``p2pkv bench``'s own cell
  runner: ``num_blocks`` scattered blocks between this process and a child, one request per
  repetition, every repetition's destination bytes checked. They return seconds per
  repetition.

``python -m p2pkv_ucx.baseline`` prints GB/s (10^9 B/s) of raw ucxx, the transport and
memcpy for 256 blocks of 64 KiB, 256 KiB, 1 MiB and 2 MiB, with the ratios, for endpoint
error handling on, off or both. Set ``UCX_NET_DEVICES=lo`` on one host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from p2pkv.contracts import DataSettings, PollResult
from p2pkv.errors import TransportUnavailable
from p2pkv.registry import default_registry
from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.lanes import EndpointLane
from p2pkv_tools.bench.matrix import MatrixConfig, available_series, run_matrix
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.target import RemoteTarget, page_in

from p2pkv_ucx import library
from p2pkv_ucx.options import ERROR_HANDLING_ENV, UcxOptions
from p2pkv_ucx.transport import UcxDataTransport

__all__ = ["RawUcxxBaseline", "main", "run_raw", "run_transport"]

KiB = 1024
MiB = 1024 * KiB
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)


class RawUcxxBaseline:
    """ucxx without p2pkv, consumer-initiated. Driver-thread only; checks nothing; not for
    production (a request names its sender by an id from its descriptor, trusted as is)."""

    name: ClassVar[str] = "ucx"
    capabilities = UcxDataTransport.capabilities

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> RawUcxxBaseline:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        lib = library.load()
        api = lib.api
        self._error_handling = UcxOptions.from_mapping(settings.options).endpoint_error_handling
        self._api, self._array, self._tag, self._mask = api, lib.array, api.UCXXTag, api.UCXXTagMask
        with library.ucx_environment(lib.env):
            self._ctx: Any = api.UCXContext(feature_flags=(api.Feature.TAG,))
        self._worker: Any = api.UCXWorker(self._ctx)
        self._blocks = np.frombuffer(settings.region, np.uint8).reshape(-1, settings.block_len)
        self._id = int.from_bytes(os.urandom(7), "little") | 1
        self._eps: dict[str, Any] = {}
        self._by_id: dict[int, Any] = {}
        self._links: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._inflight: dict[str, dict[int, list[Any]]] = {}
        self._requests: list[tuple[Any, np.ndarray]] = []
        self._sends: list[Any] = []

    def descriptor(self) -> bytes:
        return self._id.to_bytes(8, "little") + bytes(self._worker.address.tobytes())

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        address = self._api.UCXAddress.create_from_buffer(descriptor[8:])
        ep = self._api.UCXEndpoint.create_from_worker_address(
            self._worker, address, self._error_handling
        )
        self._eps[peer_id] = ep
        self._by_id[int.from_bytes(descriptor[:8], "little")] = ep
        self._links[peer_id] = len(self._links) + 1
        self._inflight.setdefault(peer_id, {})

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Post a receive per block into its slot, then ask the peer for the blocks."""
        ep, array, tag, blocks = self._eps[peer_id], self._array, self._tag, self._blocks
        tid = next(self._ids)
        base = (self._links[peer_id] << 48) | ((tid & 0xFFFFFF) << 24)
        reqs = [ep.tag_recv(array(blocks[i]), tag(base | k)) for k, i in enumerate(local_idxs)]
        head = np.array([self._id, base], np.uint64).view(np.uint8)
        request = np.concatenate([head, np.asarray(remote_idxs, np.uint32).view(np.uint8)])
        self._sends.append((ep.tag_send(array(request), tag(_REQUEST)), request))
        self._inflight[peer_id][tid] = reqs[::-1]  # popped from the end as they complete
        return tid

    def progress(self) -> None:
        """Progress UCX and answer peers' requests with one message per block."""
        worker = self._worker
        worker.progress()
        while True:
            found = worker.tag_probe(self._tag(_REQUEST), self._mask((1 << 64) - 1), remove=True)
            if not found.matched:
                break
            buf = np.empty(found.length, np.uint8)
            self._requests.append((worker.tag_recv_with_handle(self._array(buf), found), buf))
        worker.progress()
        while self._requests and self._requests[0][0].completed:
            self._serve(self._requests.pop(0)[1])
        self._sends = [s for s in self._sends if not s[0].completed]

    def _serve(self, request: np.ndarray) -> None:
        sender, base = (int(v) for v in request[:16].view(np.uint64))
        ep, array, tag, blocks = self._by_id[sender], self._array, self._tag, self._blocks
        for k, j in enumerate(request[16:].view(np.uint32).tolist()):
            self._sends.append((ep.tag_send(array(blocks[j]), tag(base | k)), None))

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.progress()
        done: list[int] = []
        failed: list[int] = []
        for pid, transfers in self._inflight.items():
            if peer_id is not None and pid != peer_id:
                continue
            for tid, reqs in list(transfers.items()):
                while reqs and reqs[-1].completed:
                    if reqs.pop().status != 0:
                        failed.append(tid)
                        reqs.clear()
                if not reqs:
                    del transfers[tid]
                    if tid not in failed:
                        done.append(tid)
        return PollResult(done, failed)

    def close(self) -> list[int]:
        left = sorted(tid for transfers in self._inflight.values() for tid in transfers)
        if not left and not self._sends:
            self._eps.clear()
            self._by_id.clear()
            self._worker = self._ctx = None
        return left


_REQUEST = 1 << 63
"""Tag of a raw read request (a data tag is link << 48 | read << 24 | position, below it)."""


def _measure(impl: str, block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    registry = default_registry()
    spec = SeriesSpec(impl, "ucx", cross_process=True)
    region_bytes = 2 * num_blocks * block_len  # slots scattered over twice what one rep needs
    target = RemoteTarget(region_bytes)
    try:
        lane = EndpointLane(spec, registry, page_in(region_bytes).data, target)
        lane.open(block_len)
        try:
            plan = CellPlan(block_size=block_len, batch=num_blocks, concurrency=1, requests=1,
                            reps=repeats, warmup=warmup)
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


def compare(
    sizes: Sequence[int], num_blocks: int, repeats: int, warmup: int
) -> list[CellResult]:
    """Raw ucxx, the ``ucx`` transport and memcpy, side by side per size (``p2pkv bench``)."""
    registry = default_registry()
    config = MatrixConfig(
        block_sizes=tuple(sizes), batches=(num_blocks,), concurrency=(1,), reps=repeats,
        warmup=warmup, bytes_per_rep=0, region_bytes=2 * num_blocks * max(sizes),
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
    lines = [f"endpoint error handling {mode}: GB/s (median of reps), ratios",
             f"{'block':>8} {'raw ucxx':>9} {'p2pkv ucx':>10} {'memcpy':>8} "
             f"{'ucx/raw':>8} {'ucx/memcpy':>10} {'raw/memcpy':>10}"]
    for size, by_impl in sorted(rows.items()):
        raw, ucx, mem = (by_impl.get(k) for k in ("raw", "p2pkv", "memcpy"))
        g = [x.gbps if x is not None and not x.error else float("nan") for x in (raw, ucx, mem)]
        lines.append(f"{_label(size):>8} {g[0]:9.2f} {g[1]:10.2f} {g[2]:8.2f} "
                     f"{g[1] / g[0]:8.2f} {g[1] / g[2]:10.2f} {g[0] / g[2]:10.2f}")
        for x in (raw, ucx, mem):
            if x is not None and x.error:
                lines.append(f"         {x.series}: {x.error}")
    return "\n".join(lines)


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m p2pkv_ucx.baseline", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--sizes", default="64K,256K,1M,2M",
                        help="comma-separated block sizes (K/M suffixes)")
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
