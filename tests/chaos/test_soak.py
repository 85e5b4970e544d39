"""Scenario 5: soak. 20,000 requests of random sizes in every arrival order (consumer first,
producer first, symmetric lookups) through a producer and a consumer in two processes.

Every job gets exactly one result and every loaded byte is verified. Resource use is measured
with psutil after a warm-up and at the end: live memory (RSS after GC and ``malloc_trim``),
open file descriptors and threads stay bounded. Once idle, no per-request state remains in
either tier (``P2PTier.state_sizes``: sessions, rounds, supply, demand, transfers, timers,
tombstones... all zero).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from chaos_cluster import Cluster, Stream, measured, requests, tier_config
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 4096
MAX_BLOCKS = 8
COUNT = 20_000
WARMUP = 2_000
WINDOW = 64
UNBOUND = 5.0
"""``timeouts.unbound_store``: also how long finished producer requests leave a tombstone."""
RSS_GROWTH = 24 << 20
FD_GROWTH = 8
THREAD_GROWTH = 2


@pytest.mark.timeout(400)
def test_soak_20000_requests_exactly_once_verified_with_bounded_resources() -> None:
    reqs = requests(
        COUNT,
        max_blocks=MAX_BLOCKS,
        orders={"consumer_first": 2, "producer_first": 2, "symmetric": 1},
        run_id="soak",
        seed=11,
    )
    slots = WINDOW * MAX_BLOCKS * 2
    config = tier_config(timeouts={"unbound_store": UNBOUND})
    with Cluster() as c:
        p, con = c.start(
            ("P", NodeSpec("producer", RoleSetup(config, BLOCK, slots))),
            ("C", NodeSpec("consumer", RoleSetup(config, BLOCK, slots))),
        )
        warm = Stream(c, reqs[:WARMUP], p, con, WINDOW)
        warm.run(120.0, "warm-up requests")
        base = {n.name: (c.live_rss(n), n.usage()) for n in (p, con)}
        started = time.monotonic()
        soak = Stream(c, reqs[WARMUP:], p, con, WINDOW)
        soak.run(300.0, "soak requests")
        elapsed = time.monotonic() - started

        recs = warm.admitted + soak.admitted
        assert len(recs) == COUNT
        assert not c.flow.problems(), c.flow.problems()[:10]
        bad = [
            r.describe()
            for r in recs
            if r.load_outcome != "done"
            or (r.req.order != "symmetric" and r.store_outcome != "done")
        ]
        assert not bad, (len(bad), bad[:10])
        reports = c.settle([p, con], timeout=UNBOUND + 30.0, what="idle tiers")
        for node, rep in zip((p, con), reports, strict=True):
            assert not rep["anomalies"], (node.name, rep["anomalies"][:10])
            assert not rep["unanswered"], (node.name, rep["unanswered"][:10])
        growth = {}
        for node in (p, con):
            rss0, use0 = base[node.name]
            rss1, use1 = c.live_rss(node), node.usage()
            growth[node.name] = (rss1 - rss0, use1.fds - use0.fds, use1.threads - use0.threads)
            assert rss1 - rss0 < RSS_GROWTH, (node.name, rss0, rss1)
            assert use1.fds - use0.fds <= FD_GROWTH, (node.name, use0, use1)
            assert use1.threads - use0.threads <= THREAD_GROWTH, (node.name, use0, use1)
        orders = Counter(r.req.order for r in recs)
        blocks = sum(r.loaded[0].blocks for r in recs)
        measured(
            f"soak: {COUNT} requests {dict(orders)}, {blocks} blocks verified; "
            f"{COUNT - WARMUP} after warm-up in {elapsed:.1f}s "
            f"({(COUNT - WARMUP) / elapsed:.0f}/s); growth (live RSS bytes, fds, threads): "
            f"{growth}; no per-request state left"
        )
