"""A P2PTier pair over ``zmq`` control and ``nixl`` data in two processes: byte-exact loads.

The producer tier runs in a child (``nixl_tier_peers.producer_tier``); the consumer tier runs
here. Both are built from tier configs through the plugin registry, as an engine adapter
builds them.
"""

from __future__ import annotations

from collections.abc import Iterator

import nixl_tier_peers
import numpy as np
import pytest
from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.testing.child import Child
from p2pkv.testing.peers import pattern
from p2pkv.testing.waiting import wait_until
from p2pkv.tier import P2PTier
from p2pkv.types import Job, Outcome, RequestContext

T = 20.0
NUM_BLOCKS, BLOCK_LEN, SEED = 256, 16 * 1024, 5


class Pair:
    def __init__(self, child: Child) -> None:
        self.child = child
        kind, address = child.recv(60.0, "the producer's address")
        assert kind == "address"
        self.host, self.port = parse_address(address)
        self.region = bytearray(NUM_BLOCKS * BLOCK_LEN)
        self.blocks = np.frombuffer(self.region, dtype=np.uint8).reshape(NUM_BLOCKS, BLOCK_LEN)
        self.source = pattern(SEED, NUM_BLOCKS * BLOCK_LEN).reshape(NUM_BLOCKS, BLOCK_LEN)
        self.tier = P2PTier(
            TierConfig.from_dict(nixl_tier_peers.TIER_CONFIG), memoryview(self.region), BLOCK_LEN
        )
        self.results: dict[int, str] = {}

    def pump(self) -> None:
        for r in self.tier.get_finished_jobs():
            assert r.job_id not in self.results, f"job {r.job_id} reported twice"
            self.results[r.job_id] = r.outcome.value
        for job_id, outcome in self.child.request("results", T, "the producer's results"):
            assert job_id not in self.results, f"job {job_id} reported twice"
            self.results[job_id] = outcome

    def request(self, kv: str, slots: list[int], dst: list[int], consumer_first: bool) -> None:
        ctx = RequestContext(
            f"c-{kv}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv,
                    "remote_host": self.host,
                    "remote_port": self.port,
                }
            },
        )
        keys = [f"{kv}/{i}".encode() for i in range(len(slots))]
        store_id, load_id = 1000 + len(self.results), 2000 + len(self.results)

        def load() -> None:
            self.tier.on_new_request(ctx)
            self.tier.submit_load(Job(load_id, keys, dst, True, ctx))

        def store() -> None:
            assert self.child.request(("store", kv, store_id, keys, slots), T) == "ok"

        first, second = (load, store) if consumer_first else (store, load)
        first()
        self.pump()
        second()
        wait_until(
            lambda: store_id in self.results and load_id in self.results,
            timeout=T,
            what=f"both results of {kv}",
            pumps=[self.pump],
        )
        assert self.results[store_id] == Outcome.DONE.value
        assert self.results[load_id] == Outcome.DONE.value
        np.testing.assert_array_equal(self.blocks[dst], self.source[slots])
        self.tier.on_request_finished(ctx)
        assert self.child.request(("finish", kv), T) == "ok"


@pytest.fixture(scope="module")
def pair() -> Iterator[Pair]:
    with Child(
        nixl_tier_peers.producer_tier, SEED, NUM_BLOCKS, BLOCK_LEN, name="p2pkv-nixl-producer-tier"
    ) as child:
        pair = Pair(child)
        yield pair
        assert pair.tier.shutdown() == []
        child.send("stop")


@pytest.mark.parametrize("order", ["producer_first", "consumer_first"])
def test_tier_pair_over_zmq_and_nixl_moves_bytes_exactly(pair: Pair, order: str) -> None:
    rng = np.random.default_rng(len(pair.results))
    for round_ in range(3):
        slots = rng.choice(NUM_BLOCKS, size=96, replace=False).tolist()
        dst = rng.choice(NUM_BLOCKS, size=96, replace=False).tolist()
        pair.request(f"{order}-{round_}", slots, dst, order == "consumer_first")


def test_the_tier_reports_the_descriptors_its_reads_posted(pair: Pair) -> None:
    """``P2PTier.stats`` passes the data transport's ``descriptors_posted`` on: a request
    of 8 blocks contiguous on both sides (one run) posts one descriptor, 8 scattered ones 8."""

    def posted() -> int:
        return int(pair.tier.stats()["descriptors_posted"])

    before = posted()
    pair.request("contiguous", list(range(8)), list(range(16, 24)), False)
    assert posted() - before == 1
    before = posted()
    pair.request("scattered", list(range(0, 16, 2)), list(range(32, 48, 2)), False)
    assert posted() - before == 8
