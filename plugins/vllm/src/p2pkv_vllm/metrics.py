"""``P2PTier.stats()`` as vLLM offloading metrics (``vllm:kv_offload_p2pkv_*``).

vLLM asks each tier for the observations since its previous ``get_stats`` call and sums
counters itself, so cumulative tier counters are reported as deltas; gauges as snapshots.
Job outcomes become one counter labelled by ``outcome`` (a bounded set: ``p2pkv.Outcome``).
Job latencies (submit to result, as vLLM sees them) are one histogram labelled by ``kind``
(``load``/``store``) and ``outcome``: the adapter tells the reporter when it submitted a job
(``job_submitted``) and what ``get_finished_jobs`` returned (``jobs_finished``), and each
report carries the durations of the jobs finished since the previous one.

The metric names (``JOBS``, ``JOB_SECONDS``, ``PREFIX`` + the keys of ``COUNTERS``/``GAUGES``,
which are ``P2PTier.stats()`` keys) import without vLLM, so the docs check can list them;
vLLM's classes load when the definitions or a report are built, and :meth:`StatsReporter.fill`
writes into any :class:`StatsPayload` (tests use it without vLLM). Names shared with
``p2pkv-prometheus`` use the same words there (``bytes_sent``, ``in_flight_transfers``,
``job_duration_seconds``, ...). Both take their buckets from ``p2pkv.metrics.LATENCY_BUCKETS``.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from p2pkv.metrics import LATENCY_BUCKETS
from p2pkv.types import JobResult, Outcome

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

__all__ = [
    "COUNTERS",
    "GAUGES",
    "JOBS",
    "JOB_SECONDS",
    "MAX_UNREPORTED_DURATIONS",
    "PREFIX",
    "StatsPayload",
    "StatsReporter",
    "metric_definitions",
]

PREFIX = "vllm:kv_offload_p2pkv_"
JOBS = f"{PREFIX}jobs"
JOB_SECONDS = f"{PREFIX}job_duration_seconds"
MAX_UNREPORTED_DURATIONS = 10_000
"""Job durations kept for the next report; when vLLM does not ask for stats, older ones go."""
_JOB_STAT = "jobs_"

COUNTERS: Mapping[str, str] = {
    "blocks_sent": "KV blocks of this instance that consumers read and released.",
    "bytes_sent": "Bytes of this instance that consumers read and released.",
    "blocks_read": "KV blocks this instance read from producers (loads).",
    "bytes_read": "Bytes this instance read from producers (loads).",
    "transfers_failed": "Reads from producers that failed.",
    "submit_failures": "Reads that could not be submitted.",
    "protocol_errors": "Peer sessions closed for a protocol violation.",
    "handshake_rejections": "Peers refused at handshake (shape, fingerprint, hash seed, version).",
    "data_calls_over_bound": "Data transport calls that kept the tier's thread past the "
    "driver bound (0.1 s).",
    "slow_ticks": "Tick gaps longer than the control transport's silence timeout while the "
    "process ran (slow ticks, not pauses).",
    "peers_refused": "Dials refused: outside peers.allow, or beyond a cap of working sessions.",
    "peers_evicted": "Dials that made no progress for 1 s, closed for a new one.",
    "peers_gave_way": "Idle sessions closed to make room for a new peer with a request.",
    "peers_over_cap": "PD requests dialed beyond peers.max_dialed.",
    "peers_backed_off": "Dials refused at once: the address's last dial failed.",
    "peers_reaped": "Dialed sessions closed after peers.idle_timeout idle.",
    "peers_waited": "Peers that had to wait for a dial.",
    "peers_wait_failed": "Waiting peers that left undialed (their loads failed).",
    "peers_suspected": "Hosts made suspect by a lost peer.",
    "peers_probed": "Quiet sessions to a suspect host's ranks probed.",
    "peers_accepted": "Sessions peers opened with this instance (they dialed it).",
    "peers_accepted_gave_way": "Idle sessions peers dialed to this instance, closed to keep "
    "room for new peers in the control transport.",
    "peers_accept_refused": "Peers' connections the control transport refused for lack of "
    "room (sockets, descriptors).",
}
GAUGES: Mapping[str, str] = {
    "jobs_pending": "Tier jobs (loads and stores) without a result yet.",
    "sessions": "Peer sessions handshaking or ready.",
    "sessions_ready": "Peer sessions past their handshake.",
    "sessions_closing": "Closed peer sessions whose offered blocks stay pinned until the "
    "consumer's lease ends.",
    "in_flight_transfers": "Reads from producers submitted and not finished.",
    "parked_stores": "Stores waiting for their consumer to ask for them.",
    "data_held": "What the data transport still holds for removed peers (sends, endpoints, "
    "cancelled reads, staging blocks).",
    "peers_warm": "Members of the warm set (at most peers.warm).",
    "peers_warm_ready": "Members of the warm set with a ready session.",
    "peers_dialing": "Dials of this tier that heard nothing from their peer yet.",
    "peers_waiting": "Peers whose requests wait for a free dial.",
    "sessions_free": "Sessions the control transport can still open before it refuses "
    "peers (reported by transports with a bound, such as zmq's socket cap).",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric the tier reports, by full name (needs vLLM)."""
    from vllm.v1.kv_offload.base import (
        OffloadingCounterMetadata,
        OffloadingGaugeMetadata,
        OffloadingHistogramMetadata,
    )

    defs: dict[str, OffloadingMetricMetadata] = {
        JOBS: OffloadingCounterMetadata(
            documentation="P2P tier jobs (loads and stores) finished, by outcome.",
            labelnames=("outcome",),
        ),
        JOB_SECONDS: OffloadingHistogramMetadata(
            documentation="Submit to result of a P2P tier job, by kind and outcome (a "
            "store's includes waiting for its consumer).",
            labelnames=("kind", "outcome"),
            buckets=LATENCY_BUCKETS,
        ),
    }
    for name, doc in COUNTERS.items():
        defs[PREFIX + name] = OffloadingCounterMetadata(documentation=doc)
    for name, doc in GAUGES.items():
        defs[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc)
    return defs


class StatsPayload(Protocol):
    """What a report is written into: vLLM's ``OffloadingConnectorStats`` has these."""

    def increase_counter(
        self,
        counter_name: str,
        counter_increase_value: int | float = 1,
        labelvalues: tuple[str, ...] = (),
    ) -> None: ...

    def set_gauge(
        self, gauge_name: str, gauge_value: int | float, labelvalues: tuple[str, ...] = ()
    ) -> None: ...

    def observe_histogram(
        self,
        histogram_name: str,
        histogram_value: int | float,
        labelvalues: tuple[str, ...] = (),
    ) -> None: ...


class StatsReporter:
    """Turns successive ``P2PTier.stats()`` snapshots and job timings into vLLM stats payloads.

    ``clock`` (seconds, monotonic) times the jobs; tests pass their own."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._last: dict[str, int] = {}
        self._clock = clock
        self._started: dict[int, tuple[str, float]] = {}
        """Job id -> (kind, submit time) of jobs without a result yet."""
        self._durations: deque[tuple[str, str, float]] = deque(maxlen=MAX_UNREPORTED_DURATIONS)
        """(kind, outcome, seconds) of jobs finished since the previous report."""

    def job_submitted(self, job_id: int, *, is_load: bool) -> None:
        """Start timing job ``job_id``: call it once ``P2PTier.submit_load``/``submit_store``
        accepted the job (one that raised gets no result, so it is never timed)."""
        self._started[job_id] = ("load" if is_load else "store", self._clock())

    def jobs_finished(self, results: Iterable[JobResult]) -> None:
        """Stop timing the jobs of ``results`` (what ``P2PTier.get_finished_jobs`` returned);
        the next report observes their durations. Jobs never submitted here are skipped."""
        now = self._clock()
        for result in results:
            started = self._started.pop(result.job_id, None)
            if started is not None:
                kind, at = started
                self._durations.append((kind, result.outcome.value, now - at))

    def report(self, stats: Mapping[str, int]) -> Any:
        """An ``OffloadingConnectorStats`` with the changes since the previous call."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        payload = OffloadingConnectorStats()
        self.fill(payload, stats)
        return payload

    def fill(self, payload: StatsPayload, stats: Mapping[str, int]) -> None:
        """Write into ``payload`` the changes since the previous call: counter deltas (zero
        ones left out), gauge snapshots, and one observation per job finished since."""
        for outcome in Outcome:
            delta = self._delta(_JOB_STAT + outcome.value, stats)
            if delta:
                payload.increase_counter(JOBS, delta, (outcome.value,))
        for name in COUNTERS:
            delta = self._delta(name, stats)
            if delta:
                payload.increase_counter(PREFIX + name, delta)
        for name in GAUGES:
            if name in stats:
                payload.set_gauge(PREFIX + name, stats[name])
        while self._durations:
            kind, outcome_value, seconds = self._durations.popleft()
            payload.observe_histogram(JOB_SECONDS, seconds, (kind, outcome_value))

    def _delta(self, name: str, stats: Mapping[str, int]) -> int:
        value = stats.get(name, 0)
        delta = value - self._last.get(name, 0)
        self._last[name] = value
        return delta
