"""A consumer paused (SIGSTOP) past the heartbeat timeout with loads open, then resumed,
ten times in a row in the same processes (issue 28, "consumer resumed").

While the consumer is stopped its producer stores the blocks and answers the fetches (the
``ready`` frames queue in the consumer's socket), then drops the session. On the resume the
consumer's tier sees that it was not ticked for longer than its control transport's silence
timeout and closes its sessions before it reads anything: the loads from before the pause
end at once (``peer_dead``, "paused" in the detail), no read is posted for a stale ``ready``
(so nixl's staging pool keeps no quarantined block), and new loads from the paused producer
and from a second producer that was never paused succeed, on every one of the ten rounds.

Over nixl's default lane, nixl with ``UCX_TLS=tcp`` (staged reads) and ucx; zmq control.
"""

from __future__ import annotations

import time

from chaos_cluster import Cluster, Node, Req, all_done, measured, not_done, requests, tier_config
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 16 * 1024
MAX_BLOCKS = 4
HEARTBEAT_TIMEOUT = 1.0
PAUSE = 2.0
"""Twice the heartbeat timeout: the producer drops the session while the consumer is stopped."""
ROUNDS = 10
OPEN = 10
END_BOUND = 0.5
"""From the resume to the last pre-pause load ending (the requirement is 100 ms; the bound
leaves a busy two-core machine 5x; the measured figure is reported)."""
T = 60.0


def spec(kind: str, data: str, env: dict[str, str]) -> NodeSpec:
    config = tier_config(
        data_transport=data,
        timeouts={"load": 20.0, "handshake": 10.0},
        control={"heartbeat_timeout": HEARTBEAT_TIMEOUT, "heartbeat_ttl": HEARTBEAT_TIMEOUT},
    )
    return NodeSpec(kind, RoleSetup(config, BLOCK, 2000 * MAX_BLOCKS), env=env)


def _loads(c: Cluster, p: Node, con: Node, run: str, first: int) -> list[Req]:
    return c.flow.admit(
        requests(
            OPEN, max_blocks=MAX_BLOCKS, orders={"consumer_first": 1}, run_id=run, first_index=first
        ),
        p,
        con,
    )


def _one_round(c: Cluster, nodes: tuple[Node, Node, Node], no: int) -> float:
    """Pause the consumer with loads open, resume it; returns how long after the resume the
    last pre-pause load ended. Then loads from both producers must succeed."""
    p, q, con = nodes
    c.flow.hold_stores = True
    before = _loads(c, p, con, f"pre{no}", 10_000 * (no + 1))
    c.wait(lambda: len(c.flow.held) == len(before), timeout=T, what="loads submitted", recs=before)
    c.flow.hold_stores = False
    con.child.pause()
    c.flow.release_stores()  # the producer answers while the consumer is stopped
    until = time.monotonic() + PAUSE  # the scenario's pause, not a settling delay
    while time.monotonic() < until:
        c.pump(0.05)
    con.child.resume()
    resumed = time.monotonic()
    c.wait(
        lambda: all(r.loaded for r in before), timeout=T, what="pre-pause loads ending", recs=before
    )
    ended = max(r.loaded[0].done_at for r in before) - resumed
    stale = [
        r.describe()
        for r in before
        if r.load_outcome == "done" or "paused" not in r.loaded[0].detail
    ]
    assert not stale, f"round {no}: loads not ended by the pause detection: {stale[:3]}"
    after = _loads(c, p, con, f"p{no}", 10_000 * (no + 1) + 1000) + _loads(
        c, q, con, f"q{no}", 10_000 * (no + 1) + 2000
    )
    c.wait(
        lambda: all(r.finished for r in after), timeout=T, what="loads after the resume", recs=after
    )
    assert not c.flow.problems(after), c.flow.problems(after)[:3]
    assert all_done(after), f"round {no}: {not_done(after)[:3]}"
    return ended


def test_a_resumed_consumer_ends_pre_pause_loads_at_once_and_serves_again(
    data: str, lane: dict[str, str]
) -> None:
    with Cluster() as c:
        nodes = c.start(
            ("P", spec("producer", data, lane)),
            ("Q", spec("producer", data, lane)),
            ("C", spec("consumer", data, lane)),
        )
        p, q, con = nodes
        warm = _loads(c, p, con, "warm", 0) + _loads(c, q, con, "warmq", 1000)
        c.wait(lambda: all(r.finished for r in warm), timeout=T, what="warm-up", recs=warm)
        assert all_done(warm), not_done(warm)
        ends = [_one_round(c, (p, q, con), no) for no in range(ROUNDS)]
        stats = c.report(con)["stats"]
        measured(
            f"consumer resumed {data}/{lane.get('UCX_TLS', 'default')}: pre-pause loads "
            f"ended {max(ends) * 1e3:.0f} ms after the resume at worst over {ROUNDS} "
            f"rounds (median {sorted(ends)[len(ends) // 2] * 1e3:.0f} ms)"
        )
        assert max(ends) <= END_BOUND, ends
        assert "jobs_submit_failed" not in stats, stats
