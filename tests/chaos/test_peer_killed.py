"""Scenario 1: a peer is SIGKILLed mid-transfer (zmq control; nixl and ucx data, each when
installed; every peer in its own process).

- Producer killed: a consumer has 200 loads in flight, half from producer A and half from
  producer B. A is killed while the consumer's reads from it are in flight. Every load of A
  without a result ends (exactly once) within the heartbeat timeout plus a margin, its reads
  cancelled before its result; B's requests all succeed with verified bytes; a new producer at
  A's address serves new requests.
- Consumer killed: a producer serves consumers C1 and C2; C1 is killed while its reads from
  the producer are in flight. The producer's store jobs for C1 fail: those C1 was offered stay
  pinned until the lease has passed (a dead session does not shorten it), never handed back
  while C1 could still accept a read of them; stores submitted after the kill fail at submit or
  at the unbound-store timeout. C2's requests all succeed.

"In flight" is made certain, not hoped for: reads go over TCP (UCX's ``TLS=tcp``, as between
hosts; the ucx transport is two-sided anyway), where a read needs its source's progress to
complete, and the source (the producer) is paused (SIGSTOP, well under the heartbeat timeout)
as soon as the consumer reports reads from it posted. The kill lands with them still live.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

from chaos_checks import pin_violations, read_violations
from chaos_cluster import (
    Cluster,
    admit_held,
    all_done,
    measured,
    not_done,
    region_blocks,
    requests,
    stall_reads,
    tier_config,
)
from chaos_node import NodeSpec
from p2pkv.addressing import parse_address
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 256 * 1024
MAX_BLOCKS = 12
DATA: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "nixl": ({"staging_blocks": 1 << 20}, {"UCX_TLS": "tcp"}),
    "ucx": ({"ucx_config": {"TLS": "tcp"}}, {}),
}
"""Per data transport: ``data_options`` and environment putting its reads on TCP. Off
``cma`` the nixl transport reads through its staging pool and refuses a read the pool cannot
hold (``submit_failed``); here it holds the whole region (its cap), so 200 loads in flight
fit."""
HEARTBEAT_TIMEOUT = 2.0
"""Seconds of silence before a connection is dead. Longer than the suite's usual second: the
source stays paused (silent) while the kill lands, on a busy machine."""
DEATH_BOUND = 3 * HEARTBEAT_TIMEOUT
"""From the kill to the last of its loads failing: three times the documented bound
(``heartbeat_timeout``; docs/reliability.md), so a loaded machine cannot miss it while a
hang still fails."""
UNBOUND = 3.0
READS_POSTED = 30.0
"""Longest wait for the reader to post its first reads from the source (the reader pauses
the source itself as it posts them, so this bounds only a failure)."""
LOAD = 10.0
LEASE_MARGIN = 2.0
LEASE = LOAD + LEASE_MARGIN
"""The consumer-kill test's lease: how long the producer pins what it offered to C1."""
T = 60.0


def spec(
    kind: str,
    slots: int,
    data: str,
    *,
    port: int = 0,
    record: bool = False,
    timeouts: dict[str, float] | None = None,
) -> NodeSpec:
    options, env = DATA[data]
    config = tier_config(
        port=port,
        timeouts={"unbound_store": UNBOUND, **(timeouts or {})},
        data=options,
        data_transport=data,
        control={"heartbeat_timeout": HEARTBEAT_TIMEOUT, "heartbeat_ttl": HEARTBEAT_TIMEOUT},
    )
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), env=env, record=record)


def test_producer_killed_mid_transfer_fails_its_loads_only_and_a_restart_serves(
    data: str,
) -> None:
    reqs = requests(200, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="kill-p")
    with Cluster() as c:
        a, b, con = c.start(
            ("A", spec("producer", region_blocks(reqs[:100]), data)),
            ("B", spec("producer", region_blocks(reqs[100:]), data)),
            ("C", spec("consumer", region_blocks(reqs), data, record=True)),
        )
        of_a, of_b = admit_held(c, [(reqs[:100], a, con), (reqs[100:], b, con)], warm=10, timeout=T)
        warm = of_a[:10] + of_b[:10]

        stalled = stall_reads(c, con, a, [r for r in of_a + of_b if r not in warm], READS_POSTED)
        open_at_kill = [r for r in of_a if not r.loaded]
        killed_at = a.kill()
        c.wait(
            lambda: all(r.loaded for r in of_a) and all(r.finished for r in of_b),
            timeout=T,
            what="every load of A and every request of B ended",
        )

        assert stalled, "the kill hit no read in flight"
        assert not c.flow.problems(), c.flow.problems()
        failed = [r for r in open_at_kill if r.load_outcome != "done"]
        assert failed, "the kill hit no load in flight"
        late = [
            (r.describe(), r.loaded[0].done_at - killed_at)
            for r in failed
            if r.loaded[0].done_at - killed_at > DEATH_BOUND
        ]
        assert not late, f"loads failed later than {DEATH_BOUND}s after the kill: {late}"
        assert all_done(of_b), not_done(of_b)
        violations = read_violations(con.data_log)
        assert not violations, violations[:5]
        worst = max(r.loaded[0].done_at - killed_at for r in failed)
        measured(
            f"[{data}] producer killed with {len(open_at_kill)} of its 100 loads open and "
            f"{len(stalled)} read(s) from it in flight: {len(failed)} failed "
            f"{dict(Counter(r.load_outcome for r in failed))}, the last "
            f"{worst * 1000:.0f} ms after the kill (bound {DEATH_BOUND}s), every read "
            f"cancelled before its load's result; the other producer's 100 requests all "
            f"done"
        )

        port = parse_address(a.address)[1]
        (a2,) = c.start(("A2", spec("producer", 50 * MAX_BLOCKS, data, port=port)))
        assert a2.address == a.address
        again = c.flow.admit(
            requests(
                50,
                max_blocks=MAX_BLOCKS,
                orders={"consumer_first": 1, "producer_first": 1},
                run_id="kill-p2",
                first_index=1000,
            ),
            a2,
            con,
        )
        c.wait(
            lambda: all(r.finished for r in again),
            timeout=T,
            what="requests to the restarted producer",
            recs=again,
        )
        assert all_done(again), not_done(again)
        assert not c.flow.problems(), c.flow.problems()
        for node in (b, con, a2):
            assert not c.report(node)["anomalies"], node.name


def test_consumer_killed_mid_transfer_fails_its_stores_without_freeing_live_slots(
    data: str,
) -> None:
    reqs = requests(200, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="kill-c")
    lease = {"load": LOAD, "lease_margin": LEASE_MARGIN}
    with Cluster() as c:
        p, c1, c2 = c.start(
            ("P", spec("producer", region_blocks(reqs), data, record=True, timeouts=lease)),
            ("C1", spec("consumer", region_blocks(reqs[:100]), data, record=True, timeouts=lease)),
            ("C2", spec("consumer", region_blocks(reqs[100:]), data, timeouts=lease)),
        )
        of_c1, of_c2 = admit_held(c, [(reqs[:100], p, c1), (reqs[100:], p, c2)], warm=10, timeout=T)
        warm = of_c1[:10] + of_c2[:10]

        later = of_c1[-20:]  # stored only after the kill: an engine keeps prefilling
        try:
            stalled = stall_reads(
                c,
                c1,
                p,
                [r for r in of_c1 + of_c2 if r not in warm and r not in later],
                READS_POSTED,
            )
            killed_at = c1.kill()
        finally:
            p.child.resume()
        c.flow.release_stores()  # ``later``
        c.wait(
            lambda: all(r.stored for r in of_c1) and all(r.finished for r in of_c2),
            timeout=T + LEASE,
            what="every store of C1's requests and C2's requests",
        )

        assert stalled, "the kill hit no read in flight"
        assert not c.flow.problems(), c.flow.problems()
        assert all_done(of_c2), not_done(of_c2)
        failed = [r for r in of_c1 if r.store_outcome != "done"]
        assert failed, "the kill hit no store in flight"
        bounds = {"unbound_timeout": 3 * UNBOUND}
        late = [
            (r.describe(), t - killed_at)
            for r in failed
            for t, _ in r.stored
            if t - killed_at > bounds.get(r.store_outcome or "", 3 * LEASE)
        ]
        assert not late, f"stores failed too late: {late}"
        # Stored after the kill: failed at once if the producer already knew C1 dead (the
        # request's session is gone), else parked until nobody fetched them.
        assert {r.store_outcome for r in later} <= {
            "submit_failed",
            "peer_dead",
            "unbound_timeout",
        }, [r.describe() for r in later]
        report = c.report(p)
        assert not report["anomalies"], report["anomalies"]
        assert not [e for e in p.data_log if e[1] == "read"], "the producer posted reads"
        early = pin_violations(p.data_log, c1.data_log, p.address, LEASE)
        assert not early, early[:5]
        pinned = [r for r in failed if r not in later]
        held_for = sorted(r.stored[0][0] - killed_at for r in pinned)
        timing: dict[str, float] = {}
        for r in failed:
            o = r.store_outcome or ""
            timing[o] = max(timing.get(o, 0), r.stored[0][0] - killed_at)
        measured(
            f"[{data}] consumer killed with {len(stalled)} read(s) of it in flight: "
            f"{len(failed)} store job(s) failed "
            f"{dict(Counter(r.store_outcome for r in failed))}; those offered to it "
            f"resolved {held_for[0]:.2f}-{held_for[-1]:.2f}s after the kill (lease "
            f"{LEASE}s), none while it could still accept a read; last of each kind after "
            f"{ {k: round(v, 2) for k, v in timing.items()} } s; other consumer all done"
        )
