"""Control-plane cost of p2pkv: CPU microseconds per 32-block PD request, end to end.

One consumer tier and N producer tiers in this process over the ``memory`` transports
(tiny blocks, so the data copy is negligible and what is measured is the core: routing,
ledger, sessions, msgpack codec, matching, timers, plus the memory transports' own
bookkeeping). Each request: the producer stores 32 blocks (one job), the consumer loads them
(one job), both get their results, both finish the request (terminal fetch included).
Requests run in waves of ``concurrency``, spread round-robin over the producers; each wave
ticks the consumer and the producers that have work in it until every result is in.

The figure is process CPU time (``time.process_time``) over all tiers divided by the number
of requests, after a warm-up that opens every session. It is a benchmark, not a test.

    .venv/bin/python bench/control_plane.py [--requests N] [--concurrency 1,100,1000]
                                            [--peers 1,8,64]
"""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import p2pkv_memory.plugin as memory_plugin
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.registry import Registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, Outcome, RequestContext

BLOCKS = 32
BLOCK_LEN = 64
REGISTRY = Registry.from_plugins([("memory", memory_plugin)])
CONFIG = TierConfig.from_dict({"control": "memory", "data": "memory", "host": "127.0.0.1",
                               "port": 0})


@dataclass
class Result:
    concurrency: int
    peers: int
    requests: int
    cpu_us_per_request: float
    ticks_per_wave: float


class Bench:
    def __init__(self, peers: int, concurrency: int) -> None:
        slots = BLOCKS * max(concurrency, peers, 50)
        self.consumer = P2PTier(CONFIG, memoryview(bytearray(slots * BLOCK_LEN)), BLOCK_LEN,
                                registry=REGISTRY)
        self.producers = [P2PTier(CONFIG, memoryview(bytearray(BLOCKS * BLOCK_LEN)), BLOCK_LEN,
                                  registry=REGISTRY) for _ in range(peers)]
        self.addrs = [parse_address(p.local_address) for p in self.producers]
        self.seq = 0
        self.keys_cache: dict[int, list[bytes]] = {}

    def close(self) -> None:
        for t in (self.consumer, *self.producers):
            t.shutdown()

    def wave(self, n: int) -> int:
        """Run ``n`` concurrent requests to completion; returns the ticks it took."""
        reqs = []
        active = set()
        for i in range(n):
            self.seq += 1
            kv = f"r{self.seq}"
            pi = i % len(self.producers)
            host, port = self.addrs[pi]
            pctx = RequestContext(kv, {"remote_decoder": {"kv_request_id": kv}})
            cctx = RequestContext(kv, {"remote_prefiller": {
                "kv_request_id": kv, "remote_host": host, "remote_port": port}})
            keys = [b"%s/%d" % (kv.encode(), j) for j in range(BLOCKS)]
            prod = self.producers[pi]
            prod.on_new_request(pctx)
            self.consumer.on_new_request(cctx)
            prod.submit_store(Job(2 * self.seq, keys, list(range(BLOCKS)), False, pctx))
            base = i * BLOCKS
            self.consumer.submit_load(
                Job(2 * self.seq + 1, keys, list(range(base, base + BLOCKS)), True, cctx))
            reqs.append((prod, pctx, cctx))
            active.add(pi)
        tiers = [self.consumer, *(self.producers[i] for i in sorted(active))]
        pending = 2 * n
        ticks = 0
        while pending:
            ticks += 1
            for t in tiers:
                for r in t.get_finished_jobs():
                    if r.outcome is not Outcome.DONE:
                        raise RuntimeError(f"job {r.job_id} failed: {r}")
                    pending -= 1
            if ticks > 10_000:
                raise RuntimeError("wave did not complete")
        for prod, pctx, cctx in reqs:
            prod.on_request_finished(pctx)
            self.consumer.on_request_finished(cctx)
        for _ in range(2):
            for t in tiers:
                t.tick()
        return ticks


def measure(peers: int, concurrency: int, requests: int) -> Result:
    bench = Bench(peers, concurrency)
    try:
        bench.wave(max(peers, 1))  # warm-up: every session handshaken
        bench.wave(min(concurrency, 50))
        waves = max(1, requests // concurrency)
        gc.collect()
        t0 = time.process_time()
        ticks = sum(bench.wave(concurrency) for _ in range(waves))
        cpu = time.process_time() - t0
        done = waves * concurrency
        return Result(concurrency, peers, done, cpu / done * 1e6, ticks / waves)
    finally:
        bench.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--requests", type=int, default=2000,
                    help="requests per cell (at least one wave)")
    ap.add_argument("--concurrency", default="1,100,1000")
    ap.add_argument("--peers", default="1,8,64")
    args = ap.parse_args(argv)
    concs = [int(x) for x in args.concurrency.split(",")]
    peers = [int(x) for x in args.peers.split(",")]
    results = {(c, p): measure(p, c, max(args.requests, c)) for c in concs for p in peers}
    print(f"CPU microseconds per {BLOCKS}-block PD request, end to end, memory transports "
          f"(consumer + producers, one process)")
    head = "concurrent \\ peers"
    print(f"{head:>20}" + "".join(f"{p:>12}" for p in peers))
    for c in concs:
        print(f"{c:>20}" + "".join(f"{results[(c, p)].cpu_us_per_request:>12.0f}"
                                   for p in peers))
    print("\nticks per wave (each tick = one get_finished_jobs on every tier with work)")
    for c in concs:
        print(f"{c:>20}" + "".join(f"{results[(c, p)].ticks_per_wave:>12.1f}"
                                   for p in peers))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
