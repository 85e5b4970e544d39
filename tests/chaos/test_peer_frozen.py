"""A peer frozen mid-transfer (SIGSTOP) never stalls or fails another peer (issue 46).

Every peer in its own process, zmq control; data over nixl's default lane (``cma`` on this
host), nixl with ``UCX_TLS=tcp`` (the staged lane), ucx's default lane and ucx with
``UCX_TLS=tcp``; heartbeat timeout 1 s (what docs/reliability.md measures with) and the
default 10 s. Two scenarios:

- **A stopped consumer while its producer serves others.** Consumers C1 and C2 stream loads
  from producer P. C1 stops itself (SIGSTOP) right after posting reads from P, so P has sends
  serving it in flight. C1 stays stopped past the heartbeat timeout: P's session with C1
  dies and P removes C1's data peer. C2's loads go on.
- **A stopped producer while the consumer loads from others.** Consumer C streams loads from
  producers P1 and P2. C stops P1 right after posting reads from it, so P1's transfers are in
  flight (holding whatever C's data transport shares among peers). P1 stays stopped past the
  heartbeat timeout. C's loads from P2 go on.

Every node's staging (``BUDGETS``) is small enough for the stopped producer's transfers to
fill it. Asserted, as work done and never as time: every load of the healthy peer succeeds (0
failed); it starts and completes loads while the peer is stopped, before the stopped peer's
removal (its session died of heartbeat loss; ``FRESH``), and ``AFTER_LOADS`` more after that
removal: the peer stays stopped until then. The *stall* is measured and reported, not asserted: the
longest stretch, while the peer was stopped, in which the healthy stream had loads open and
none completed, next to the same figure for the seconds before the stop, and how long the
removal held the tick (``MEASUREMENTS``; docs/reliability.md, "peer frozen mid-transfer").
"""

from __future__ import annotations

import itertools
import os
import time
from collections import Counter
from collections.abc import Callable, Sequence

import psutil
import pytest
from chaos_cluster import Cluster, Node, Req, Stream, measured, requests, tier_config
from chaos_node import NodeSpec
from p2pkv_tools.demo.roles import RoleSetup

BLOCK = 512 * 1024
MAX_BLOCKS = 8
WINDOW = 16
"""Loads in flight per stream: about 72 blocks (36 MiB), far more than the shared budgets."""
BUDGETS = {
    "ucx": {"staging_bytes": 16 * BLOCK, "max_message_bytes": 4 * BLOCK},
    "nixl": {"staging_blocks": 16},
}
"""Each node's staging (the budget a consumer's peers share), 16 blocks: a stopped producer's
transfers in flight can fill it. Over tcp ucx takes it for every run whose header arrived,
and those of a stopped producer never complete; nixl's staged lane holds it per read."""
SLOTS = 3 * WINDOW * MAX_BLOCKS
"""Two streams' windows, and the blocks a producer keeps pinned for a stopped consumer."""
STREAM = 20_000
"""Requests each stream may admit: more than any run finishes."""
AFTER_LOADS = 2 * WINDOW
"""Loads the healthy peer completes after the stopped peer's removal (its session died)
before the stopped peer is resumed: work done while it is still stopped."""
BASELINE = 2.0
"""Seconds of streaming before the stop whose stall is reported as the baseline."""
HEARTBEATS = {"1s": (0.2, 1.0), "default": (2.0, 10.0)}
"""Heartbeat interval and timeout (= ttl): the chaos suite's 1 s, and zmq's defaults."""
FRESH = {1.0: 0, 10.0: WINDOW}
"""Loads the healthy peer must start after the stop and complete before the stopped peer's
removal, by heartbeat timeout: a whole window at 10 s. A stopped peer holding what the healthy
loads need lets none of them complete: only loads already under way before the stop may.
At 1 s the removal comes about a second into the stop, which a busy host may spend without
letting any fresh load finish: that scenario holds 0 failed and ``AFTER_LOADS`` done while the
peer is still stopped, and reports its stall."""
T = 120.0


@pytest.fixture(params=["default", "tcp"])
def lane(request: pytest.FixtureRequest, data: str) -> dict[str, str]:
    """Every node's environment: the transport's default lane, or UCX over tcp, here for ucx
    too. Over tcp a stopped producer's rendezvous runs stay half received (on this host's
    shared-memory lanes the consumer pulls them itself), so they hold staging: the case
    ucx's shares are for."""
    return {"UCX_TLS": "tcp"} if request.param == "tcp" else {}


@pytest.fixture(
    params=[
        pytest.param(name, marks=pytest.mark.chaos_slow) if name == "default" else name
        for name in sorted(HEARTBEATS)
    ]
)
def heartbeat(request: pytest.FixtureRequest) -> tuple[float, float]:
    interval, timeout = HEARTBEATS[request.param]
    return interval, timeout


def spec(
    kind: str,
    data: str,
    env: dict[str, str],
    heartbeat: tuple[float, float],
    *,
    record: bool = False,
) -> NodeSpec:
    interval, timeout = heartbeat
    config = tier_config(
        data_transport=data,
        timeouts={"load": 60.0, "handshake": 10.0},
        data=BUDGETS[data],
        control={
            "heartbeat_interval": interval,
            "heartbeat_timeout": timeout,
            "heartbeat_ttl": timeout,
        },
    )
    logs = os.environ.get("P2PKV_CHAOS_LOGS")  # a directory: each node logs into a file there
    log_path = f"{logs}/{kind}-{time.monotonic_ns()}.log" if logs else None
    return NodeSpec(
        kind, RoleSetup(config, BLOCK, SLOTS), env=env, record=record, log_path=log_path
    )


def stream(c: Cluster, producer: Node, consumer: Node, run: str, first: int) -> Stream:
    """Producer-first requests: the blocks are there when the load asks, so every load of the
    window has its reads in flight at once."""
    reqs = requests(
        STREAM, max_blocks=MAX_BLOCKS, orders={"producer_first": 1}, run_id=run, first_index=first
    )
    return Stream(c, reqs, producer, consumer, WINDOW)


def step_all(streams: Sequence[Stream]) -> None:
    for s in streams:
        s.step(0.005)


def run_until(c: Cluster, streams: Sequence[Stream], done: Callable[[], bool], what: str) -> None:
    """Step every stream until ``done()`` holds (bounded by ``T``)."""

    def reached() -> bool:
        step_all(streams)
        return done()

    c.wait(reached, timeout=T, what=what)


def warm(c: Cluster, streams: Sequence[Stream], count: int) -> None:
    """Step until every stream finished ``count`` requests (sessions up, endpoints wired)."""
    run_until(
        c,
        streams,
        lambda: all(s.finished >= count for s in streams),
        f"{count} requests done on every stream",
    )


def wind_down(c: Cluster, streams: Sequence[Stream]) -> None:
    """Admit nothing more; wait until every admitted load ended (a store the stopped peer
    pinned may wait for its lease: not needed here)."""
    for s in streams:
        s.pending = []
    run_until(
        c,
        streams,
        lambda: all(r.loaded for s in streams for r in s.admitted),
        "the streams' loads ending",
    )


def stopped(node: Node) -> bool:
    try:
        return bool(psutil.Process(node.pid).status() == psutil.STATUS_STOPPED)
    except psutil.NoSuchProcess:
        return False


def completions(recs: Sequence[Req]) -> list[float]:
    return sorted(r.loaded[0].done_at for r in recs if r.loaded)


def stall(done_at: Sequence[float], start: float, end: float) -> float:
    """The longest stretch within ``start..end`` without a completion (the stream always had
    loads open)."""
    points = [start, *(t for t in done_at if start < t < end), end]
    return max(b - a for a, b in itertools.pairwise(points))


def healthy_verdict(c: Cluster, recs: Sequence[Req]) -> None:
    """Every load of the healthy stream ended done with exact bytes: 0 failed."""
    assert not c.flow.problems(recs), c.flow.problems(recs)[:5]
    failed = [r.describe() for r in recs if r.load_outcome != "done"]
    assert not failed, f"{len(failed)} load(s) of the healthy peer failed: {failed[:5]}"


def lane_name(data: str, lane: dict[str, str]) -> str:
    return f"{data}/{lane.get('UCX_TLS', 'default')}"


def removal(node: Node, peer: Node) -> tuple[float, float] | None:
    """When ``node``'s data transport began and ended removing ``peer`` (recorded), if it
    did."""
    began = [e[0] for e in node.data_log if e[1] == "remove_peer_begin" and e[2] == peer.address]
    ended = [e[0] for e in node.data_log if e[1] == "remove_peer" and e[2] == peer.address]
    return (began[0], ended[0]) if began and ended else None


def done_after(recs: Sequence[Req], t: float) -> int:
    return sum(1 for r in recs if r.loaded and r.loaded[0].done_at > t)


def stay_stopped(
    c: Cluster,
    streams: Sequence[Stream],
    healthy: Stream,
    remover: Node,
    stopped_peer: Node,
    what: str,
) -> tuple[float, float]:
    """Keep streaming, the peer stopped, until ``remover`` removed it (its session died) and
    the healthy stream completed ``AFTER_LOADS`` loads after that; returns the removal."""

    def enough() -> bool:
        removed = removal(remover, stopped_peer)
        return removed is not None and done_after(healthy.admitted, removed[1]) >= AFTER_LOADS

    run_until(c, streams, enough, what)
    removed = removal(remover, stopped_peer)
    assert removed is not None
    return removed


def report(
    scenario: str,
    data: str,
    lane: dict[str, str],
    timeout: float,
    healthy: Sequence[Req],
    frozen: Sequence[Req],
    window: tuple[float, float],
    base_from: float,
    removed: tuple[float, float],
) -> None:
    paused_at, resumed_at = window
    done_at = completions(healthy)
    failed = Counter(r.load_outcome for r in healthy if r.load_outcome != "done")
    measured(
        f"[{scenario}, {lane_name(data, lane)}, heartbeat {timeout:g}s] healthy peer's "
        f"{len(healthy)} loads failed {dict(failed)}; stall while stopped "
        f"{stall(done_at, paused_at, resumed_at):.2f}s (baseline "
        f"{stall(done_at, base_from, base_from + BASELINE):.2f}s); removal of the stopped peer "
        f"{removed[0] - paused_at:.2f}s into the stop held the tick {removed[1] - removed[0]:.3f}s;"
        f" healthy loads done before it {len([t for t in done_at if paused_at < t < removed[0]])}"
        f" ({fresh(healthy, paused_at, removed)} started after the stop),"
        f" after it {len([t for t in done_at if removed[1] < t < resumed_at])}; stopped "
        f"peer's loads {dict(Counter(r.load_outcome for r in frozen))}"
    )


def fresh(recs: Sequence[Req], paused_at: float, removed: tuple[float, float]) -> int:
    """Loads the consumer started after the stop and completed before the removal began."""
    return sum(
        1
        for r in recs
        if r.loaded
        and r.loaded[0].done_at < removed[0]
        and r.submitted.get(r.consumer.name, 0.0) > paused_at
    )


def healthy_kept_going(
    c: Cluster,
    healthy: Sequence[Req],
    paused_at: float,
    removed: tuple[float, float],
    timeout: float,
) -> None:
    """0 failed, and ``FRESH`` loads started after the stop done before the stopped peer's
    removal (its session died of heartbeat loss): loads done while it was stopped."""
    healthy_verdict(c, healthy)
    done = fresh(healthy, paused_at, removed)
    assert done >= FRESH[timeout], (
        f"the healthy peer started and completed {done} load(s) between the stop and the "
        f"stopped peer's removal, fewer than {FRESH[timeout]}: the stopped peer's transfers "
        f"held what the healthy peer's loads needed"
    )


def freeze_and_measure(
    c: Cluster,
    frozen: Stream,
    healthy: Stream,
    remover: Node,
    stopped_peer: Node,
    freeze: Callable[[], float],
    scenario: str,
    where: tuple[str, dict[str, str], float],
) -> None:
    """Both streams warm, a baseline, then ``freeze()`` (it stops ``stopped_peer`` and returns
    when): stay stopped until ``remover`` removed it and the healthy stream went on, resume,
    let every load end; report, then assert the healthy peer kept going."""
    streams = [frozen, healthy]
    warm(c, streams, 2 * WINDOW)
    base_from = time.monotonic()
    run_until(c, streams, lambda: time.monotonic() - base_from >= BASELINE, "the baseline")
    paused_at = freeze()
    try:
        removed = stay_stopped(
            c,
            streams,
            healthy,
            remover,
            stopped_peer,
            f"{remover.name} removing the stopped {stopped_peer.name} and "
            f"the healthy stream going on after that",
        )
    finally:
        stopped_peer.child.resume()
    resumed_at = time.monotonic()
    wind_down(c, streams)
    data, lane, timeout = where
    report(
        scenario,
        data,
        lane,
        timeout,
        healthy.admitted,
        frozen.admitted,
        (paused_at, resumed_at),
        base_from,
        removed,
    )
    healthy_kept_going(c, healthy.admitted, paused_at, removed, timeout)


def test_a_stopped_consumer_never_stalls_its_producer_serving_others(
    data: str, lane: dict[str, str], heartbeat: tuple[float, float]
) -> None:
    with Cluster() as c:
        p, c1, c2 = c.start(
            ("P", spec("producer", data, lane, heartbeat, record=True)),
            ("C1", spec("consumer", data, lane, heartbeat, record=True)),
            ("C2", spec("consumer", data, lane, heartbeat)),
        )
        frozen, healthy = stream(c, p, c1, "frozen", 0), stream(c, p, c2, "healthy", 100_000)

        def freeze() -> float:  # C1 stops itself right after posting a read from P
            c.reply(c1, ("pause_on_read", c1.pid, p.address, 1), "pause_on_read", timeout=10.0)
            run_until(c, [frozen, healthy], lambda: stopped(c1), "C1 stopping itself")
            return time.monotonic()

        freeze_and_measure(
            c, frozen, healthy, p, c1, freeze, "frozen consumer", (data, lane, heartbeat[1])
        )


def test_a_stopped_producer_never_stalls_its_consumer_loading_from_others(
    data: str, lane: dict[str, str], heartbeat: tuple[float, float]
) -> None:
    with Cluster() as c:
        p1, p2, con = c.start(
            ("P1", spec("producer", data, lane, heartbeat)),
            ("P2", spec("producer", data, lane, heartbeat)),
            ("C", spec("consumer", data, lane, heartbeat, record=True)),
        )
        frozen, healthy = stream(c, p1, con, "frozen", 0), stream(c, p2, con, "healthy", 100_000)

        def freeze() -> float:  # C stops P1 right after posting reads from it
            c.reply(
                con,
                ("pause_on_read", p1.pid, p1.address, WINDOW * MAX_BLOCKS // 2),
                "pause_on_read",
                timeout=10.0,
            )
            run_until(
                c,
                [frozen, healthy],
                lambda: any(e[1] == "paused_source" for e in con.data_log),
                "C stopping P1 after posting reads from it",
            )
            return float(next(e[0] for e in con.data_log if e[1] == "paused_source"))

        freeze_and_measure(
            c, frozen, healthy, con, p1, freeze, "frozen producer", (data, lane, heartbeat[1])
        )
