"""Scenario 2: the network between two hosts is cut mid-transfer, then restored.

A producer P on host A and a consumer C on host B (network namespaces joined by a veth pair),
plus a second producer P2 on host B; control over zmq, data over nixl with UCX on TCP across
the link. With loads in flight and C's reads from P posted, host A's link goes down: nothing is
sent or received any more, no FIN, no RST, only silence. Every load from P fails within the
heartbeat timeout plus a margin, its reads cancelled (finally) before its result; nothing is
reported twice; P's store jobs resolve by the lease at the latest (a cut-off consumer may still
be reading them: pins outlive the session).

No fences any more (wire 2: the consumer owns every write into its region): the slots of the
failed loads are the engine's again at once. C's region holds exactly the first 100 requests,
so the loads from P2 it starts right after the failures, with the link still cut, must reuse
them — and they succeed with verified bytes. Then C canaries every free slot, the link comes
back, and the reads posted into P before the cut, still queued in UCX/TCP on its side, flow
again: not a byte of them reaches C's slots while C keeps going for five seconds. New requests
between P and C succeed without restarting anything.
"""

from __future__ import annotations

import time
from collections import Counter

from chaos_checks import pin_violations, read_violations
from chaos_cluster import (
    HEARTBEAT,
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
from chaos_netlab import NetLab
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 256 * 1024
MAX_BLOCKS = 12
DEATH_BOUND = 3 * HEARTBEAT["heartbeat_timeout"]
"""From the cut to the last of its loads failing: three times the documented bound
(``heartbeat_timeout``; docs/reliability.md), so a loaded machine cannot miss it while a
hang still fails."""
LOAD = 10.0
LEASE_MARGIN = 2.0
LEASE = LOAD + LEASE_MARGIN
READS_POSTED = 30.0
"""Longest wait for the consumer to post its first reads from the producer (it pauses the
producer itself as it posts them, so this bounds only a failure)."""
WATCH = 5.0
"""Seconds after the restore during which C's canaries are checked again and again."""
T = 60.0


def host_spec(lab: NetLab, kind: str, side: str, slots: int, *, record: bool = False) -> NodeSpec:
    """A node on host ``side`` ("a" or "b"): bound to that host's address, UCX on its link."""
    netns, dev, addr = lab.host(side)
    config = tier_config(
        addr,
        control={"insecure": True},
        data={"staging_blocks": 1 << 20},
        timeouts={"load": LOAD, "lease_margin": LEASE_MARGIN},
    )
    config["flow"] = {"window_rounds": 128}  # every fetch out at once: all stores get pinned
    return NodeSpec(
        kind,
        RoleSetup(config, BLOCK, slots),
        netns=netns,
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
        record=record,
    )


def test_link_cut_mid_transfer_fails_every_job_in_time_and_its_slots_serve_at_once(
    netlab: NetLab,
) -> None:
    first = requests(100, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="cut")
    other = requests(
        40,
        max_blocks=MAX_BLOCKS,
        orders={"consumer_first": 1, "producer_first": 1},
        run_id="other",
        first_index=500,
    )
    after = requests(
        40,
        max_blocks=MAX_BLOCKS,
        orders={"consumer_first": 1, "producer_first": 1},
        run_id="cut2",
        first_index=1000,
    )
    slots = region_blocks(first)
    with Cluster() as c:
        p, con, p2 = c.start(
            ("P", host_spec(netlab, "producer", "a", slots, record=True)),
            ("C", host_spec(netlab, "consumer", "b", slots, record=True)),
            ("P2", host_spec(netlab, "producer", "b", region_blocks(other))),
        )
        (recs,) = admit_held(c, [(first, p, con)], warm=10, timeout=T)

        try:
            stalled = len(stall_reads(c, con, p, recs[10:], READS_POSTED))
            cut_at = time.monotonic()
            netlab.cut()
        finally:
            p.child.resume()
        assert stalled, "no read in flight at the cut"
        open_at_cut = [r for r in recs if not r.loaded]
        c.wait(
            lambda: all(r.loaded for r in recs),
            timeout=T,
            what="every load from P ended after the cut",
            recs=recs,
        )
        failed = [r for r in open_at_cut if r.load_outcome != "done"]
        assert failed, "the cut hit no load in flight"
        late = [
            (r.describe(), r.loaded[0].done_at - cut_at)
            for r in failed
            if r.loaded[0].done_at - cut_at > DEATH_BOUND
        ]
        assert not late, f"loads failed later than {DEATH_BOUND}s after the cut: {late}"
        load_late = max(r.loaded[0].done_at - cut_at for r in failed)

        reuse_at = time.monotonic()  # the link is still cut: the freed slots serve P2 now
        elsewhere = c.flow.admit(other, p2, con)
        c.wait(
            lambda: all(r.finished for r in elsewhere),
            timeout=T,
            what="requests from the other producer into the freed slots",
            recs=elsewhere,
        )
        assert all_done(elsewhere), not_done(elsewhere)
        reused_in = max(r.loaded[0].done_at for r in elsewhere) - reuse_at
        freed = {
            s
            for e in con.data_log
            if e[1] == "result" and e[5] and e[3] != "done" and e[0] > cut_at
            for s in e[4]
        }
        reused = {
            s for e in con.data_log if e[1] == "read" and e[3] == p2.address for s in e[4]
        } & freed
        assert reused, "the other producer's loads used none of the failed loads' slots"

        c.wait(
            lambda: all(r.finished for r in recs),
            timeout=LEASE + T,
            what="every store of P ended after the cut",
            recs=recs,
        )
        assert not c.flow.problems(), c.flow.problems()
        store_fail = [r for r in open_at_cut if r.store_outcome != "done"]
        store_late = max(r.stored[0][0] - cut_at for r in store_fail) if store_fail else 0.0
        assert store_late <= 3 * LEASE, (
            f"stores failed {store_late:.2f}s after the cut (bound {3 * LEASE}s)"
        )
        measured(
            f"link cut with {len(open_at_cut)} loads open and {stalled} read(s) in "
            f"flight: {len(failed)} loads failed "
            f"{dict(Counter(r.load_outcome for r in failed))}, last {load_late:.2f}s after "
            f"the cut; {len(store_fail)} stores failed "
            f"{dict(Counter(r.store_outcome for r in store_fail))}, last "
            f"{store_late:.2f}s (lease {LEASE}s); {len(elsewhere)} requests from P2 done "
            f"in {reused_in:.2f}s, link still cut, {len(reused)} of their slots freed by "
            f"the failed loads"
        )

        canaried = c.canary(con, "free")  # every slot of C: the requests below wait
        netlab.restore()
        checks = c.watch_canaries([con], WATCH)
        c.canary(con, "release")
        restored = c.flow.admit(after, p, con)
        c.wait(
            lambda: all(r.finished for r in restored),
            timeout=T,
            what="requests after the link came back",
            recs=restored,
        )
        assert all(len(r.loaded) == 1 and len(r.stored) <= 1 for r in restored)
        assert all_done(restored), [r.describe() for r in restored if not all_done([r])]
        for node in (p, con, p2):
            assert not c.report(node)["anomalies"], node.name
        assert not c.flow.problems(), c.flow.problems()
        assert not [e for e in p.data_log if e[1] == "read"], "the producer posted reads"
        violations = read_violations(con.data_log)
        assert not violations, violations[:5]
        early = pin_violations(p.data_log, con.data_log, p.address, LEASE)
        assert not early, early[:5]
        last = max(r.loaded[0].done_at for r in restored) - min(r.admitted for r in restored)
        measured(
            f"link restored: {canaried['slots']} free slots of C canaried, intact over "
            f"{checks} checks in the {WATCH}s after the restore; then {len(restored)} new "
            f"requests done with verified bytes, the last {last:.2f}s after admission"
        )
