"""A flood name costs the engine thread less than an established request (issue 48, item 5).

A consumer tier (memory transports, fake clock) has a ready session to a producer and a
full dial queue: 64 dials that heard nothing and 256 silent peers waiting. Then each engine
request makes the three calls vLLM makes: ``on_new_request``, ``lookup`` and
``submit_load`` (one block). The work is counted as Python calls (``sys.setprofile``: calls
of Python and of C functions), never timed.

A flood name's request names a new silent peer: it waits, and an older waiting peer leaves
with its load failed. An established request names the producer: its session takes it. A
flood name, that drop included, makes at most :data:`SHARE` times an established request's
calls. Measured at main ``1f1b943``: 184 and 161 (1.14); now 155 and 148 (1.05). Both
counts include the test's own work of building each request.

A waiting name that leaves is freed at once, by its reference count: its records form no
reference cycle, so a flood leaves nothing for the garbage collector. At ``floods3`` a
load's record named its peer's record, which named the load back: every dropped name
waited for a collection, and about 200 of them ran per 10,000 names in the bench.

So is a dial's session that was evicted for a newer one, or failed in its handshake: its
roles' references to it are cut as it closes. Until ``floods6`` each such session left
about 30 objects (session, roles, bound methods) in cycles for the collector.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from p2pkv.session.session import Session
from p2pkv.testing.harness import Cluster, Node, advance, config, pump, pump_until
from p2pkv.tiering.dial_queue import QueuedLoad, Waiting
from p2pkv.types import LookupResult, RequestContext
from test_flood_tick_cost import DIALS
from test_idle_cost import calls

SHARE = 1.1
"""A flood name's calls, at most this many times an established request's."""
REQUESTS = 50
"""Requests of each kind counted."""


def pd_request(i: int, host: str, port: int) -> RequestContext:
    """A PD request ``i`` naming the producer at ``host:port``."""
    route = {"kv_request_id": f"r-{i}", "remote_host": host, "remote_port": port}
    return RequestContext(f"r-{i}", {"remote_prefiller": route})


def silent_host(i: int) -> str:
    """A distinct address for each ``i`` >= 1, where nothing answers."""
    return f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256 or 1}"


def engine_request(node: Node, ctx: RequestContext, job_id: int) -> None:
    """vLLM's calls for a new request with a one-block load; the lookup hits (PD)."""
    tier = node.tier
    tier.on_new_request(ctx)
    key = f"k{job_id}".encode()
    assert tier.lookup(key, ctx) is LookupResult.HIT
    node.load(job_id, [key], [job_id % 60], ctx)


def test_a_flood_name_costs_less_than_an_established_request(cluster: Cluster) -> None:
    producer = cluster()
    node = cluster(control_options={"connect_timeout": 3600})
    node.tier.connect(producer.address)
    pump_until([node, producer], lambda: node.tier.stats()["sessions_ready"] == 1)
    job_id = 0

    def flood(names: int) -> None:
        nonlocal job_id
        for _ in range(names):
            job_id += 1
            engine_request(node, pd_request(job_id, silent_host(job_id), 9), job_id)

    def established() -> None:
        nonlocal job_id
        for _ in range(REQUESTS):
            job_id += 1
            engine_request(node, pd_request(job_id, producer.host, producer.port), job_id)

    flood(DIALS + 4 * DIALS + 10)  # every dial is taken, the queue is full
    stats = node.tier.stats()
    assert (stats["peers_dialing"], stats["peers_waiting"]) == (DIALS, 4 * DIALS), stats
    name = calls(lambda: flood(REQUESTS)) / REQUESTS
    request = calls(established) / REQUESTS
    assert node.tier.stats()["peers_waiting"] == 4 * DIALS
    assert name <= SHARE * request, (name, request)


@contextmanager
def collector_off() -> Iterator[Callable[[type], int]]:
    """The collector off (restored after); yields a count of the live objects of a class."""
    enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield lambda cls: sum(isinstance(o, cls) for o in gc.get_objects())
    finally:
        if enabled:
            gc.enable()


def test_a_name_that_leaves_the_queue_is_freed_without_the_collector(cluster: Cluster) -> None:
    node = cluster(control_options={"connect_timeout": 3600})
    names = DIALS + 4 * DIALS + 10
    with collector_off() as live:
        for job_id in range(1, names + REQUESTS + 1):
            engine_request(node, pd_request(job_id, silent_host(job_id), 9), job_id)
        records, loads = live(Waiting), live(QueuedLoad)
    sizes = node.tier.state_sizes()
    assert sizes["dial_queue"] == 4 * DIALS
    assert (records, loads) == (sizes["dial_queue"], sizes["dial_queue_loads"])


def test_evicted_dials_are_freed_without_the_collector(cluster: Cluster) -> None:
    """Dials that heard nothing are evicted by newer names: every evicted session is freed
    by its reference count, and the collector then finds none of them."""
    node = cluster(control_options={"connect_timeout": 3600})
    with collector_off() as live:
        for job_id in range(1, DIALS + 1):
            engine_request(node, pd_request(job_id, silent_host(job_id), 9), job_id)
        advance(cluster.clock, [node], 2.0)
        for job_id in range(DIALS + 1, 2 * DIALS + 1):
            engine_request(node, pd_request(job_id, silent_host(job_id), 9), job_id)
            pump([node], 1)
        stats = node.tier.stats()
        assert stats["peers_evicted"] >= DIALS // 2, stats
        assert live(Session) == stats["sessions"] == DIALS
        assert gc.collect() == 0


def test_failed_dials_are_freed_without_the_collector(cluster: Cluster) -> None:
    """Dials whose handshake deadline passed close with their loads failed: none of their
    sessions is left for the collector."""
    node = cluster(control_options={"connect_timeout": 3600})
    with collector_off() as live:
        for job_id in range(1, DIALS + 1):
            engine_request(node, pd_request(job_id, silent_host(job_id), 9), job_id)
        assert live(Session) == DIALS
        advance(cluster.clock, [node], config().timeouts.handshake + 1)
        assert node.tier.stats()["sessions"] == 0
        assert live(Session) == 0
        assert gc.collect() == 0
