"""``P2PTier.stats()`` as vLLM offloading metrics (``vllm:kv_offload_p2pkv_*``).

vLLM asks each tier for the observations since its previous ``get_stats`` call and sums
counters itself, so cumulative tier counters are reported as deltas; gauges as snapshots.
Job outcomes become one counter labelled by ``outcome`` (a bounded set: ``p2pkv.Outcome``).

The metric names (``JOBS``, ``PREFIX`` + the keys of ``COUNTERS``/``GAUGES``, which are
``P2PTier.stats()`` keys) import without vLLM, so the docs check can list them; vLLM's
classes load when the definitions or a report are built. Names shared with
``p2pkv-prometheus`` use the same words there (``bytes_sent``, ``in_flight_transfers``, ...).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from p2pkv.types import Outcome

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingMetricMetadata

__all__ = ["COUNTERS", "GAUGES", "JOBS", "PREFIX", "StatsReporter", "metric_definitions"]

PREFIX = "vllm:kv_offload_p2pkv_"
JOBS = f"{PREFIX}jobs"
_JOB_STAT = "jobs_"

COUNTERS: Mapping[str, str] = {
    "blocks_sent": "KV blocks this instance wrote to peers.",
    "bytes_sent": "Bytes this instance wrote to peers.",
    "transfers_failed": "Data transfers to peers that failed.",
    "submit_failures": "Data transfers that could not be submitted.",
    "protocol_errors": "Peer sessions closed for a protocol violation.",
    "handshake_rejections": "Peers refused at handshake (shape, fingerprint, hash seed, version).",
}
GAUGES: Mapping[str, str] = {
    "jobs_pending": "Tier jobs (loads and stores) without a result yet.",
    "sessions": "Peer sessions handshaking or ready (closing ones are sessions_closing).",
    "sessions_ready": "Peer sessions past their handshake.",
    "sessions_closing": "Peer sessions waiting for their transfers to drain.",
    "in_flight_transfers": "Data transfers submitted and not finished.",
    "parked_stores": "Stores waiting for their consumer to ask for them.",
}


def metric_definitions() -> dict[str, OffloadingMetricMetadata]:
    """Every metric the tier reports, by full name (needs vLLM)."""
    from vllm.v1.kv_offload.base import OffloadingCounterMetadata, OffloadingGaugeMetadata

    defs: dict[str, OffloadingMetricMetadata] = {
        JOBS: OffloadingCounterMetadata(
            documentation="P2P tier jobs (loads and stores) finished, by outcome.",
            labelnames=("outcome",),
        )
    }
    for name, doc in COUNTERS.items():
        defs[PREFIX + name] = OffloadingCounterMetadata(documentation=doc)
    for name, doc in GAUGES.items():
        defs[PREFIX + name] = OffloadingGaugeMetadata(documentation=doc)
    return defs


class StatsReporter:
    """Turns successive ``P2PTier.stats()`` snapshots into vLLM stats payloads."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def report(self, stats: Mapping[str, int]) -> Any:
        """An ``OffloadingConnectorStats`` with the changes since the previous call."""
        from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
            OffloadingConnectorStats,
        )

        payload = OffloadingConnectorStats()
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
        return payload

    def _delta(self, name: str, stats: Mapping[str, int]) -> int:
        value = stats.get(name, 0)
        delta = value - self._last.get(name, 0)
        self._last[name] = value
        return delta
