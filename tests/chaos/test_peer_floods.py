"""Floods of client-named peers (issue 48, item 5) with real traffic running.

A consumer tier serves a steady stream of PD requests from a producer (each its own process,
zmq control, data through ``/dev/shm``, :mod:`fleet_host`), while requests naming 10,000
distinct bogus peers arrive at the consumer (default peer policy, no allow-list): first
addresses that refuse (a port bound without listening, on every loopback address), then
black-holed ones (a listening port whose backlog is full, so dials get no answer). In the
middle of each flood a producer never contacted before gets its first requests.

Asserted: the real traffic stays byte-exact with no failure; the new producer's first
requests are served; no bogus load waits for its load deadline. Reported (measurements, not
asserted): the real traffic's requests per second before and during each flood, and how the
bogus loads ended. ``fleet-zmq``'s simulator measures the throughput goal.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator

import pytest
from chaos_cluster import measured
from fleet_cluster import Fleet, TierRef
from fleet_host import Flood, HostSpec
from zmq_fixtures import refusing_port

FLOOD = int(os.environ.get("P2PKV_FLOOD_PEERS", "10000"))
"""Bogus peers named in each flood (``P2PKV_FLOOD_PEERS``)."""
WINDOW = 4
"""Real requests in flight at once."""
BASELINE = 5.0
"""Seconds of real traffic measured before the floods."""
FIRST = 4
"""First requests to the never-contacted producer, mid-flood."""
T = 300.0
CONFIG = {"control": "zmq", "data": "memory", "timeouts": {"shutdown_drain": 2.0}}


@pytest.fixture
def refusing() -> Iterator[int]:
    """A port that refuses on every loopback address (bound, not listening)."""
    with refusing_port() as port:
        yield port


@pytest.fixture
def black_hole() -> Iterator[int]:
    """A port on every loopback address that accepts TCP and never speaks (its backlog soon
    full, later dials get no answer at all)."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        sock.listen(1)
        yield sock.getsockname()[1]


class Traffic:
    """PD requests from ``producer`` to ``consumer``, ``WINDOW`` in flight, each finished on
    both sides once its load ended."""

    def __init__(self, fleet: Fleet, consumer: TierRef) -> None:
        self.fleet = fleet
        self.consumer = consumer
        self.next = 0
        self.open: dict[int, TierRef] = {}
        self.done = 0

    def request(self, producer: TierRef) -> int:
        self.next += 1
        job, kv = self.next, f"real-{self.next}"
        keys = [f"{kv}/{b}".encode() for b in range(4)]
        slots = [4 * (job % 12) + b for b in range(4)]  # free again 12 requests later
        self.fleet.load(self.consumer, job, kv, self.fleet.addresses[producer], keys, slots)
        self.fleet.store(producer, 1_000_000 + job, kv, keys, slots)
        self.open[job] = producer
        return job

    def step(self, producer: TierRef) -> None:
        """Route messages; finish ended requests; top the window up."""
        self.fleet.pump(0.005)
        got = self.fleet.results[self.consumer]
        for job in [j for j in self.open if j in got]:
            result = got[job]
            assert result.outcome == "done" and not result.bad_blocks, result
            source = self.open.pop(job)
            self.fleet.finish(self.consumer, f"real-{job}", self.fleet.addresses[source])
            self.fleet.finish(source, f"real-{job}", None)
            self.done += 1
        while len(self.open) < WINDOW:
            self.request(producer)

    def rate(self, producer: TierRef, seconds: float) -> float:
        """Requests per second over ``seconds`` of traffic."""
        before, began = self.done, time.monotonic()
        while time.monotonic() - began < seconds:
            self.step(producer)
        return (self.done - before) / (time.monotonic() - began)


def test_floods_of_refusing_and_black_holed_peers_reach_no_real_traffic(
    refusing: int,
    black_hole: int,
) -> None:
    specs = [HostSpec(1, CONFIG) for _ in range(2 + 2)]  # consumer, producer, two new ones
    with Fleet(specs, name="flood") as fleet:
        consumer, producer = (0, 0), (1, 0)
        fleet.start()
        traffic = Traffic(fleet, consumer)
        unloaded = traffic.rate(producer, BASELINE)
        lines = [
            f"floods of {FLOOD} client-named peers: real traffic {unloaded:.0f} req/s unloaded"
        ]
        for kind, port, fresh in (
            ("refusing", refusing, (2, 0)),
            ("black-holed", black_hole, (3, 0)),
        ):
            lines.append(flood(fleet, traffic, kind, port, fresh, unloaded))
        measured("; ".join(lines))


def flood(
    fleet: Fleet, traffic: Traffic, kind: str, port: int, fresh: TierRef, unloaded: float
) -> str:
    """One flood with traffic running and a new producer's first requests in its middle."""
    consumer, producer = traffic.consumer, (1, 0)
    fleet.flood(consumer, Flood(port, FLOOD))
    began, before = time.monotonic(), traffic.done
    first: list[int] = []
    while consumer not in fleet.floods:
        traffic.step(producer)
        assert time.monotonic() - began < T, f"the {kind} flood did not end in {T}s"
        if not first and time.monotonic() - began > 1.0:
            first = [traffic.request(fresh) for _ in range(FIRST)]
    seconds = time.monotonic() - began
    rate = (traffic.done - before) / seconds
    fleet.wait(lambda: not traffic.open or not traffic.step(producer), T, "the requests in flight")
    got = fleet.results[consumer]
    assert first and all(got[j].outcome == "done" for j in first), [got.get(j) for j in first]
    outcomes = fleet.floods.pop(consumer)
    assert not {"done", "load_timeout"} & set(outcomes), outcomes
    return (
        f"{kind}: {FLOOD} names in {seconds:.1f}s, real traffic {rate:.0f} req/s "
        f"({rate / unloaded:.2f}x), the new producer's first {FIRST} requests served, "
        f"bogus loads {outcomes}"
    )
