"""``p2pkv bench --control``: what the control plane costs.

Two measurements, in one run:

- **Round trips** of 200-byte frames between two processes, the ``zmq`` transport against
  raw pyzmq (DEALER -> ROUTER echo, the same library without p2pkv): the ``zmq``
  distribution's own benchmark (``p2pkv_zmq.bench.run_control_bench``), p50/p99 in µs,
  streamed messages per second, and the ratios.
- **Tier CPU per request**: a producer and a consumer ``P2PTier`` in this process, over each
  control transport with the ``memory`` data transport, run PD requests of 1, 16 and 32
  blocks (consumer first): ``on_new_request``, ``lookup``, ``submit_load``,
  ``submit_store``, ticks until both jobs finished, ``on_request_finished``. CPU: 50
  requests in flight at a time, process CPU time (the tiers, the session protocol, the
  codec, the control transport and its I/O threads; the block copies are 4 KiB memcpys)
  over the requests, built before the measured window, with no observer plugin loaded
  (metrics plugins add their own cost); the least of 3 repeats. Latency: one request at a
  time, submit to both results. ``--quick``: 200 requests per repeat.
- **Sweeps** (not with ``--quick``): CPU per 32-block request with 1 to 1,000 requests in
  flight, and with 1 to 64 producer peers (64 requests in flight, spread over them).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, DataSettings
from p2pkv.registry import Registry, default_registry
from p2pkv.types import Job, RequestContext
from rich.console import Console
from rich.table import Table

from p2pkv_tools.bench.data_transport import transport_region
from p2pkv_tools.bench.hostinfo import environ_restored

if TYPE_CHECKING:
    from p2pkv.tier import P2PTier

__all__ = ["run_control", "tier_cost"]

_BLOCK = 4096
_DEADLINE = 30.0
_LANES = (1, 16, 32)
"""Blocks per request of the main lanes."""
_QUICK_REQUESTS = 200
_SWEEP_BLOCKS = 32
_IN_FLIGHT = (1, 10, 100, 1000)
"""Requests in flight of the in-flight sweep (one peer)."""
_PEERS = (1, 4, 16, 64)
"""Producer peers of the peers sweep (requests spread over them in turn, 64 in flight)."""


def _percentiles(samples_s: Sequence[float]) -> dict[str, float]:
    arr = np.asarray(samples_s) * 1e6
    return {
        "p50_us": float(np.percentile(arr, 50)),
        "p99_us": float(np.percentile(arr, 99)),
        "mean_us": float(arr.mean()),
    }


# -- tier cost ------------------------------------------------------------------------------


class _Request:
    """One PD request, built before the CPU window: its contexts, keys and both jobs."""

    __slots__ = ("cctx", "keys", "load", "pctx", "store")

    def __init__(self, r: int, producer: str, slots: list[int], store_slots: list[int]) -> None:
        host, port = parse_address(producer)
        blocks = len(slots)
        kv = f"ctl-{r}"
        self.keys = [r.to_bytes(8, "little") + i.to_bytes(8, "little") for i in range(blocks)]
        self.cctx = RequestContext(
            f"c{r}",
            {"remote_prefiller": {"kv_request_id": kv, "remote_host": host, "remote_port": port}},
        )
        self.pctx = RequestContext(f"p{r}", {"remote_decoder": {"kv_request_id": kv}})
        self.load = Job(2 * r, self.keys, slots, is_load=True, ctx=self.cctx)
        self.store = Job(2 * r + 1, self.keys, store_slots, is_load=False, ctx=self.pctx)


class _Tiers:
    """A consumer tier and ``peers`` producer tiers in this process, and PD requests between
    them (the producers in turn)."""

    def __init__(self, control: str, peers: int, consumer_slots: int, producer_slots: int) -> None:
        from p2pkv.tier import P2PTier

        config = TierConfig.from_dict(
            {"control": control, "data": "memory", "host": "127.0.0.1", "port": 0}
        )
        installed = default_registry()
        bare = Registry.from_plugins([])  # no observer plugins: p2pkv's own cost only
        memory = installed.transport("data", "memory")
        sizes = [consumer_slots] + [producer_slots] * peers
        self._regions = [transport_region(memory, n, _BLOCK, {}) for n in sizes]
        self.tiers = [
            P2PTier(
                config,
                region,
                _BLOCK,
                registry=bare,
                control=installed.transport("control", control).create(
                    ControlSettings(host=config.host, port=0)
                ),
                data=memory.create(DataSettings(region, _BLOCK)),
            )
            for region in self._regions
        ]
        self.consumer, self.producers = self.tiers[0], self.tiers[1:]
        self._n = 0
        in_process = not installed.transport("control", control).capabilities.cross_process
        self._wait = 0.0 if in_process else 0.0001
        """How long a tick waits for frames: not at all in process (frames move in the
        receiver's poll, and the one thread that could send them is this one)."""

    def build(self, count: int, blocks: int) -> list[tuple[P2PTier, _Request]]:
        """``count`` requests, each with its producer (in turn): request ``i`` uses consumer
        slots ``i * blocks...`` and slots ``i // peers * blocks...`` of its producer."""
        out = []
        peers = len(self.producers)
        for i in range(count):
            r = self._n = self._n + 1
            producer = self.producers[r % peers]
            j = i // peers
            out.append(
                (
                    producer,
                    _Request(
                        r,
                        producer.local_address,
                        list(range(i * blocks, (i + 1) * blocks)),
                        list(range(j * blocks, (j + 1) * blocks)),
                    ),
                )
            )
        return out

    def run(self, batch: list[tuple[P2PTier, _Request]]) -> None:
        """Submit ``batch`` (consumer first), tick every tier until each job has its result,
        then finish the requests."""
        consumer = self.consumer
        for producer, req in batch:
            consumer.on_new_request(req.cctx)
            for key in req.keys:
                consumer.lookup(key, req.cctx)
            consumer.submit_load(req.load)
            producer.on_new_request(req.pctx)
            producer.submit_store(req.store)
        self._finish(2 * len(batch))
        for producer, req in batch:
            consumer.on_request_finished(req.cctx)
            producer.on_request_finished(req.pctx)

    def _finish(self, jobs: int) -> None:
        results: list[Any] = []
        limit = time.monotonic() + _DEADLINE
        while True:
            for tier in self.tiers:
                results.extend(tier.get_finished_jobs())
            if len(results) >= jobs:
                break
            if time.monotonic() > limit:
                raise TimeoutError(f"requests not finished in {_DEADLINE}s")
            for tier in reversed(self.tiers):
                tier.tick(self._wait)
        bad = [res for res in results if not res.success]
        if bad:
            raise RuntimeError(f"requests failed: {bad[:3]}")

    def close(self) -> None:
        for tier in self.tiers:
            tier.shutdown()


def tier_cost(
    control: str,
    requests: int,
    blocks: int,
    window: int = 50,
    peers: int = 1,
    repeats: int = 3,
    latency: bool = True,
) -> dict[str, Any]:
    """CPU per PD request (and request latency) through tiers in this process.

    CPU: ``window`` requests are submitted at once and ticked to completion, so the cost of
    ticks that find nothing is shared by the window the way a busy engine shares it; process
    CPU time (every tier and the control transports' I/O threads) over the requests, the
    requests (keys, contexts, jobs) built outside it. ``repeats`` runs of ``requests``; the
    least is reported (the machine's noise only adds). Latency: one request at a time,
    submit to both results."""
    per_producer = -(-window // peers)
    tiers = _Tiers(control, peers, window * blocks, per_producer * blocks)
    try:
        parse_address(tiers.producers[0].local_address)
    except Exception as exc:  # not host:port: a router cannot name it in kv_transfer_params
        tiers.close()
        return {"control": control, "blocks": blocks, "skipped": str(exc)}
    try:
        for _ in range(max(20, peers)):  # connect every peer, warm the caches
            tiers.run(tiers.build(1, blocks))
        runs = [_cpu_per_request(tiers, requests, blocks, window) for _ in range(repeats)]
        latencies = []
        for _ in range(min(requests, 200) if latency else 0):
            batch = tiers.build(1, blocks)
            t0 = time.perf_counter()
            tiers.run(batch)
            latencies.append(time.perf_counter() - t0)
    finally:
        tiers.close()
    return {
        "control": control,
        "blocks": blocks,
        "requests": requests,
        "window": window,
        "peers": peers,
        "repeats": repeats,
        "cpu_us_per_request": min(runs),
        "cpu_us_runs": runs,
        **(_percentiles(latencies) if latencies else {}),
    }


def _cpu_per_request(tiers: _Tiers, requests: int, blocks: int, window: int) -> float:
    cpu = 0.0
    done = 0
    while done < requests:
        n = min(window, requests - done)
        batch = tiers.build(n, blocks)
        cpu0 = time.process_time()
        tiers.run(batch)
        cpu += time.process_time() - cpu0
        done += n
    return cpu / requests * 1e6


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
    requests = _QUICK_REQUESTS if args.quick else 1000
    with environ_restored():
        controls = sorted(
            n for n, e in registry.entries("control").items() if e.cls.availability() is None
        )
    rtt = _round_trips(args.quick)
    tiers = [tier_cost(name, requests, blocks) for name in controls for blocks in _LANES]
    doc: dict[str, Any] = {"round_trips": rtt, "tier": tiers}
    if not args.quick:
        doc["sweeps"] = {
            "in_flight": [
                tier_cost(name, max(requests, w), _SWEEP_BLOCKS, window=w, latency=False)
                for name in controls
                for w in _IN_FLIGHT
            ],
            "peers": [
                tier_cost(name, requests, _SWEEP_BLOCKS, window=max(_PEERS), peers=n, latency=False)
                for name in controls
                for n in _PEERS
            ],
        }
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
        table = Table(
            title=f"control-plane round trips, {rtt['frame_bytes']} B frames, two "
            f"processes ({rtt['round_trips']} per lane)",
            title_justify="left",
        )
        for col in ("lane", "p50 µs", "p99 µs", "msgs/s (streamed)"):
            table.add_column(col, justify="right")
        for lane, r in rtt["lanes"].items():
            table.add_row(
                lane, f"{r['p50_us']:.0f}", f"{r['p99_us']:.0f}", f"{r['msgs_per_s']:.0f}"
            )
        ratio = rtt["ratio"]
        table.add_row(
            "p2pkv / raw",
            f"{ratio['p50_us']:.2f}x",
            f"{ratio['p99_us']:.2f}x",
            f"{ratio['msgs_per_s']:.2f}x",
        )
        console.print(table)
    cost = Table(
        title="tier control plane per PD request (producer + consumer tiers in one "
        "process, memory data)",
        title_justify="left",
    )
    for col in ("control", "blocks", "CPU µs/request", "latency p50 µs", "p99 µs"):
        cost.add_column(col, justify="right")
    for t in doc["tier"]:
        if "skipped" in t:
            continue
        cost.add_row(
            t["control"],
            str(t["blocks"]),
            f"{t['cpu_us_per_request']:.0f}",
            f"{t['p50_us']:.0f}",
            f"{t['p99_us']:.0f}",
        )
    console.print(cost)
    for name, col in (("in_flight", "window"), ("peers", "peers")):
        sweep = Table(
            title=f"CPU µs per {_SWEEP_BLOCKS}-block request by {col} (least of the repeats)",
            title_justify="left",
        )
        for head in ("control", col, "CPU µs/request"):
            sweep.add_column(head, justify="right")
        for t in doc.get("sweeps", {}).get(name, []):
            if "skipped" not in t:
                sweep.add_row(t["control"], str(t[col]), f"{t['cpu_us_per_request']:.0f}")
        if sweep.row_count:
            console.print(sweep)
