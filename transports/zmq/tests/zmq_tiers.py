"""P2PTier peers over ``zmq`` control and ``memory`` data in one process (real sockets, real
clock), built from tier configs through the registry like an engine adapter would; shared by
the zmq tier tests (a module of its own: ``test_*`` names repeat across test directories)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import numpy as np
import p2pkv_memory.plugin as memory_plugin
import p2pkv_zmq.plugin as zmq_plugin
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.registry import Registry
from p2pkv.testing.waiting import wait_until
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, Outcome, RequestContext

REGISTRY = Registry.from_plugins([("zmq", zmq_plugin), ("memory", memory_plugin)])
T = 10.0
NUM_BLOCKS, BLOCK_LEN = 64, 256


class Peer:
    """A tier over zmq control and memory data; ``config`` adds tier config keys, ``clock``
    is the tier's."""

    def __init__(
        self, seed: int, *, clock: Callable[[], float] = time.monotonic, **config: Any
    ) -> None:
        self.region = bytearray(NUM_BLOCKS * BLOCK_LEN)
        self.blocks = np.frombuffer(self.region, np.uint8).reshape(NUM_BLOCKS, BLOCK_LEN)
        self.blocks[:] = np.random.default_rng(seed).integers(0, 256, self.blocks.shape)
        tier_config = TierConfig.from_dict(
            {
                "control": "zmq",
                "data": "memory",
                "host": "127.0.0.1",
                "port": 0,
                **config,
            }
        )
        self.tier = P2PTier(
            tier_config, memoryview(self.region), BLOCK_LEN, registry=REGISTRY, clock=clock
        )
        self.host, self.port = parse_address(self.tier.local_address)
        self.results: dict[int, JobResult] = {}

    def collect(self) -> None:
        for r in self.tier.get_finished_jobs():
            assert r.job_id not in self.results, f"job {r.job_id} reported twice"
            self.results[r.job_id] = r

    def job(
        self, job_id: int, keys: list[bytes], slots: list[int], *, load: bool, ctx: RequestContext
    ) -> None:
        (self.tier.submit_load if load else self.tier.submit_store)(
            Job(job_id, keys, slots, load, ctx)
        )


def contexts(kv: str, producer: Peer) -> tuple[RequestContext, RequestContext]:
    return (
        RequestContext(f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}}),
        RequestContext(
            f"c-{kv}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv,
                    "remote_host": producer.host,
                    "remote_port": producer.port,
                }
            },
        ),
    )


def tick(*peers: Peer) -> Any:
    return lambda: [p.collect() for p in peers]


def run_request(
    producer: Peer,
    consumer: Peer,
    kv: str,
    slots: list[int],
    consumer_first: bool,
    *,
    settle: bool = True,
    finish: bool = True,
    timeout: float = T,
) -> None:
    """One PD request: store ``slots`` of the producer into mirrored consumer slots, its
    bytes checked. ``settle``: both sides tick between the two submits; ``finish``: both
    finish the request at the end (else the caller does, with :func:`contexts`);
    ``timeout``: the wait for both results (a first dial included)."""
    pctx, cctx = contexts(kv, producer)
    producer.tier.on_new_request(pctx)
    consumer.tier.on_new_request(cctx)
    keys = [f"{kv}/{i}".encode() for i in range(len(slots))]
    dst = [NUM_BLOCKS - 1 - s for s in slots]
    store_id, load_id = len(producer.results) + 1000, len(consumer.results) + 2000
    steps = [
        lambda: producer.job(store_id, keys, slots, load=False, ctx=pctx),
        lambda: consumer.job(load_id, keys, dst, load=True, ctx=cctx),
    ]
    if consumer_first:
        steps.reverse()
    steps[0]()
    if settle:
        tick(producer, consumer)()
    steps[1]()
    wait_until(
        lambda: store_id in producer.results and load_id in consumer.results,
        timeout=timeout,
        what=f"both results of {kv}",
        pumps=[tick(producer, consumer)],
    )
    assert producer.results[store_id].outcome is Outcome.DONE
    assert consumer.results[load_id].outcome is Outcome.DONE
    assert (consumer.blocks[dst] == producer.blocks[slots]).all(), f"{kv}: wrong bytes"
    if finish:
        producer.tier.on_request_finished(pctx)
        consumer.tier.on_request_finished(cctx)
