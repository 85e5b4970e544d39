"""Programs the nixl tests run in spawned children (importable by name: conftest puts this
directory on ``sys.path``, which ``multiprocessing`` hands to its children)."""

from __future__ import annotations

import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from p2pkv.config import TierConfig
from p2pkv.testing.peers import pattern
from p2pkv.tier import P2PTier
from p2pkv.types import Job, RequestContext

_LIFETIME = 120.0  # seconds; a child never outlives this

TIER_CONFIG = {"control": "zmq", "data": "nixl", "host": "127.0.0.1", "port": 0}


def producer_tier(pipe: Connection, seed: int, num_blocks: int, block_len: int) -> None:
    """A producer ``P2PTier`` (zmq control, nixl data) over ``pattern(seed)`` blocks.

    Reports ``("address", addr)``, then serves requests until ``"stop"``, ticking the tier
    between them (so NIXL progresses):
    ``("store", kv, job_id, keys, slots)`` -> ``"ok"`` (new request + store job);
    ``("finish", kv)`` -> ``"ok"``; ``"results"`` -> ``[(job_id, outcome), ...]`` since the
    last ask.
    """
    region = bytearray(num_blocks * block_len)
    blocks = np.frombuffer(region, dtype=np.uint8).reshape(num_blocks, block_len)
    blocks[:] = pattern(seed, num_blocks * block_len).reshape(num_blocks, block_len)
    tier = P2PTier(TierConfig.from_dict(TIER_CONFIG), memoryview(region), block_len)
    pipe.send(("address", tier.local_address))
    contexts: dict[str, RequestContext] = {}
    results: list[tuple[int, str]] = []
    deadline = time.monotonic() + _LIFETIME
    try:
        while time.monotonic() < deadline:
            results.extend((r.job_id, r.outcome.value) for r in tier.get_finished_jobs())
            if not pipe.poll(0):
                continue
            request: Any = pipe.recv()
            if request == "stop":
                break
            if request == "results":
                pipe.send(results)
                results = []
            elif request[0] == "store":
                _, kv, job_id, keys, slots = request
                ctx = contexts[kv] = RequestContext(
                    f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}}
                )
                tier.on_new_request(ctx)
                tier.submit_store(Job(job_id, keys, slots, False, ctx))
                pipe.send("ok")
            elif request[0] == "finish":
                tier.on_request_finished(contexts.pop(request[1]))
                pipe.send("ok")
    except (EOFError, OSError):
        pass
    finally:
        tier.shutdown()
