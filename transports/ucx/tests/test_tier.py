"""A P2PTier pair over ``zmq`` control and ``ucx`` data in two processes, built from tier
configs through the registry like an engine adapter would; bytes checked exactly."""

from __future__ import annotations

import operator
from functools import partial

import numpy as np
import pytest
import ucx_programs
from p2pkv.addressing import parse_address
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from p2pkv.types import Job, JobResult, Outcome, RequestContext
from ucx_helpers import T

pytest.importorskip("p2pkv_zmq")

NUM_BLOCKS, BLOCK_LEN = 256, 64 * 1024
PRODUCER_SEED = 11


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
def test_tier_pair_over_zmq_and_ucx_moves_blocks_exactly(error_handling: bool) -> None:
    options = {"endpoint_error_handling": error_handling, "transfer_timeout": 30.0}
    _, produced = ucx_programs.tier_region(NUM_BLOCKS, BLOCK_LEN, PRODUCER_SEED)
    region = bytearray(NUM_BLOCKS * BLOCK_LEN)
    blocks = np.frombuffer(region, np.uint8).reshape(NUM_BLOCKS, BLOCK_LEN)
    tier = ucx_programs.make_tier(region, BLOCK_LEN, options)
    results: dict[int, JobResult] = {}

    def tick() -> None:
        for r in tier.get_finished_jobs():
            assert r.job_id not in results, f"job {r.job_id} reported twice"
            results[r.job_id] = r

    rng = np.random.default_rng(3)
    with Child(
        ucx_programs.producer_tier,
        NUM_BLOCKS,
        BLOCK_LEN,
        PRODUCER_SEED,
        options,
        name="p2pkv-ucx-producer-tier",
    ) as producer:
        host, port = parse_address(producer.recv(T, "the producer's address"))
        try:
            for round_ in range(3):  # several requests over one session, both orders
                kv = f"req-{round_}"
                src = rng.permutation(NUM_BLOCKS)[:64].tolist()
                dst = rng.permutation(NUM_BLOCKS)[:64].tolist()
                keys = [f"{kv}/{i}".encode() for i in range(64)]
                ctx = RequestContext(
                    f"c-{kv}",
                    {
                        "remote_prefiller": {
                            "kv_request_id": kv,
                            "remote_host": host,
                            "remote_port": port,
                        }
                    },
                )
                tier.on_new_request(ctx)
                store = ("store", 100 + round_, kv, keys, src)
                if round_ % 2:
                    producer.request(store, T, "the store to be submitted")
                tier.submit_load(Job(200 + round_, keys, dst, True, ctx))
                if not round_ % 2:
                    tick()
                    producer.request(store, T, "the store to be submitted")
                wait_until(
                    partial(operator.contains, results, 200 + round_),
                    timeout=T,
                    what=f"the load of {kv}",
                    pumps=[tick],
                )
                assert results[200 + round_].outcome is Outcome.DONE, results[200 + round_]
                assert (blocks[dst] == produced[src]).all(), f"{kv}: bytes differ"
                tier.on_request_finished(ctx)
            stores = wait_until(
                lambda: (r := producer.request(("results",), T, "results")) and len(r) == 3 and r,
                timeout=T,
                what="the producer's three store results",
                pumps=[tick],
            )
            assert stores
            assert set(stores.values()) == {Outcome.DONE.value}, stores
        finally:
            producer.send(("exit",))
            left = tier.shutdown()
    assert left == [], f"every result was handed over before shutdown, not {left}"
