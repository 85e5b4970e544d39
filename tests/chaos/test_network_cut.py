"""Scenario 2: the network between two hosts is cut mid-transfer, then restored.

A producer on host A and a consumer on host B (network namespaces joined by a veth pair);
control over zmq, data over nixl with UCX on TCP across the link. With loads in flight and
writes posted, host A's link goes down: nothing is sent or received any more, no FIN, no RST,
only silence. Every consumer job fails within the heartbeat timeout plus a margin, the
producer's store jobs fail once their writes drained or the drain deadline gave up on them,
nothing is reported twice. The link comes back: new requests succeed without restarting
anything, with verified bytes.

That last part is the hard one: writes posted before the cut are still queued in UCX/TCP and
land seconds after the link returns, into consumer slots released at PEER_DEAD. The consumer
fences those slots (docs/protocol.md §5.1) until the producer says ``quiesced`` (its retiring
writes ended), so no new load is sent into them meanwhile; the producer's recording shows no
write posted into a slot an earlier write was still writing.
"""

from __future__ import annotations

import time
from collections import Counter

from chaos_checks import overlapping_writes, release_violations
from chaos_cluster import (
    HEARTBEAT,
    Cluster,
    admit_held,
    all_done,
    measured,
    region_blocks,
    requests,
    stall_writes,
    tier_config,
)
from chaos_netlab import NetLab
from chaos_node import NodeSpec
from p2pkv.demo.roles import RoleSetup

BLOCK = 256 * 1024
MAX_BLOCKS = 12
MARGIN = 1.5
DEATH_BOUND = HEARTBEAT["heartbeat_timeout"] + MARGIN
DRAIN = 3.0
"""``timeouts.shutdown_drain``: how long a closed session waits for its writes to drain."""
PAUSE = 0.6
T = 60.0


def host_spec(lab: NetLab, kind: str, side: str, slots: int, *, record: bool = False,
              timeouts: dict[str, float] | None = None) -> NodeSpec:
    """A node on host ``side`` ("a" or "b"): bound to that host's address, UCX on its link."""
    netns, dev, addr = ((lab.a, lab.dev_a, lab.addr_a) if side == "a"
                        else (lab.b, lab.dev_b, lab.addr_b))
    config = tier_config(addr, control={"insecure": True},
                         timeouts={"shutdown_drain": DRAIN, **(timeouts or {})})
    return NodeSpec(kind, RoleSetup(config, BLOCK, slots), netns=netns,
                    env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev}, record=record)


def test_link_cut_mid_transfer_fails_every_job_in_time_and_restored_link_serves(
    netlab: NetLab,
) -> None:
    first = requests(100, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="cut")
    after = requests(40, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1,
                     "producer_first": 1}, run_id="cut2", first_index=1000)
    slots = region_blocks(first)
    with Cluster() as c:
        p, con = c.start(("P", host_spec(netlab, "producer", "a", slots, record=True)),
                         ("C", host_spec(netlab, "consumer", "b", slots, record=True)))
        (recs,) = admit_held(c, [(first, p, con)], warm=10, timeout=T)

        try:
            stalled = len(stall_writes(c, p, con, recs[10:], PAUSE))
            cut_at = time.monotonic()
            netlab.cut()
        finally:
            con.child.resume()
        open_at_cut = [r for r in recs if not r.loaded]
        c.wait(lambda: all(r.finished for r in recs), timeout=T,
               what="every request ended after the cut", recs=recs)

        assert not c.flow.problems(), c.flow.problems()
        failed = [r for r in open_at_cut if r.load_outcome != "done"]
        assert failed, "the cut hit no load in flight"
        late = [(r.describe(), r.loaded[0].done_at - cut_at) for r in failed
                if r.loaded[0].done_at - cut_at > DEATH_BOUND]
        assert not late, f"loads failed later than {DEATH_BOUND}s after the cut: {late}"
        store_fail = [r for r in open_at_cut if r.store_outcome != "done"]
        store_late = max(r.stored[0][0] - cut_at for r in store_fail) if store_fail else 0.0
        assert store_late <= DEATH_BOUND + DRAIN, (
            f"stores failed {store_late:.2f}s after the cut (bound {DEATH_BOUND + DRAIN}s)")
        violations = release_violations(p.data_log, give_up_after=DRAIN)
        assert not violations, violations
        load_late = max(r.loaded[0].done_at - cut_at for r in failed)
        measured(f"link cut with {len(open_at_cut)} loads open and {stalled} write(s) in flight: "
                 f"{len(failed)} loads failed {dict(Counter(r.load_outcome for r in failed))}, "
                 f"last {load_late:.2f}s after the cut; {len(store_fail)} stores failed "
                 f"{dict(Counter(r.store_outcome for r in store_fail))}, last {store_late:.2f}s")

        netlab.restore()
        restored_at = time.monotonic()
        restored = c.flow.admit(after, p, con)
        c.wait(lambda: all(r.finished for r in restored), timeout=T,
               what="requests after the link came back", recs=restored)
        assert all(len(r.loaded) == 1 and len(r.stored) <= 1 for r in restored)
        assert all_done(restored), [r.describe() for r in restored if not all_done([r])]
        for node in (p, con):
            assert not c.report(node)["anomalies"], node.name
        assert not c.flow.problems(), c.flow.problems()
        assert not overlapping_writes(p.data_log), overlapping_writes(p.data_log)
        last = max(r.loaded[0].done_at for r in restored) - restored_at
        measured(f"link restored: {len(restored)} new requests done with verified bytes, the "
                 f"last {last:.2f}s after the restore")
