"""``p2pkv bench --control``: what the control plane costs.

Two measurements, in one run:

- **Round trips** of 200-byte frames between two processes: through each installed
  cross-process control transport (a ``ControlConnection`` ping-pong) and through raw pyzmq
  (DEALER -> ROUTER echo, the same library without p2pkv). p50/p99 in µs and the ratio.
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
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from rich.console import Console
from rich.table import Table

from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlConnection, ControlSettings
from p2pkv.registry import default_registry
from p2pkv.testing.child import Child
from p2pkv.types import Job, RequestContext

__all__ = ["pyzmq_round_trips", "run_control", "tier_cost", "transport_round_trips"]

_FRAME = 200
_BLOCK = 4096
_DEADLINE = 30.0


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(samples_s) * 1e6
    return {"p50_us": float(np.percentile(arr, 50)), "p99_us": float(np.percentile(arr, 99)),
            "mean_us": float(arr.mean())}


# -- round trips ----------------------------------------------------------------------------


def _echo_transport(conn: Connection, name: str) -> None:
    transport = default_registry().transport("control", name).create(
        ControlSettings(host="127.0.0.1", port=0)
    )
    conn.send(transport.local_address)
    peers: list[ControlConnection] = []
    try:
        while not conn.poll(0):
            peers.extend(transport.poll(0.0005))
            for peer in peers:
                for frame in peer.recv():
                    peer.send(frame)
    finally:
        transport.close()


def transport_round_trips(name: str, count: int, warmup: int = 100) -> list[float]:
    """Seconds per round trip of a 200-byte frame through control transport ``name``."""
    cls = default_registry().transport("control", name)
    frame = bytes(_FRAME)
    with Child(_echo_transport, name, name="p2pkv-bench-echo") as child:
        address = child.recv(_DEADLINE, "the echo address")
        transport = cls.create(ControlSettings(host="127.0.0.1", port=0))
        try:
            link = transport.connect(address)
            out = []
            for i in range(warmup + count):
                t0 = time.perf_counter()
                link.send(frame)
                limit = time.monotonic() + _DEADLINE
                while not link.recv():
                    transport.poll(0.0005)
                    if time.monotonic() > limit:
                        raise TimeoutError(f"{name}: no echo in {_DEADLINE}s")
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
            return out
        finally:
            transport.close()
            child.send("stop")


def _echo_pyzmq(conn: Connection) -> None:
    import zmq

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn.send(port)
    try:
        while not conn.poll(0):
            if router.poll(1):
                router.send_multipart(router.recv_multipart())
    finally:
        router.close(0)
        ctx.term()


def pyzmq_round_trips(count: int, warmup: int = 100) -> list[float]:
    """Seconds per round trip of a 200-byte frame, DEALER -> ROUTER echo, raw pyzmq."""
    import zmq

    frame = bytes(_FRAME)
    with Child(_echo_pyzmq, name="p2pkv-bench-zmq-echo") as child:
        port = child.recv(_DEADLINE, "the echo port")
        ctx = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{port}")
        try:
            out = []
            for i in range(warmup + count):
                t0 = time.perf_counter()
                dealer.send(frame)
                if not dealer.poll(int(_DEADLINE * 1000)):
                    raise TimeoutError(f"raw pyzmq: no echo in {_DEADLINE}s")
                dealer.recv()
                if i >= warmup:
                    out.append(time.perf_counter() - t0)
            return out
        finally:
            dealer.close(0)
            ctx.term()
            child.send("stop")


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


def run_control(args: argparse.Namespace, console: Console) -> int:
    import json

    registry = default_registry()
    count = 300 if args.quick else 3000
    requests = 100 if args.quick else 1000
    controls = sorted(n for n, e in registry.entries("control").items()
                      if e.cls.availability() is None)
    rtt: dict[str, dict[str, float]] = {}
    zmq_ok = registry.entries("control").get("zmq") is not None
    if zmq_ok:
        rtt["raw pyzmq"] = _percentiles(pyzmq_round_trips(count))
    for name in controls:
        if registry.entries("control")[name].cls.capabilities.cross_process:
            rtt[f"p2pkv {name}"] = _percentiles(transport_round_trips(name, count))
    if "p2pkv zmq" in rtt and "raw pyzmq" in rtt:
        rtt["p2pkv zmq"]["ratio_raw_p50"] = rtt["p2pkv zmq"]["p50_us"] / rtt["raw pyzmq"]["p50_us"]
    tiers = [tier_cost(name, requests, blocks) for name in controls for blocks in (1, 16)]
    doc = {"frame_bytes": _FRAME, "round_trips": count, "rtt": rtt, "tier": tiers}
    if args.json:
        text = json.dumps(doc, indent=2, sort_keys=True)
        if args.json == "-":
            print(text)
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.json != "-":
        table = Table(title=f"control-plane round trips, {_FRAME} B frames, two processes",
                      title_justify="left")
        for col in ("path", "p50 µs", "p99 µs", "p50 vs raw"):
            table.add_column(col, justify="right")
        for label, r in rtt.items():
            ratio = r.get("ratio_raw_p50")
            table.add_row(label, f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}",
                          f"{ratio:.2f}x" if ratio else "")
        console.print(table)
        cost = Table(title="tier control plane per PD request (producer + consumer tiers, "
                     "memory data)", title_justify="left")
        for col in ("control", "blocks", "CPU µs/request", "latency p50 µs", "p99 µs"):
            cost.add_column(col, justify="right")
        for t in tiers:
            if "skipped" in t:
                continue
            cost.add_row(t["control"], str(t["blocks"]), f"{t['cpu_us_per_request']:.0f}",
                         f"{t['p50_us']:.0f}", f"{t['p99_us']:.0f}")
        console.print(cost)
    return 0
