"""Scenario 7: a slow network between the hosts.

``netem``: 20 ms delay and 1 % loss each way (40 ms round trips, retransmissions on both the
control and the data path); skipped, saying so, on kernels without ``sch_netem``. ``tbf``: the
link limited to 40 Mbit/s each way (queueing delay, drops beyond the queue), which every kernel
with traffic control has, so the scenario runs somewhere slow in any case.

Requests in every arrival order still complete with verified bytes, and no heartbeat expires
spuriously. Timeouts fire as configured, neither early nor late: a load whose blocks never
come ends with ``load_timeout`` once the load timeout has passed (its reads are cancelled
there and then, finally: no round trip to the producer is waited for), a store nobody fetches
ends with ``unbound_timeout``.
"""

from __future__ import annotations

import shutil
from collections import Counter

import pytest
from chaos_cluster import Cluster, Stream, all_done, measured, not_done, requests, tier_config
from chaos_netlab import NetLab, NetLabUnavailable
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 32 * 1024
MAX_BLOCKS = 8
DELAY_MS = 20
LOSS_PCT = 1
RATE_MBIT = 40
LOAD = 4.0
UNBOUND = 4.0
LEASE_MARGIN = 2.0
"""``timeouts.lease_margin``: the producer pins what it offered for ``LOAD + LEASE_MARGIN``."""
MARGIN = 1.5
"""Beyond the configured timeout: the engine step, a loaded machine (the load timeout fires
on the consumer's own clock, with nothing to wait for from the other side)."""
T = 120.0


def host_spec(lab: NetLab, kind: str, side: str, slots: int) -> NodeSpec:
    netns, dev, addr = lab.host(side)
    config = tier_config(
        addr,
        control={"insecure": True},
        timeouts={
            "load": LOAD,
            "lease_margin": LEASE_MARGIN,
            "unbound_store": UNBOUND,
            "store": 2 * LOAD,
        },
    )
    return NodeSpec(
        kind,
        RoleSetup(config, BLOCK, slots),
        netns=netns,
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
    )


@pytest.mark.parametrize("link", ["netem", "tbf"])
def test_requests_complete_and_timeouts_fire_as_configured_over_a_slow_link(
    netlab: NetLab,
    link: str,
) -> None:
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    try:
        if link == "netem":
            netlab.shape(DELAY_MS, LOSS_PCT)
            shaping = f"netem {DELAY_MS} ms / {LOSS_PCT} %"
        else:
            netlab.limit_rate(RATE_MBIT)
            shaping = f"tbf {RATE_MBIT} Mbit/s"
    except NetLabUnavailable as exc:
        pytest.skip(f"tc {link} unavailable in this kernel: {exc}")
    reqs = requests(
        100,
        max_blocks=MAX_BLOCKS,
        orders={"consumer_first": 2, "producer_first": 2, "symmetric": 1},
        run_id="slow",
    )
    window = 24
    with Cluster() as c:
        p, con = c.start(
            ("P", host_spec(netlab, "producer", "a", 2 * window * MAX_BLOCKS)),
            ("C", host_spec(netlab, "consumer", "b", 2 * window * MAX_BLOCKS)),
        )
        stream = Stream(c, reqs, p, con, window)
        stream.run(T, "requests over the slow link")
        assert all_done(stream.admitted), not_done(stream.admitted)
        assert not c.flow.problems(), c.flow.problems()
        latency = sorted(
            r.loaded[0].done_at - r.loaded[0].submitted_at
            for r in stream.admitted
            if r.loaded[0].blocks
        )

        c.flow.hold_stores = c.flow.hold_loads = True
        orphans = requests(
            4,
            max_blocks=MAX_BLOCKS,
            orders={"consumer_first": 1, "producer_first": 1},
            run_id="orphan",
            first_index=1000,
        )
        recs = c.flow.admit(orphans, p, con)
        loads = [r for r in recs if r.req.order == "consumer_first"]
        stores = [r for r in recs if r.req.order == "producer_first"]
        c.wait(
            lambda: all(r.loaded for r in loads) and all(r.stored for r in stores),
            timeout=LOAD + UNBOUND + 4 * MARGIN,
            what="orphaned halves timing out",
            recs=recs,
        )
        assert {r.load_outcome for r in loads} == {"load_timeout"}, [r.describe() for r in loads]
        assert {r.store_outcome for r in stores} == {"unbound_timeout"}, [
            r.describe() for r in stores
        ]
        load_s = [r.loaded[0].done_at - r.loaded[0].submitted_at for r in loads]
        store_s = [r.stored[0][0] - r.admitted for r in stores]
        assert all(LOAD <= s <= LOAD + MARGIN for s in load_s), load_s
        assert all(UNBOUND <= s <= UNBOUND + MARGIN for s in store_s), store_s
        for node in (p, con):
            rep = c.report(node)
            assert not rep["anomalies"], (node.name, rep["anomalies"])
            assert rep["stats"]["sessions"] == 1 and not rep["stats"].get("jobs_peer_dead"), rep
        measured(
            f"{shaping}: {len(reqs)} requests "
            f"{dict(Counter(r.req.order for r in stream.admitted))} done, load latency p50 "
            f"{latency[len(latency) // 2] * 1000:.0f} ms, max {latency[-1] * 1000:.0f} ms, no "
            f"session lost; load timeout {LOAD}s fired after "
            f"{[round(s, 2) for s in load_s]} s, unbound-store timeout {UNBOUND}s after "
            f"{[round(s, 2) for s in store_s]} s"
        )
