"""A peer paused (SIGSTOP) for longer than the heartbeat timeout, then resumed (SIGCONT).

A pause is not a death: an engine stall, a VM live migration, cgroup throttling or a debugger
look exactly like this to the other side. The other side must give up on the paused peer's
work within the heartbeat timeout (as for a kill), and once the peer resumes — with stale
sessions of its own — new requests between the two must succeed again by themselves within
about one handshake, with no manual action. Every job submitted before the pause still ends
exactly once.

zmq control; nixl and ucx data (each when installed, on the library's default lanes on one
host); every peer in its own process.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from chaos_cluster import Cluster, Node, Req, all_done, measured, not_done, requests, tier_config
from chaos_node import NodeSpec
from p2pkv.demo.roles import RoleSetup

BLOCK = 64 * 1024
MAX_BLOCKS = 8
HEARTBEAT_TIMEOUT = 1.0
PAUSE = 3 * HEARTBEAT_TIMEOUT
MARGIN = 1.5
"""Beyond a bound: a loaded 2-core machine, pipe latency."""
RECOVERY_BOUND = 2 * HEARTBEAT_TIMEOUT + MARGIN
"""From the resume to the first new request that succeeds: the stale session is found out
(at most one heartbeat timeout) and one handshake is made."""
FAST_FAILURE = 1.0
"""A probe sent on a session only the resumed peer still thought alive fails at least this
fast: the other side's transport answers its first frame with "gone"."""
T = 60.0


def spec(kind: str, slots: int, data: str) -> NodeSpec:
    config = tier_config(timeouts={"unbound_store": 2 * PAUSE, "handshake": 10.0},
                         control={"heartbeat_timeout": HEARTBEAT_TIMEOUT,
                                  "heartbeat_ttl": HEARTBEAT_TIMEOUT},
                         data_transport=data)
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots))


def probe_until_served(c: Cluster, p: Node, con: Node, first_index: int,
                       timeout: float) -> tuple[float, list[Req]]:
    """Admit one consumer-first request at a time until one succeeds; returns when it did
    (monotonic) and every probe admitted."""
    probes: list[Req] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (req,) = requests(1, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1},
                          run_id=f"probe{len(probes)}", first_index=first_index + len(probes))
        (rec,) = c.flow.admit([req], p, con)
        probes.append(rec)
        c.wait(lambda r=rec: bool(r.loaded), timeout=T, what="a probe's load", recs=[rec])
        if rec.load_outcome == "done":
            return rec.loaded[0].done_at, probes
    raise AssertionError(f"no request succeeded within {timeout}s of the resume: "
                         f"{[r.describe() for r in probes[-5:]]}")


@pytest.mark.parametrize("paused", ["producer", "consumer"])
def test_a_peer_paused_past_the_heartbeat_timeout_recovers_by_itself(
        paused: str, data: str, request: pytest.FixtureRequest) -> None:
    if (paused, data) == ("consumer", "ucx"):
        request.applymarker(pytest.mark.xfail(strict=False, reason=(
            "known defect: after a consumer pause past UCX's keepalive, the producer's new "
            "UCX endpoint to the same worker sometimes fails too, so every write of the new "
            "session fails 'unreachable (UCX endpoint failed)' (about 1 run in 3 here)")))
    warm = requests(10, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="warm")
    held = requests(20, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="held",
                    first_index=100)
    slots = 200 * MAX_BLOCKS
    with Cluster() as c:
        p, con = c.start(("P", spec("producer", slots, data)),
                         ("C", spec("consumer", slots, data)))
        c.flow.admit(warm, p, con)
        c.wait(lambda: all(r.finished for r in c.flow.reqs.values()), timeout=T,
               what="warm-up requests")
        c.flow.hold_stores = True
        recs = c.flow.admit(held, p, con)
        c.wait(lambda: len(c.flow.held) == len(recs), timeout=T, what="loads submitted")
        c.flow.hold_stores = False
        victim = p if paused == "producer" else con
        victim.child.pause()
        paused_at = time.monotonic()
        c.flow.release_stores()
        other = con if victim is p else p
        try:
            if other is con:  # the consumer gives up on the paused producer's loads
                c.wait(lambda: all(r.loaded for r in recs), timeout=PAUSE,
                       what="loads failing while the producer is paused", recs=recs)
            else:
                c.wait(lambda: time.monotonic() - paused_at >= PAUSE, timeout=2 * PAUSE,
                       what="the pause")
            c.wait(lambda: time.monotonic() - paused_at >= PAUSE, timeout=2 * PAUSE,
                   what="the pause")
        finally:
            victim.child.resume()
        resumed_at = time.monotonic()
        served_at, probes = probe_until_served(c, p, con, 1000, RECOVERY_BOUND + T)
        recovery = served_at - resumed_at
        c.wait(lambda: all(r.finished for r in recs + probes), timeout=T,
               what="every job submitted before the pause, and every probe, ending",
               recs=recs + probes)
        after = requests(20, max_blocks=MAX_BLOCKS, orders={
            "consumer_first": 1, "producer_first": 1}, run_id="after", first_index=2000)
        again = c.flow.admit(after, p, con)
        c.wait(lambda: all(r.finished for r in again), timeout=T,
               what="requests after the recovery", recs=again)

        assert not c.flow.problems(), c.flow.problems()
        assert all_done(again), not_done(again)
        assert recovery <= RECOVERY_BOUND, (
            f"first success {recovery:.2f}s after the resume (bound {RECOVERY_BOUND}s); "
            f"probes: {[r.describe() for r in probes]}")
        slow = [r.describe() for r in probes[:-1]
                if r.loaded[0].done_at - r.loaded[0].submitted_at > FAST_FAILURE]
        assert not slow, f"probes on a stale session failed slowly: {slow}"
        failed_in = [round(r.loaded[0].done_at - r.loaded[0].submitted_at, 3)
                     for r in probes[:-1]]
        measured(f"[{data}] {paused} paused {PAUSE}s (heartbeat timeout {HEARTBEAT_TIMEOUT}s): "
                 f"jobs from before the pause {dict(Counter(r.load_outcome for r in recs))}; first "
                 f"new request done {recovery:.2f}s after the resume ({len(probes)} probe(s), "
                 f"earlier ones failed in {failed_in} s); "
                 f"20 more all done")
