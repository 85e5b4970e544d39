"""``p2pkv bench --control``: what the control plane costs.

Two measurements, in one run:

- **Round trips** of 200-byte frames between two processes, the ``zmq`` transport against
  raw pyzmq (DEALER -> ROUTER echo, the same library without p2pkv): the ``zmq``
  distribution's own benchmark (``p2pkv_zmq.bench.run_control_bench``), p50/p99 in µs,
  streamed messages per second, and the ratios.
- **Tier CPU per request**: a producer and a consumer ``P2PTier`` in this process, over each
  control transport with the ``memory`` data transport, run PD requests one at a time
  (consumer first): ``on_new_request``, ``lookup``, ``submit_load``, ``submit_store``, ticks
  until both jobs finished, ``on_request_finished``. The process CPU time per request (both
  tiers, the session protocol, the codec, the control transport and its I/O threads; the
  block copy is 64 KiB of memcpy) and the wall latency per request. Idle waits block in the
  transport's poll, so they cost no CPU.
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
from p2pkv.bench.hostinfo import environ_restored
from p2pkv.config import TierConfig
from p2pkv.registry import default_registry
from p2pkv.types import Job, RequestContext

__all__ = ["run_control", "tier_cost"]

_BLOCK = 4096
_DEADLINE = 30.0


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(samples_s) * 1e6
    return {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "mean_us": float(arr.mean())}


# -- tier cost ------------------------------------------------------------------------------


def tier_cost(control: str, requests: int, blocks: int, warmup: int = 20) -> dict[str, Any]:
    """CPU and wall time per PD request through two tiers in this process (see module doc)."""
    from p2pkv.tier import P2PTier

    config = TierConfig.from_dict(
        {"control": control, "data": "memory", "host": "127.0.0.1", "port": 0}
    )
    bufs = [np.zeros(blocks * _BLOCK, np.uint8) for _ in range(2)]
    producer = P2PTier(config, bufs[0].data, _BLOCK)
    consumer = P2PTier(config, bufs[1].data, _BLOCK)
    try:
        host, port = parse_address(producer.local_address)
    except Exception as exc:  # not host:port: a router cannot name it in kv_transfer_params
        producer.shutdown()
        consumer.shutdown()
        return {"control": control, "blocks": blocks, "skipped": str(exc)}
    slots = list(range(blocks))
    latencies = []
    cpu = 0.0
    try:
        for r in range(warmup + requests):
            kv = f"ctl-{r}"
            keys = [r.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(blocks)]
            cctx = RequestContext(f"c{r}", {"remote_prefiller": {
                "kv_request_id": kv, "remote_host": host, "remote_port": port}})
            pctx = RequestContext(f"p{r}", {"remote_decoder": {"kv_request_id": kv}})
            c0, t0 = time.process_time(), time.perf_counter()
            consumer.on_new_request(cctx)
            for key in keys:
                consumer.lookup(key, cctx)
            consumer.submit_load(Job(2 * r, keys, slots, is_load=True, ctx=cctx))
            producer.on_new_request(pctx)
            producer.submit_store(Job(2 * r + 1, keys, slots, is_load=False, ctx=pctx))
            results = _until_both(producer, consumer)
            consumer.on_request_finished(cctx)
            producer.on_request_finished(pctx)
            c1, t1 = time.process_time(), time.perf_counter()
            bad = [res for res in results if not res.success]
            if bad:
                raise RuntimeError(f"request {r} failed: {bad}")
            if r >= warmup:
                cpu += c1 - c0
                latencies.append(t1 - t0)
    finally:
        producer.shutdown()
        consumer.shutdown()
    return {"control": control, "blocks": blocks, "requests": requests,
            "cpu_us_per_request": cpu / requests * 1e6, **_percentiles(latencies)}


def _until_both(producer: Any, consumer: Any) -> list[Any]:
    results: list[Any] = []
    limit = time.monotonic() + _DEADLINE
    while len(results) < 2:
        results.extend(consumer.get_finished_jobs())
        results.extend(producer.get_finished_jobs())
        if len(results) < 2:
            if time.monotonic() > limit:
                raise TimeoutError(f"request not finished in {_DEADLINE}s")
            producer.tick(0.00005)
            consumer.tick(0.00005)
    return results


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
