"""Scenario 6: shutting either side down with transfers in flight.

Writes are held in flight deterministically (UCX on TCP, the target paused while they are
posted), then one side's tier is shut down. Nothing crashes, every job of both sides resolves
exactly once, and the order of events is checked on the recordings of both data transports:

- the shutting-down side's own writes end before their store jobs are answered and before the
  region is deregistered, which happens only once nothing is in flight (``close`` drains
  everything: the region is really released);
- across the two processes (docs/protocol.md §10, shutdown winds sessions down first): a
  producer shutting down fails the consumer's loads only once its writes into them ended (no
  load ends under a live write, so no fence is needed); and a consumer shutting down
  deregisters its region only when no write of the producer into it is live.
"""

from __future__ import annotations

import time
from collections import Counter

from chaos_checks import inbound_violations, release_violations
from chaos_cluster import (
    Cluster,
    Node,
    Req,
    admit_held,
    measured,
    requests,
    stall_writes,
    tier_config,
)
from chaos_node import NodeSpec
from p2pkv.demo.roles import RoleSetup

BLOCK = 256 * 1024
MAX_BLOCKS = 12
DRAIN = 3.0
"""``timeouts.shutdown_drain``."""
NIXL_DRAIN = 2.0
"""The nixl transport's ``drain_timeout`` (``remove_peer``/``close``)."""
STOP_BOUND = DRAIN + NIXL_DRAIN + 5.0
PAUSE = 0.8
T = 60.0


def spec(kind: str, slots: int) -> NodeSpec:
    config = tier_config(timeouts={"shutdown_drain": DRAIN},
                         data={"drain_timeout": NIXL_DRAIN})
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), env={"UCX_TLS": "tcp"}, record=True)


def loaded_with_writes_in_flight(c: Cluster, p: Node, con: Node) -> tuple[list[Req], int]:
    """60 consumer-first requests, 10 done, the rest with the producer's writes held in flight
    into the (paused) consumer; returns the records and how many writes are in flight."""
    reqs = requests(60, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="shut")
    (recs,) = admit_held(c, [(reqs, p, con)], warm=10, timeout=T)
    return recs, len(stall_writes(c, p, con, recs[10:], PAUSE))


def stop_under_load(c: Cluster, stopping: Node, paused: Node, recs: list[Req]) -> float:
    """Shut ``stopping``'s tier down, resuming ``paused`` as soon as that shutdown starts (so
    the held writes are still in flight when it begins); then wait until every job of both
    sides resolved, and check each exactly once, bytes verified, nothing left unanswered.
    Returns how long the shutdown took."""
    try:
        asked = time.monotonic()
        report = c.stop(stopping, timeout=STOP_BOUND, on_stopping=paused.child.resume)
        took = time.monotonic() - asked
    finally:
        for node in c.nodes:
            node.child.resume()
    c.wait(lambda: all(r.loaded and r.stored for r in recs), timeout=T,
           what="every load and store resolved", recs=recs)
    for r in recs:
        assert len(r.loaded) == 1 and len(r.stored) == 1, r.describe()
    assert not c.flow.problems(recs), c.flow.problems(recs)
    assert not report["anomalies"] and not report["unanswered"], report
    assert took < STOP_BOUND, took
    return took


def test_producer_shutdown_with_writes_in_flight() -> None:
    with Cluster() as c:
        p, con = c.start(("P", spec("producer", 60 * MAX_BLOCKS)),
                         ("C", spec("consumer", 60 * MAX_BLOCKS)))
        recs, stalled = loaded_with_writes_in_flight(c, p, con)
        took = stop_under_load(c, p, con, recs)
        violations = release_violations(p.data_log)
        assert not violations, violations
        assert any(e[1] == "close" and e[2] == [] for e in p.data_log), "region not released"
        early = inbound_violations(p.data_log, con.data_log, con.address)
        assert not early, f"consumer loads ended under live writes: {early[:3]}"
        measured(f"producer shut down with {stalled} write(s) in flight in {took:.2f}s: loads "
                 f"{dict(Counter(r.load_outcome for r in recs[10:]))}, stores "
                 f"{dict(Counter(r.store_outcome for r in recs[10:]))}; its writes all ended "
                 f"before their slots, the consumer's loads and its region were released")


def test_consumer_shutdown_with_writes_in_flight() -> None:
    with Cluster() as c:
        p, con = c.start(("P", spec("producer", 60 * MAX_BLOCKS)),
                         ("C", spec("consumer", 60 * MAX_BLOCKS)))
        recs, stalled = loaded_with_writes_in_flight(c, p, con)
        p.child.pause()  # the producer's writes stay in flight while the consumer shuts down
        con.child.resume()
        took = stop_under_load(c, con, p, recs)
        for node in (p, con):
            violations = release_violations(node.data_log)
            assert not violations, (node.name, violations)
        assert not c.report(p)["anomalies"]
        early = inbound_violations(p.data_log, con.data_log, con.address)
        assert not early, f"consumer released slots or its region under live writes: {early[:3]}"
        measured(f"consumer shut down with {stalled} producer write(s) into it in flight in "
                 f"{took:.2f}s: loads {dict(Counter(r.load_outcome for r in recs[10:]))}, stores "
                 f"{dict(Counter(r.store_outcome for r in recs[10:]))}; its region was released "
                 "after every write into it ended")
