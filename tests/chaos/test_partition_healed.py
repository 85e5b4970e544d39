"""A partition longer than the lease, then healed (issue 28, "partition healed").

A producer P on host A and a consumer C on host B (network namespaces joined by a veth pair),
zmq control, data over nixl with UCX on TCP (staged reads through the default staging pool)
or over ucx. With loads open and their stores released, the link goes down for ``CUT``
seconds (longer than the lease): the loads fail, both sides drop the session. Then the link
comes back and new requests are admitted at once: the first is done within one handshake
(the time is reported), and a burst of ``AFTER`` more, enough to need every block of nixl's
default staging pool several times over, all succeed: no staging block stayed quarantined by
requests nobody answers (the producer refuses a removed peer's late requests explicitly).
"""

from __future__ import annotations

import time

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
from chaos_netlab import NetLab
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 64 * 1024
MAX_BLOCKS = 8
LOAD = 4.0
LEASE_MARGIN = 2.0
CUT = 8.0
"""Longer than the lease (``LOAD + LEASE_MARGIN``)."""
OPEN = 40
AFTER = 300
HANDSHAKE_BOUND = 2.0
"""From the heal to the first new load done: one handshake on a busy two-core machine,
with a wide margin (the measured figure is reported)."""
T = 60.0


def host_spec(lab: NetLab, kind: str, side: str, slots: int, data: str) -> NodeSpec:
    netns, dev, addr = lab.host(side)
    config = tier_config(
        addr,
        control={"insecure": True},
        data_transport=data,
        timeouts={"load": LOAD, "lease_margin": LEASE_MARGIN},
    )
    return NodeSpec(
        kind,
        RoleSetup(config, BLOCK, slots),
        netns=netns,
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
    )


def test_after_a_partition_longer_than_the_lease_new_loads_are_served_at_once(
    netlab: NetLab, data: str
) -> None:
    first = requests(OPEN + 10, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="part")
    after = requests(
        AFTER,
        max_blocks=MAX_BLOCKS,
        orders={"consumer_first": 1},
        run_id="healed",
        first_index=1000,
    )
    slots = region_blocks(first) + region_blocks(after)
    with Cluster() as c:
        p, con = c.start(
            ("P", host_spec(netlab, "producer", "a", slots, data)),
            ("C", host_spec(netlab, "consumer", "b", slots, data)),
        )
        (recs,) = admit_held(c, [(first, p, con)], warm=10, timeout=T)
        c.flow.hold_stores = False
        c.flow.release_stores()
        cut_at = time.monotonic()
        netlab.cut()
        try:
            c.wait(
                lambda: all(r.loaded for r in recs),
                timeout=T,
                what="every open load ending after the cut",
                recs=recs,
            )
            until = cut_at + CUT  # the partition's length is the scenario, not a settle
            while time.monotonic() < until:
                c.pump(0.05)
        finally:
            netlab.restore()
        healed_at = time.monotonic()
        healed = c.flow.admit(after, p, con)
        c.wait(
            lambda: all(r.finished for r in healed),
            timeout=T,
            what="requests after the heal",
            recs=healed,
        )
        assert not c.flow.problems(), c.flow.problems()[:5]
        assert all_done(healed), not_done(healed)[:5]
        first_done = min(r.loaded[0].done_at for r in healed) - healed_at
        last_done = max(r.loaded[0].done_at for r in healed) - healed_at
        measured(
            f"partition healed ({data}, UCX_TLS=tcp, {CUT:.0f}s cut, lease "
            f"{LOAD + LEASE_MARGIN:.0f}s): first new load done {first_done * 1e3:.0f} ms "
            f"after the heal, all {len(healed)} by {last_done:.2f}s"
        )
        assert first_done <= HANDSHAKE_BOUND, first_done
