"""Load is not a failure (issue 28): bursts wait in the tier, within their deadlines.

Every peer in its own process, zmq control; data over nixl's default lane (``cma`` on this
host: direct reads), nixl with ``UCX_TLS=tcp`` (the staged lane every cross-host pair without
``cma`` uses: a staging pool shared by every peer) and ucx.

- **Burst to one peer.** One consumer submits ``BURST`` loads (1..4 blocks each) to one
  producer at once, then the producer stores them all at once: every load is done with exact
  bytes, the session is never closed (no ``peer_dead``), and the consumer's live RSS after
  the burst is within ``RSS_BOUND`` of its RSS before it.
- **Burst to another peer.** While consumer C bursts to producer P, C's loads from a quiet
  producer Q and a second consumer D's loads from P all succeed; their p99 latency is
  reported next to the same loads on an unloaded cluster (``MEASUREMENTS``).

``P2PKV_BURST_LOADS`` overrides ``BURST`` (the issue's figure, 10,000, is the default).
"""

from __future__ import annotations

import os
from typing import Any

from chaos_cluster import (
    Cluster,
    Node,
    Req,
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

BLOCK = 4096
BURST = int(os.environ.get("P2PKV_BURST_LOADS", "10000"))
SIDE = 80
"""Loads of the bystanders (C from Q, D from P) in the isolation scenario."""
RSS_BOUND = 256 * 2**20
T = 600.0


def spec(kind: str, slots: int, data: str, env: dict[str, str]) -> NodeSpec:
    config = tier_config(
        data_transport=data,
        timeouts={"load": 120.0},
        control={"heartbeat_timeout": 5.0, "heartbeat_ttl": 5.0},
    )
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), env=env)


def _p99(recs: list[Req]) -> float:
    lat = sorted(r.loaded[0].done_at - r.loaded[0].submitted_at for r in recs)
    return lat[min(len(lat) - 1, int(len(lat) * 0.99))]


def _check(c: Cluster, recs: list[Req]) -> None:
    assert not c.flow.problems(recs), c.flow.problems(recs)[:5]
    assert all_done(recs), not_done(recs)[:5]


def test_a_burst_to_one_producer_waits_and_every_load_succeeds(
    data: str, lane: dict[str, str]
) -> None:
    reqs = requests(BURST + 2, max_blocks=4, orders={"consumer_first": 1}, run_id="burst")
    slots = region_blocks(reqs)
    with Cluster() as c:
        prod, con = c.start(
            ("P", spec("producer", slots, data, lane)), ("C", spec("consumer", slots, data, lane))
        )
        (recs,) = admit_held(c, [(reqs, prod, con)], warm=2, timeout=T)
        before = c.live_rss(con)
        burst = recs[2:]
        c.flow.release_stores()
        c.wait(
            lambda: all(r.finished for r in burst),
            timeout=T,
            what=f"{len(burst)} loads of the burst",
            recs=burst,
        )
        _check(c, burst)
        grew = c.live_rss(con) - before
        stats = c.report(con)["stats"]
        assert stats["sessions"] == 1 and "jobs_peer_dead" not in stats, stats
        assert grew < RSS_BOUND, f"consumer live RSS grew {grew / 2**20:.0f} MiB"
        measured(
            f"burst {data}/{lane.get('UCX_TLS', 'default')}: {len(burst)} loads done, "
            f"p99 {_p99(burst) * 1e3:.0f} ms, consumer RSS +{grew / 2**20:.1f} MiB, "
            f"{stats.get('frames_delayed', 0)} control frames delayed"
        )


def _bystanders(c: Cluster, nodes: dict[str, Node], run: str) -> tuple[list[Req], list[Req]]:
    """C's loads from Q and D's loads from P, admitted consumer-first, stores released."""
    from_q = c.flow.admit(
        requests(
            SIDE, max_blocks=4, orders={"consumer_first": 1}, run_id=f"{run}q", first_index=100_000
        ),
        nodes["Q"],
        nodes["C"],
    )
    of_d = c.flow.admit(
        requests(
            SIDE, max_blocks=4, orders={"consumer_first": 1}, run_id=f"{run}d", first_index=200_000
        ),
        nodes["P"],
        nodes["D"],
    )
    return from_q, of_d


def _isolation_run(data: str, env: dict[str, str], burst: int) -> dict[str, Any]:
    big = requests(burst + 2, max_blocks=4, orders={"consumer_first": 1}, run_id="iso")
    side = 3 * SIDE * 4
    with Cluster() as c:
        p, q, con, d = c.start(
            ("P", spec("producer", region_blocks(big) + side, data, env)),
            ("Q", spec("producer", side, data, env)),
            ("C", spec("consumer", region_blocks(big) + side, data, env)),
            ("D", spec("consumer", side, data, env)),
        )
        nodes = {"P": p, "Q": q, "C": con, "D": d}
        (recs,) = admit_held(c, [(big, p, con)], warm=2, timeout=T)
        c.flow.hold_stores = False
        c.flow.release_stores()
        from_q, of_d = _bystanders(c, nodes, "iso")
        side_recs = from_q + of_d
        c.wait(
            lambda: all(r.finished for r in side_recs),
            timeout=T,
            what="the bystanders' loads",
            recs=side_recs,
        )
        _check(c, side_recs)
        c.wait(
            lambda: all(r.finished for r in recs[2:]), timeout=T, what="the burst", recs=recs[2:]
        )
        _check(c, recs[2:])
        return {"q": _p99(from_q), "d": _p99(of_d)}


def test_a_burst_to_one_producer_never_fails_other_peers_loads(
    data: str, lane: dict[str, str]
) -> None:
    quiet = _isolation_run(data, lane, 0)
    loaded = _isolation_run(data, lane, max(2000, BURST // 5))
    name = f"{data}/{lane.get('UCX_TLS', 'default')}"
    measured(
        f"isolation {name}: C<-Q p99 {loaded['q'] * 1e3:.0f} ms (unloaded "
        f"{quiet['q'] * 1e3:.0f} ms), D<-P p99 {loaded['d'] * 1e3:.0f} ms (unloaded "
        f"{quiet['d'] * 1e3:.0f} ms)"
    )
