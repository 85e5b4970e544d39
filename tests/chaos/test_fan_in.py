"""Many producers, one consumer (issue 28, "many producers").

``PRODUCERS`` producer processes (64; ``P2PKV_FAN_IN_PRODUCERS`` overrides) and one consumer,
zmq control, nixl or ucx data. The consumer submits ``LOADS`` loads (8 per producer) at once
and every producer stores its share at once: every load is done with exact bytes, no session
is lost, and the consumer's open fds, threads and live RSS after the fan-in stay within a
bound of what they were with every session up (measured, reported). Run it on a quiet machine:
64 processes on two busy cores starve each other's heartbeats.
"""

from __future__ import annotations

import os

import pytest
from chaos_cluster import (
    Cluster,
    admit_held,
    all_done,
    measured,
    not_done,
    region_blocks,
    requests,
    tier_config,
)
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 16 * 1024
PRODUCERS = int(os.environ.get("P2PKV_FAN_IN_PRODUCERS", "64"))
PER_PRODUCER = 8
WARM = 1
FD_BOUND = 16
THREAD_BOUND = 4
RSS_BOUND = 128 * 2**20
HEARTBEAT_TIMEOUT = 10.0
"""The default: 65 processes start and serve on two cores."""
T = 300.0
pytestmark = [
    pytest.mark.timeout(3 * T),  # 65 processes start on two cores before the run
    pytest.mark.chaos_slow,
]


def spec(kind: str, slots: int, data: str) -> NodeSpec:
    config = tier_config(
        data_transport=data,
        timeouts={"load": 120.0, "handshake": 60.0},
        control={
            "heartbeat_timeout": HEARTBEAT_TIMEOUT,
            "heartbeat_ttl": HEARTBEAT_TIMEOUT,
            "connect_timeout": 60.0,
        },
    )
    env = {"UCX_TLS": "tcp,self"}  # reads as across hosts (nixl: staged)
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), env=env)


def test_many_producers_fan_in_to_one_consumer(data: str) -> None:
    groups = [
        requests(
            PER_PRODUCER + WARM,
            max_blocks=4,
            orders={"consumer_first": 1},
            run_id=f"fan{i}",
            first_index=100 * i,
        )
        for i in range(PRODUCERS)
    ]
    with Cluster() as c:
        *producers, con = c.start(
            *((f"P{i}", spec("producer", region_blocks(g), data)) for i, g in enumerate(groups)),
            ("C", spec("consumer", sum(region_blocks(g) for g in groups), data)),
        )
        recs = admit_held(
            c, [(g, p, con) for g, p in zip(groups, producers, strict=True)], warm=WARM, timeout=T
        )
        before, rss = con.usage(), c.live_rss(con)
        burst = [r for group in recs for r in group[WARM:]]
        c.flow.release_stores()
        c.wait(
            lambda: all(r.finished for r in burst),
            timeout=T,
            what=f"{len(burst)} loads from {PRODUCERS} producers",
            recs=burst,
        )
        assert not c.flow.problems(burst), c.flow.problems(burst)[:5]
        assert all_done(burst), not_done(burst)[:5]
        after, grew = con.usage(), c.live_rss(con) - rss
        stats = c.report(con)["stats"]
        assert stats["sessions"] == PRODUCERS and "jobs_peer_dead" not in stats, stats
        measured(
            f"fan-in {data}: {len(burst)} loads from {PRODUCERS} producers all done; "
            f"consumer fds {before.fds}->{after.fds}, threads {before.threads}->"
            f"{after.threads}, live RSS +{grew / 2**20:.1f} MiB"
        )
        assert after.fds - before.fds <= FD_BOUND, (before, after)
        assert after.threads - before.threads <= THREAD_BOUND, (before, after)
        assert grew < RSS_BOUND, grew
