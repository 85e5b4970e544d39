"""A startup storm (issue 48, item 3): 64 tiers start at once, each with ``peers.connect``
naming all 64, and requests flow between them while they warm up.

Eight host processes run eight tiers each (zmq control, data through ``/dev/shm``,
:mod:`fleet_host`). The hosts bind first; then every tier is built within the same moment,
each keeping a warm set of ``peers.warm`` (32) of the others: dials spread by jitter, at most
``peers.max_handshakes`` of a tier's own in their handshake at once. Right after the start
every tier loads a request from another one (consumer first, then the producer's store).
Asserted: every request succeeds with exact bytes, and every tier reaches a full warm set.
Measured (reported, not asserted): the time from the start to a fully warm fleet, and the
fleet's sessions.
"""

from __future__ import annotations

import time

from chaos_cluster import measured
from fleet_cluster import Fleet
from fleet_host import HostSpec

HOSTS, PER_HOST = 8, 8
TIERS = HOSTS * PER_HOST
WARM = 32
BLOCKS = 4
T = 300.0
CONFIG = {"control": "zmq", "data": "memory", "timeouts": {"shutdown_drain": 2.0}}


def test_64_tiers_started_at_once_warm_up_and_fail_no_request() -> None:
    specs = [HostSpec(PER_HOST, CONFIG) for _ in range(HOSTS)]
    with Fleet(specs, name="storm") as fleet:
        refs = fleet.refs()
        everyone = [fleet.addresses[r] for r in refs]
        started = fleet.start(lambda ref: {"peers": {"connect": everyone}})
        pairs = [(refs[i], refs[(i + 9) % TIERS]) for i in range(TIERS)]  # consumer, producer
        for n, (consumer, producer) in enumerate(pairs):
            kv = f"storm-{n}"
            keys = [f"{kv}/{b}".encode() for b in range(BLOCKS)]
            fleet.load(consumer, n, kv, fleet.addresses[producer], keys, [8, 9, 10, 11])
            fleet.store(producer, 100_000 + n, kv, keys, [0, 1, 2, 3])

        def done() -> bool:
            return all(
                n in fleet.results[c] and 100_000 + n in fleet.results[p]
                for n, (c, p) in enumerate(pairs)
            )

        fleet.wait(done, T, "every request of the storm")
        served = time.monotonic() - started
        failed = [
            (ref, r)
            for ref, got in fleet.results.items()
            for r in got.values()
            if r.outcome != "done" or r.bad_blocks
        ]
        assert not failed, failed[:5]
        for n, (c, p) in enumerate(pairs):
            fleet.finish(c, f"storm-{n}", fleet.addresses[p])
            fleet.finish(p, f"storm-{n}", None)
        warm_at = wait_warm(fleet, started)
        stats = fleet.stats()
        sessions = sum(s["sessions"] for s in stats.values())
        measured(
            f"storm: {TIERS} tiers (in {HOSTS} processes) started at once with "
            f"peers.connect naming all {TIERS}: every request served in {served:.1f}s, "
            f"fully warm ({WARM} warm peers each) {warm_at:.1f}s after the start; "
            f"{sessions} session ends in the fleet (a full mesh: "
            f"{TIERS * (TIERS - 1)})"
        )


def wait_warm(fleet: Fleet, started: float) -> float:
    """Poll until every tier has a full warm set; seconds from ``started``."""
    deadline = time.monotonic() + T
    while True:
        stats = fleet.stats()
        if all(s["peers_warm_ready"] >= WARM for s in stats.values()):
            return time.monotonic() - started
        cold = {
            ref: s["peers_warm_ready"] for ref, s in stats.items() if s["peers_warm_ready"] < WARM
        }
        assert time.monotonic() < deadline, f"not warm after {T}s: {cold}"
        fleet.pump(0.5)
