"""A peer paused (SIGSTOP) for longer than the heartbeat timeout, then resumed (SIGCONT).

A pause is not a death: an engine stall, a VM live migration, cgroup throttling or a debugger
look exactly like this to the other side. The other side must give up on the paused peer's
work within the heartbeat timeout (as for a kill), and once the peer resumes — with stale
sessions of its own — new requests between the two must succeed again by themselves within
about one handshake, with no manual action. Every job submitted before the pause still ends
exactly once.

And since the consumer owns every write into its region (wire 2), a slot handed back to its
engine is the engine's for good: the nodes fill every slot they got back (a failed load's, a
resolved store's) with a canary, and no byte of it may change while both keep going after the
resume. Three cases, on nixl and ucx (each when installed, on the library's default lanes on
one host), every peer in its own process, zmq control:

- the producer paused with 50 loads open: they fail within the heartbeat timeout (plus a
  margin); the consumer canaries their slots; after the resume (the producer then answers the
  fetches queued during the pause on a session the consumer has closed) nothing lands there;
- the consumer paused with 50 loads open: the producer's store jobs resolve by the lease at
  the latest, the producer canaries their slots, nothing overwrites them;
- a zombie producer: paused with fetches already queued in its socket (its blocks were stored
  before, so it answers them at once when it resumes), into a session the consumer has given
  up: not a byte moves into the consumer's slots.
"""

from __future__ import annotations

import time
from collections import Counter
from functools import partial

from chaos_checks import pin_violations, read_violations
from chaos_cluster import (
    Cluster,
    Node,
    Req,
    all_done,
    measured,
    not_done,
    requests,
    tier_config,
)
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 64 * 1024
MAX_BLOCKS = 8
HEARTBEAT_TIMEOUT = 1.0
PAUSE = 3 * HEARTBEAT_TIMEOUT
DEATH_BOUND = 3 * HEARTBEAT_TIMEOUT
"""From the pause to the last load of the paused producer failing: three times the
documented bound (``heartbeat_timeout``; docs/reliability.md), so a loaded machine cannot
miss it while a hang still fails; the pause lasts that long."""
LOAD = 4.0
LEASE_MARGIN = 2.0
LEASE = LOAD + LEASE_MARGIN
"""``timeouts.lease``: how long a ``ready`` pins the producer's blocks."""
RECOVERY_BOUND = 3 * 2 * HEARTBEAT_TIMEOUT
"""From the resume to the first new request that succeeds: the stale session is found out
(at most one heartbeat timeout) and one handshake is made (taken as another); three times
that documented figure."""
FAST_FAILURE = 1.0
"""A probe sent on a session only the resumed peer still thought alive fails at least this
fast: the other side's transport answers its first frame with "gone"."""
WATCH = 5.0
"""Seconds after the resume during which the canaries are checked again and again."""
OPEN = 50
T = 60.0


def spec(kind: str, slots: int, data: str) -> NodeSpec:
    config = tier_config(
        timeouts={
            "unbound_store": 2 * PAUSE,
            "handshake": 10.0,
            "load": LOAD,
            "lease_margin": LEASE_MARGIN,
        },
        control={"heartbeat_timeout": HEARTBEAT_TIMEOUT, "heartbeat_ttl": HEARTBEAT_TIMEOUT},
        data_transport=data,
    )
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), record=True)


def start(c: Cluster, data: str) -> tuple[Node, Node]:
    """A producer and a consumer with sessions up (10 requests done)."""
    slots = 200 * MAX_BLOCKS
    p, con = c.start(("P", spec("producer", slots, data)), ("C", spec("consumer", slots, data)))
    warm = c.flow.admit(
        requests(10, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="warm"), p, con
    )
    c.wait(lambda: all(r.finished for r in warm), timeout=T, what="warm-up requests", recs=warm)
    assert all_done(warm), not_done(warm)
    return p, con


def held_loads(c: Cluster, p: Node, con: Node) -> list[Req]:
    """``OPEN`` consumer-first requests whose loads are submitted (fetches sent) and whose
    stores are held by the router."""
    c.flow.hold_stores = True
    recs = c.flow.admit(
        requests(
            OPEN,
            max_blocks=MAX_BLOCKS,
            orders={"consumer_first": 1},
            run_id="held",
            first_index=100,
        ),
        p,
        con,
    )
    c.wait(lambda: len(c.flow.held) == len(recs), timeout=T, what="loads submitted", recs=recs)
    c.flow.hold_stores = False
    return recs


def _loaded(rec: Req) -> bool:
    return bool(rec.loaded)


def probe_until_served(
    c: Cluster, p: Node, con: Node, first_index: int, timeout: float
) -> tuple[float, list[Req]]:
    """Admit one consumer-first request at a time until one succeeds; returns when it did
    (monotonic) and every probe admitted."""
    probes: list[Req] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        (req,) = requests(
            1,
            max_blocks=MAX_BLOCKS,
            orders={"consumer_first": 1},
            run_id=f"probe{len(probes)}",
            first_index=first_index + len(probes),
        )
        (rec,) = c.flow.admit([req], p, con)
        probes.append(rec)
        c.wait(partial(_loaded, rec), timeout=T, what="a probe's load", recs=[rec])
        if rec.load_outcome == "done":
            return rec.loaded[0].done_at, probes
    raise AssertionError(
        f"no request succeeded within {timeout}s of the resume: "
        f"{[r.describe() for r in probes[-5:]]}"
    )


def recover(
    c: Cluster, p: Node, con: Node, resumed_at: float, before: list[Req], watch: list[Node]
) -> tuple[float, list[Req], list[float], int]:
    """After a resume: the first new request succeeds within ``RECOVERY_BOUND`` (earlier
    probes, on a stale session, failed fast); the canaries of ``watch`` are checked again and
    again until ``WATCH`` seconds after the resume; every job from before the pause and every
    probe ends; 20 more requests all succeed. Returns the recovery time, the probes, how fast
    the failed probes failed and how many canary checks were made."""
    served_at, probes = probe_until_served(c, p, con, 1000, RECOVERY_BOUND + T)
    checks = c.watch_canaries(watch, resumed_at + WATCH - time.monotonic())
    recovery = served_at - resumed_at
    assert recovery <= RECOVERY_BOUND, (
        f"first success {recovery:.2f}s after the resume (bound {RECOVERY_BOUND}s); "
        f"probes: {[r.describe() for r in probes]}"
    )
    failed_in = [r.loaded[0].done_at - r.loaded[0].submitted_at for r in probes[:-1]]
    slow = [r.describe() for r, s in zip(probes, failed_in, strict=False) if s > FAST_FAILURE]
    assert not slow, f"probes on a stale session failed slowly: {slow}"
    c.wait(
        lambda: all(r.finished for r in before + probes),
        timeout=T,
        what="every job submitted before the pause, and every probe, ending",
        recs=before + probes,
    )
    again = c.flow.admit(
        requests(
            20,
            max_blocks=MAX_BLOCKS,
            orders={"consumer_first": 1, "producer_first": 1},
            run_id="after",
            first_index=2000,
        ),
        p,
        con,
    )
    c.wait(
        lambda: all(r.finished for r in again),
        timeout=T,
        what="requests after the recovery",
        recs=again,
    )
    assert all_done(again), not_done(again)
    checks += c.watch_canaries(watch, 0)  # and once more, with every job of the pause ended
    return recovery, probes, [round(s, 3) for s in failed_in], checks


def audit(c: Cluster, p: Node, con: Node) -> None:
    """Exactly one result per job, verified bytes, the recorded order of events."""
    assert not c.flow.problems(), c.flow.problems()
    for node in (p, con):
        rep = c.report(node)
        assert not rep["anomalies"], (node.name, rep["anomalies"])
    assert not [e for e in p.data_log if e[1] == "read"], "the producer posted reads"
    violations = read_violations(con.data_log)
    assert not violations, violations[:5]
    early = pin_violations(p.data_log, con.data_log, p.address, LEASE)
    assert not early, early[:5]


def test_producer_paused_past_the_heartbeat_timeout_fails_fast_and_lands_nothing_late(
    data: str,
) -> None:
    with Cluster() as c:
        p, con = start(c, data)
        recs = held_loads(c, p, con)
        c.canary(con, "failed")
        p.child.pause()
        paused_at = time.monotonic()
        try:
            c.flow.release_stores()  # queued in the paused producer's pipe
            c.wait(
                lambda: all(r.loaded for r in recs),
                timeout=PAUSE,
                what="loads failing while the producer is paused",
                recs=recs,
            )
            canaried = c.canary(con, "check")
            c.wait(
                lambda: time.monotonic() - paused_at >= PAUSE, timeout=2 * PAUSE, what="the pause"
            )
        finally:
            p.child.resume()
        resumed_at = time.monotonic()

        assert not [r.describe() for r in recs if r.load_outcome == "done"]
        failed_in = [r.loaded[0].done_at - paused_at for r in recs]
        assert max(failed_in) <= DEATH_BOUND, (
            f"loads failed up to {max(failed_in):.2f}s after the pause (bound {DEATH_BOUND}s)"
        )
        assert canaried["slots"] == sum(r.req.num_blocks for r in recs), canaried
        recovery, probes, probe_s, checks = recover(c, p, con, resumed_at, recs, [con])
        audit(c, p, con)
        measured(
            f"[{data}] producer paused {PAUSE}s (heartbeat timeout {HEARTBEAT_TIMEOUT}s) "
            f"with {len(recs)} loads open: all failed "
            f"{dict(Counter(r.load_outcome for r in recs))} "
            f"{min(failed_in):.2f}-{max(failed_in):.2f}s after the pause; "
            f"{canaried['slots']} canaried slots intact over {checks} checks in the "
            f"{WATCH}s after the resume; first new request done {recovery:.2f}s after the "
            f"resume ({len(probes)} probe(s), earlier ones failed in {probe_s} s); "
            f"stores {dict(Counter(r.store_outcome for r in recs))}; 20 more all done"
        )


def test_consumer_paused_past_the_heartbeat_timeout_stores_resolve_by_the_lease(data: str) -> None:
    with Cluster() as c:
        p, con = start(c, data)
        recs = held_loads(c, p, con)
        c.canary(con, "failed")
        c.canary(p, "failed")
        con.child.pause()
        paused_at = time.monotonic()
        try:
            c.flow.release_stores()  # the producer offers them to the paused consumer
            c.wait(
                lambda: time.monotonic() - paused_at >= PAUSE, timeout=2 * PAUSE, what="the pause"
            )
        finally:
            con.child.resume()
        resumed_at = time.monotonic()

        recovery, probes, probe_s, checks = recover(c, p, con, resumed_at, recs, [con, p])
        stored_in = [r.stored[0][0] - paused_at for r in recs]
        assert max(stored_in) <= 3 * LEASE, (
            f"store jobs resolved up to {max(stored_in):.2f}s after the pause: later than the "
            f"lease ({LEASE}s) after their offer"
        )
        canaried = c.canary(p, "check")
        assert canaried["slots"] >= sum(r.req.num_blocks for r in recs), canaried
        audit(c, p, con)
        measured(
            f"[{data}] consumer paused {PAUSE}s (heartbeat timeout {HEARTBEAT_TIMEOUT}s) "
            f"with {len(recs)} loads open: loads "
            f"{dict(Counter(r.load_outcome for r in recs))}, stores "
            f"{dict(Counter(r.store_outcome for r in recs))} resolved "
            f"{min(stored_in):.2f}-{max(stored_in):.2f}s after the pause (lease {LEASE}s); "
            f"producer's {canaried['slots']} canaried slots and the consumer's intact over "
            f"{checks} checks; first new request done {recovery:.2f}s after the resume "
            f"({len(probes)} probe(s), earlier ones failed in {probe_s} s); 20 more all "
            f"done"
        )


def test_a_zombie_producer_moves_no_byte_into_a_session_the_consumer_gave_up(data: str) -> None:
    with Cluster() as c:
        p, con = start(c, data)
        c.flow.hold_loads = True
        recs = c.flow.admit(
            requests(
                30,
                max_blocks=MAX_BLOCKS,
                orders={"producer_first": 1},
                run_id="zombie",
                first_index=100,
            ),
            p,
            con,
        )
        c.wait(
            lambda: all("P" in r.submitted for r in recs),
            timeout=T,
            what="the producer holding the blocks",
            recs=recs,
        )
        c.flow.hold_loads = False
        c.canary(con, "failed")
        p.child.pause()
        paused_at = time.monotonic()
        try:
            c.flow.send_loads(recs)  # their fetches queue up in the paused producer's socket
            c.wait(
                lambda: all(r.loaded for r in recs),
                timeout=PAUSE,
                what="the consumer giving the paused producer's loads up",
                recs=recs,
            )
            c.wait(
                lambda: time.monotonic() - paused_at >= PAUSE, timeout=2 * PAUSE, what="the pause"
            )
        finally:
            p.child.resume()
        resumed_at = time.monotonic()

        assert not [r.describe() for r in recs if r.load_outcome == "done"]
        failed_in = [r.loaded[0].done_at - r.loaded[0].submitted_at for r in recs]
        assert max(failed_in) <= DEATH_BOUND, failed_in
        canaried = c.canary(con, "check")
        assert canaried["slots"] == sum(r.req.num_blocks for r in recs), canaried
        # The zombie answers its queued fetches now, into a session the consumer closed.
        recovery, probes, _, checks = recover(c, p, con, resumed_at, recs, [con])
        late = [e for e in con.data_log if e[1] == "read" and paused_at < e[0] < probes[0].admitted]
        assert not late, f"the consumer read from the zombie after giving its loads up: {late}"
        audit(c, p, con)
        stored_in = [round(r.stored[0][0] - resumed_at, 2) for r in recs]
        measured(
            f"[{data}] zombie producer: paused {PAUSE}s with {len(recs)} fetches queued in "
            f"its socket; the consumer gave them up "
            f"{dict(Counter(r.load_outcome for r in recs))} within {max(failed_in):.2f}s; "
            f"after the resume its stores ended "
            f"{dict(Counter(r.store_outcome for r in recs))} {min(stored_in)}-"
            f"{max(stored_in)}s after it; {canaried['slots']} canaried slots intact over "
            f"{checks} checks in the {WATCH}s after the resume; first new request done "
            f"{recovery:.2f}s after the resume"
        )
