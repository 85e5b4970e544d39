"""A DP pod as a failure domain (issue 48, item 4): an 8-rank producer dies, or pauses, as a
unit while a consumer has loads open on several of its ranks.

The producer pod is eight processes, one tier (one rank port) each, all on the pod's address
``127.0.2.1``; a bystander pod on ``127.0.3.1``; the consumer on ``127.0.4.1`` (zmq control,
short heartbeats; data through ``/dev/shm``, :mod:`fleet_host`). The consumer first has a
ready session with every rank and the bystander, then opens loads on four ranks whose stores
never come. Then:

- **killed** (SIGKILL, every rank): every open load fails ``peer_dead`` within the
  heartbeat bound; a new load routed to any rank fails ``peer_dead`` at once, whichever rank
  it names, saying the dial was refused or is backed off, never by a deadline;
- **paused** (SIGSTOP, every rank): every open load fails ``peer_dead`` within the heartbeat
  bound; the quiet ranks are probed when the first one is lost, and a new load routed to any
  rank fails ``peer_dead`` by the probe's short deadline or its backoff, never the full
  handshake timeout; after SIGCONT every rank is served again.

The bystander's requests succeed throughout. Timings are reported (chaos measurements); the
death bound is three times the heartbeat timeout, as in the rest of the chaos suite.
"""

from __future__ import annotations

import time

import pytest
from chaos_cluster import measured
from fleet_cluster import Fleet, Result, TierRef
from fleet_host import HostSpec

RANKS = 8
OPEN_ON = (0, 2, 5, 7)
"""Ranks with a load open when the pod goes."""
HEARTBEAT_TIMEOUT = 2.0
DEATH_BOUND = 3 * HEARTBEAT_TIMEOUT
HANDSHAKE = 10.0
T = 120.0
CONFIG = {
    "control": "zmq",
    "data": "memory",
    "control_options": {
        "heartbeat_interval": 0.4,
        "heartbeat_timeout": HEARTBEAT_TIMEOUT,
        "heartbeat_ttl": HEARTBEAT_TIMEOUT,
        "connect_timeout": HANDSHAKE,
    },
    "timeouts": {"shutdown_drain": 2.0, "handshake": HANDSHAKE, "load": 60.0},
}
POD, BYSTANDER, CONSUMER = "127.0.2.1", "127.0.3.1", "127.0.4.1"


class Pod:
    """The fleet: hosts 0..7 are the pod's ranks, 8 the bystander, 9 the consumer."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.ranks: list[TierRef] = [(r, 0) for r in range(RANKS)]
        self.bystander: TierRef = (RANKS, 0)
        self.consumer: TierRef = (RANKS + 1, 0)
        self.jobs = 0

    def address(self, ref: TierRef) -> str:
        return self.fleet.addresses[ref]

    def load(self, producer: TierRef, *, store: bool = True) -> int:
        """A PD load of the consumer from ``producer`` (its store too, unless not)."""
        self.jobs += 1
        job, kv = self.jobs, f"req-{self.jobs}"
        keys = [f"{kv}/0".encode()]
        self.fleet.load(self.consumer, job, kv, self.address(producer), keys, [job % 60])
        if store:
            self.fleet.store(producer, 1_000_000 + job, kv, keys, [1])
        return job

    def result(self, job: int) -> Result:
        self.fleet.wait(lambda: job in self.fleet.results[self.consumer], T, f"load {job}")
        return self.fleet.results[self.consumer][job]

    def request(self, producer: TierRef) -> Result:
        """A whole PD request from ``producer``, finished on both sides; the load's result."""
        job = self.load(producer)
        result = self.result(job)
        self.fleet.finish(self.consumer, f"req-{job}", self.address(producer))
        self.fleet.finish(producer, f"req-{job}", None)
        return result


def specs() -> list[HostSpec]:
    return [
        *(HostSpec(1, CONFIG, host=POD) for _ in range(RANKS)),
        HostSpec(1, CONFIG, host=BYSTANDER),
        HostSpec(1, CONFIG, host=CONSUMER),
    ]


@pytest.mark.parametrize("how", ["killed", "paused"])
def test_an_8_rank_pod_going_as_a_unit_fails_loads_on_every_rank_fast(how: str) -> None:
    with Fleet(specs(), name=f"dp-{how}") as fleet:
        pod = Pod(fleet)
        fleet.start()
        for producer in [*pod.ranks, pod.bystander]:  # a ready, quiet session with each
            result = pod.request(producer)
            assert result.outcome == "done" and not result.bad_blocks, result
        open_loads = [pod.load(pod.ranks[r], store=False) for r in OPEN_ON]
        went = time.monotonic()
        for r in range(RANKS):
            fleet.kill(r) if how == "killed" else fleet.pause(r)
        ended = [pod.result(job) for job in open_loads]
        assert all(r.outcome == "peer_dead" for r in ended), ended
        ended_in = max(r.at for r in ended) - went
        assert ended_in <= DEATH_BOUND, f"open loads ended {ended_in:.1f}s after the pod went"
        fresh = [(r, pod.load(pod.ranks[r], store=False)) for r in range(RANKS)]
        started = time.monotonic()
        failed = [pod.result(job) for _, job in fresh]
        assert all(r.outcome == "peer_dead" for r in failed), failed
        slowest = max(r.at for r in failed) - started
        assert all(fast_failure(r.detail) for r in failed), [r.detail for r in failed]
        served = pod.request(pod.bystander)
        assert served.outcome == "done" and not served.bad_blocks, served
        resumed = serve_again(pod, how)
        stats = fleet.stats()[pod.consumer]
        measured(
            f"DP8 pod {how}: {len(open_loads)} open loads failed peer_dead within "
            f"{ended_in:.2f}s (heartbeat timeout {HEARTBEAT_TIMEOUT}s); new loads to "
            f"each of its {RANKS} ranks failed peer_dead within {slowest:.2f}s "
            f"(handshake timeout {HANDSHAKE}s; {stats['peers_probed']} quiet ranks "
            f"probed){resumed}"
        )


def fast_failure(detail: str) -> bool:
    """A load that failed by what the dial learnt, not by waiting out the full handshake."""
    return (
        "refused" in detail
        or "peers.dial_backoff" in detail
        or f"within {HANDSHAKE * 0.2:g}s" in detail
        or "lost" in detail
    )


def serve_again(pod: Pod, how: str) -> str:
    """A paused pod resumes: every rank is served again (within ``T``). Nothing for a killed
    one."""
    if how == "killed":
        return ""
    resumed = time.monotonic()
    for r in range(RANKS):
        pod.fleet.resume(r)
    for r in range(RANKS):
        deadline = time.monotonic() + T
        while True:
            result = pod.request(pod.ranks[r])
            if result.outcome == "done":
                assert not result.bad_blocks, result
                break
            assert time.monotonic() < deadline, f"rank {r} not served again: {result}"
            pod.fleet.pump(0.5)  # backed off: a later load dials it again
    return f"; after SIGCONT every rank was served again within {time.monotonic() - resumed:.1f}s"
