"""Two loads of the same keys under one ``kv_request_id``, on a session with 20 other
requests in flight (zmq control; nixl and ucx data; producer and consumer in their own
processes).

A request's keys may be loaded once at a time: the second load of keys a round of the same
request is still loading is refused with ``request_conflict`` — only that job: its request's
first load and the 20 other requests sharing the session all succeed with verified bytes, and
the session lives on.
"""

from __future__ import annotations

from chaos_checks import read_violations
from chaos_cluster import (
    Cluster,
    all_done,
    measured,
    not_done,
    region_blocks,
    requests,
    tier_config,
)
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 64 * 1024
MAX_BLOCKS = 8
OTHERS = 20
T = 60.0


def test_a_second_load_of_the_same_keys_fails_request_conflict_and_nothing_else(
    data: str,
) -> None:
    reqs = requests(
        OTHERS + 1, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id="conflict"
    )
    slots = 2 * region_blocks(reqs)
    config = tier_config(data_transport=data)
    with Cluster() as c:
        p, con = c.start(
            ("P", NodeSpec("producer", RoleSetup(config, BLOCK, slots))),
            ("C", NodeSpec("consumer", RoleSetup(config, BLOCK, slots), record=True)),
        )
        warm = c.flow.admit(
            requests(
                5,
                max_blocks=MAX_BLOCKS,
                orders={"consumer_first": 1},
                run_id="warm",
                first_index=500,
            ),
            p,
            con,
        )
        c.wait(lambda: all(r.finished for r in warm), timeout=T, what="warm-up", recs=warm)
        c.flow.hold_stores = True  # every load stays open until the second one was refused
        recs = c.flow.admit(reqs, p, con)
        c.wait(lambda: len(c.flow.held) == len(recs), timeout=T, what="loads submitted", recs=recs)
        target, others = recs[0], recs[1:]
        assert con.send(("load_again", target.req, p.address))
        c.wait(lambda: bool(target.again), timeout=T, what="the second load's result")
        assert not any(r.loaded for r in recs), "a load ended before its blocks were stored"
        c.flow.hold_stores = False
        c.flow.release_stores()
        c.wait(lambda: all(r.finished for r in recs), timeout=T, what="every request", recs=recs)

        (again,) = target.again
        assert again.outcome == "request_conflict", again
        assert all_done(others), not_done(others)
        assert all_done([target]), not_done([target])
        assert not c.flow.problems(), c.flow.problems()
        for node in (p, con):
            rep = c.report(node)
            assert not rep["anomalies"], (node.name, rep["anomalies"])
            assert rep["stats"]["sessions"] == 1, (node.name, rep["stats"])
            assert not rep["stats"].get("jobs_peer_dead"), (node.name, rep["stats"])
        violations = read_violations(con.data_log)
        assert not violations, violations[:5]
        measured(
            f"[{data}] second load of {target.req.num_blocks} keys under "
            f"{target.req.kv_request_id!r}: {again.outcome} in "
            f"{(again.done_at - again.submitted_at) * 1000:.1f} ms ({again.detail}); its "
            f"first load and the {len(others)} other requests on the session all done"
        )
