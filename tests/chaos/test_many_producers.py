"""One consumer, six producers, two of them SIGKILLed with 300 requests in flight.

Every peer in its own process (zmq control; nixl and ucx data, each when installed). The
consumer has 50 requests open with each producer, and the stores of all 300 are released at
once; two producers are SIGKILLed before they could serve theirs (they are stopped first, so
none of their blocks can have been offered). Every request to a live producer succeeds with
verified bytes — none of them times out: no fence or drain of the dead producers' slots holds
anything up any more (wire 2: the consumer's reads are cancelled and final the moment a load
fails) — and every load from a killed producer fails within the heartbeat timeout (plus a
margin) of the kill. The consumer's recording shows every read of its own going into one open
load's slots and ending before that load's result.
"""

from __future__ import annotations

import time
from collections import Counter

from chaos_checks import read_violations
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

BLOCK = 32 * 1024
MAX_BLOCKS = 4
PRODUCERS = 6
KILLED = 2
PER_PRODUCER = 50
WARM = 2
"""Requests per producer done first (sessions up, data endpoints wired), before the 300."""
HEARTBEAT_TIMEOUT = 2.0
"""Seven busy processes on two cores: a one-second heartbeat would expire spuriously."""
DEATH_BOUND = 3 * HEARTBEAT_TIMEOUT
"""From the kill of a producer to the last of its loads failing: three times the documented bound
(``heartbeat_timeout``; docs/reliability.md), so a loaded machine cannot miss it while a
hang still fails."""
T = 120.0


def spec(kind: str, slots: int, data: str, *, record: bool = False) -> NodeSpec:
    config = tier_config(
        data_transport=data,
        control={"heartbeat_timeout": HEARTBEAT_TIMEOUT, "heartbeat_ttl": HEARTBEAT_TIMEOUT},
    )
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), record=record)


def test_two_of_six_producers_killed_with_300_requests_in_flight(data: str) -> None:
    groups = [
        requests(
            PER_PRODUCER + WARM,
            max_blocks=MAX_BLOCKS,
            orders={"consumer_first": 1},
            run_id=f"six{i}",
            first_index=1000 * i,
        )
        for i in range(PRODUCERS)
    ]
    with Cluster() as c:
        *producers, con = c.start(
            *((f"P{i}", spec("producer", region_blocks(g), data)) for i, g in enumerate(groups)),
            ("C", spec("consumer", sum(region_blocks(g) for g in groups), data, record=True)),
        )
        recs = admit_held(
            c, [(g, p, con) for g, p in zip(groups, producers, strict=True)], warm=WARM, timeout=T
        )
        victims, live = producers[:KILLED], producers[KILLED:]
        open_ = [r for group in recs for r in group[WARM:]]
        assert len(open_) == PRODUCERS * PER_PRODUCER
        of_victims = [r for group in recs[:KILLED] for r in group[WARM:]]
        of_live = [r for group in recs[KILLED:] for r in group[WARM:]]

        for v in victims:
            v.child.pause()  # none of their blocks can be offered before the kill
        released_at = time.monotonic()
        c.flow.release_stores()
        killed_at = min(v.kill() for v in victims)
        c.wait(
            lambda: all(r.loaded for r in of_victims) and all(r.finished for r in of_live),
            timeout=T,
            what="every load of the killed producers and every request of the live ones ended",
            recs=open_,
        )

        assert not c.flow.problems(), c.flow.problems()[:5]
        assert all_done(of_live), not_done(of_live)[:5]
        timed_out = [r.describe() for r in of_live if r.load_outcome == "load_timeout"]
        assert not timed_out, timed_out[:5]
        assert not [r.describe() for r in of_victims if r.load_outcome == "done"]
        after_kill = sum(r.loaded[0].done_at > killed_at for r in of_live)
        assert after_kill, "every live producer's request was over before the kill"
        failed_in = [r.loaded[0].done_at - killed_at for r in of_victims]
        assert max(failed_in) <= DEATH_BOUND, (
            f"loads of the killed producers failed up to {max(failed_in):.2f}s after the kill "
            f"(bound {DEATH_BOUND}s)"
        )
        rep = c.report(con)
        assert not rep["anomalies"], rep["anomalies"]
        for p in live:
            assert not c.report(p)["anomalies"], p.name
        violations = read_violations(con.data_log)
        assert not violations, violations[:5]
        latency = sorted(r.loaded[0].done_at - released_at for r in of_live)
        blocks = sum(r.req.num_blocks for r in of_live)
        measured(
            f"[{data}] {PRODUCERS} producers, {len(open_)} requests in flight, {KILLED} "
            f"producers SIGKILLed: their {len(of_victims)} loads failed "
            f"{dict(Counter(r.load_outcome for r in of_victims))} "
            f"{min(failed_in):.2f}-{max(failed_in):.2f}s after the kill (bound "
            f"{DEATH_BOUND}s); the live producers' {len(of_live)} requests all done "
            f"({after_kill} of them ended after the kill; {blocks} blocks verified, the "
            f"last {latency[-1]:.2f}s after the stores were released; none timed out)"
        )
