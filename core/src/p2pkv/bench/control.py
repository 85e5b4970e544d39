"""``p2pkv bench --control``: what the control plane costs.

Two measurements, in one run:

- **Round trips** of 200-byte frames between two processes, the ``zmq`` transport against
  raw pyzmq (DEALER -> ROUTER echo, the same library without p2pkv): the ``zmq``
  distribution's own benchmark (``p2pkv_zmq.bench.run_control_bench``), p50/p99 in µs,
  streamed messages per second, and the ratios.
- **Tier CPU per request**: a producer and a consumer ``P2PTier`` in this process, over each
  control transport with the ``memory`` data transport, run PD requests (consumer first):
  ``on_new_request``, ``lookup``, ``submit_load``, ``submit_store``, ticks until both jobs
  finished, ``on_request_finished``. CPU: 50 requests in flight at a time, process CPU time
  (both tiers, the session protocol, the codec, the control transport and its I/O threads;
  the block copies are 4 KiB memcpys) over the requests, with no observer plugin loaded
  (metrics plugins add their own cost). Latency: one request at a time, submit to both
  results.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from p2pkv.addressing import parse_address
from p2pkv.bench.data_transport import transport_region
from p2pkv.bench.hostinfo import environ_restored
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, DataSettings
from p2pkv.registry import Registry, default_registry
from p2pkv.types import Job, RequestContext

__all__ = ["run_control", "tier_cost"]

_BLOCK = 4096
_DEADLINE = 30.0


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(samples_s) * 1e6
    return {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "mean_us": float(arr.mean())}


# -- tier cost ------------------------------------------------------------------------------


class _Pair:
    """A producer and a consumer tier in this process, and PD requests between them."""

    def __init__(self, control: str, slots: int) -> None:
        from p2pkv.tier import P2PTier

        config = TierConfig.from_dict(
            {"control": control, "data": "memory", "host": "127.0.0.1", "port": 0}
        )
        installed = default_registry()
        bare = Registry.from_plugins([])  # no observer plugins: p2pkv's own cost only
        memory = installed.transport("data", "memory")
        self._regions = [transport_region(memory, slots, _BLOCK, {}) for _ in range(2)]
        self.producer, self.consumer = (
            P2PTier(
                config, region, _BLOCK, registry=bare,
                control=installed.transport("control", control).create(
                    ControlSettings(host=config.host, port=0)
                ),
                data=memory.create(DataSettings(region, _BLOCK)),
            )
            for region in self._regions
        )
        self._n = 0

    def submit(self, keys_per_request: int, slots: list[int]) -> tuple[Any, Any]:
        """Start one request (consumer first); returns its two contexts."""
        host, port = parse_address(self.producer.local_address)
        r = self._n = self._n + 1
        kv = f"ctl-{r}"
        keys = [r.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(keys_per_request)]
        cctx = RequestContext(f"c{r}", {"remote_prefiller": {
            "kv_request_id": kv, "remote_host": host, "remote_port": port}})
        pctx = RequestContext(f"p{r}", {"remote_decoder": {"kv_request_id": kv}})
        self.consumer.on_new_request(cctx)
        for key in keys:
            self.consumer.lookup(key, cctx)
        self.consumer.submit_load(Job(2 * r, keys, slots, is_load=True, ctx=cctx))
        self.producer.on_new_request(pctx)
        self.producer.submit_store(Job(2 * r + 1, keys, slots, is_load=False, ctx=pctx))
        return cctx, pctx

    def finish(self, contexts: list[tuple[Any, Any]]) -> None:
        """Tick both tiers until every job of ``contexts`` has its result, then finish them."""
        results: list[Any] = []
        limit = time.monotonic() + _DEADLINE
        while len(results) < 2 * len(contexts):
            results.extend(self.consumer.get_finished_jobs())
            results.extend(self.producer.get_finished_jobs())
            if len(results) < 2 * len(contexts):
                if time.monotonic() > limit:
                    raise TimeoutError(f"requests not finished in {_DEADLINE}s")
                self.producer.tick(0.0001)
                self.consumer.tick(0.0001)
        bad = [res for res in results if not res.success]
        if bad:
            raise RuntimeError(f"requests failed: {bad[:3]}")
        for cctx, pctx in contexts:
            self.consumer.on_request_finished(cctx)
            self.producer.on_request_finished(pctx)

    def close(self) -> None:
        self.producer.shutdown()
        self.consumer.shutdown()


def tier_cost(
    control: str, requests: int, blocks: int, window: int = 50, warmup: int = 20
) -> dict[str, Any]:
    """CPU per PD request and request latency through two tiers in this process.

    CPU: ``window`` requests are submitted at once and ticked to completion, so the cost of
    ticks that find nothing is shared by the window the way a busy engine shares it; process
    CPU time (both tiers and the control transport's I/O threads) over the requests.
    Latency: requests one at a time, submit to both results."""
    pair = _Pair(control, window * blocks)
    try:
        parse_address(pair.producer.local_address)
    except Exception as exc:  # not host:port: a router cannot name it in kv_transfer_params
        pair.close()
        return {"control": control, "blocks": blocks, "skipped": str(exc)}
    try:
        for _ in range(warmup):
            pair.finish([pair.submit(blocks, list(range(blocks)))])
        cpu0 = time.process_time()
        done = 0
        while done < requests:
            n = min(window, requests - done)
            pair.finish([pair.submit(blocks, list(range(i * blocks, (i + 1) * blocks)))
                         for i in range(n)])
            done += n
        cpu = time.process_time() - cpu0
        latencies = []
        for _ in range(min(requests, 200)):
            t0 = time.perf_counter()
            pair.finish([pair.submit(blocks, list(range(blocks)))])
            latencies.append(time.perf_counter() - t0)
    finally:
        pair.close()
    return {"control": control, "blocks": blocks, "requests": requests, "window": window,
            "cpu_us_per_request": cpu / requests * 1e6, **_percentiles(latencies)}


# -- the command ----------------------------------------------------------------------------


def _round_trips(quick: bool) -> dict[str, Any]:
    """The zmq transport's own control-plane benchmark, or why it cannot run."""
    try:
        from p2pkv_zmq.bench import run_control_bench
    except ImportError as exc:
        return {"skipped": f"needs p2pkv-zmq ({exc})"}
    if quick:
        return dict(run_control_bench(count=300, rounds=1, warmup=50))
    return dict(run_control_bench())


def run_control(args: argparse.Namespace, console: Console) -> int:
    import json

    registry = default_registry()
    requests = 100 if args.quick else 1000
    with environ_restored():
        controls = sorted(n for n, e in registry.entries("control").items()
                          if e.cls.availability() is None)
    rtt = _round_trips(args.quick)
    tiers = [tier_cost(name, requests, blocks) for name in controls for blocks in (1, 16)]
    doc = {"round_trips": rtt, "tier": tiers}
    if args.json:
        text = json.dumps(doc, indent=2, sort_keys=True)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.json != "-":
        _print_control(console, doc)
    return 0


def _print_control(console: Console, doc: dict[str, Any]) -> None:
    rtt = doc["round_trips"]
    if "skipped" in rtt:
        console.print(f"round trips not measured: {rtt['skipped']}")
    else:
        table = Table(title=f"control-plane round trips, {rtt['frame_bytes']} B frames, two "
                      f"processes ({rtt['round_trips']} per lane)", title_justify="left")
        for col in ("lane", "p50 µs", "p99 µs", "msgs/s (streamed)"):
            table.add_column(col, justify="right")
        for lane, r in rtt["lanes"].items():
            table.add_row(lane, f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                          f"{r['msgs_per_s']:.0f}")
        ratio = rtt["ratio"]
        table.add_row("p2pkv / raw", f"{ratio['p50_us']:.2f}x", f"{ratio['p99_us']:.2f}x",
                      f"{ratio['msgs_per_s']:.2f}x")
        console.print(table)
    cost = Table(title="tier control plane per PD request (producer + consumer tiers in one "
                 "process, memory data)", title_justify="left")
    for col in ("control", "blocks", "CPU µs/request", "latency p50 µs", "p99 µs"):
        cost.add_column(col, justify="right")
    for t in doc["tier"]:
        if "skipped" in t:
            continue
        cost.add_row(t["control"], str(t["blocks"]), f"{t['cpu_us_per_request']:.0f}",
                     f"{t['p50_us']:.0f}", f"{t['p99_us']:.0f}")
    console.print(cost)
