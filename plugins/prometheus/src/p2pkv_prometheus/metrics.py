"""The metric objects, built once per registry.

Label values are bounded: ``outcome`` is an ``Outcome`` value, ``reason`` keeps only the first
word of a free-text reason, ``kind`` is a timeout kind. No per-request or per-peer labels.
Quantities the vLLM adapter also reports carry the same words in their names
(``bytes_read``, ``in_flight_transfers``, ``parked_stores``, ``sessions``, ...). Both take
their histogram buckets from ``p2pkv.metrics.LATENCY_BUCKETS``. Every metric is listed, with
type, labels and meaning, in docs/observability.md (a test checks it).

The labelled children a pull updates (``jobs``, ``job_seconds``, ``transfers``) are looked
up once per label set and kept: ``labels()`` costs a few microseconds per call, and the
label sets are few. Nothing here removes a child, so a kept one stays the registered one.
"""

from __future__ import annotations

from p2pkv.metrics import LATENCY_BUCKETS
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

__all__ = ["Metrics"]


class Metrics:
    """All p2pkv metrics registered in one ``CollectorRegistry``."""

    def __init__(self, registry: CollectorRegistry = REGISTRY) -> None:
        self.jobs = Counter(
            "p2pkv_jobs",
            "Engine jobs finished, by kind and outcome.",
            ["kind", "outcome"],
            registry=registry,
        )
        self.job_seconds = Histogram(
            "p2pkv_job_duration_seconds",
            "Time from submit to result of an engine job (a store's includes waiting for its "
            "consumer).",
            ["kind"],
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.transfers = Counter(
            "p2pkv_transfers", "Data transfers finished, by result.", ["result"], registry=registry
        )
        self.bytes_read = Counter(
            "p2pkv_bytes_read",
            "Bytes of this tier's reads that completed (peers' blocks read "
            "into our region for loads).",
            registry=registry,
        )
        self.transfer_seconds = Histogram(
            "p2pkv_transfer_duration_seconds",
            "Time from submit to completion of a transfer.",
            buckets=LATENCY_BUCKETS,
            registry=registry,
        )
        self.sessions_opened = Counter(
            "p2pkv_sessions_opened", "Sessions that completed their handshake.", registry=registry
        )
        self.sessions_closed = Counter(
            "p2pkv_sessions_closed",
            "Sessions that ended, by reason.",
            ["reason"],
            registry=registry,
        )
        self.rejections = Counter(
            "p2pkv_handshake_rejections", "Peers refused at handshake.", registry=registry
        )
        self.protocol_errors = Counter(
            "p2pkv_protocol_errors", "Sessions closed for a protocol violation.", registry=registry
        )
        self.timeouts = Counter(
            "p2pkv_timeouts", "Deadlines that fired, by kind.", ["kind"], registry=registry
        )
        self.in_flight = Gauge(
            "p2pkv_in_flight_transfers",
            "Data transfers in flight.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.parked = Gauge(
            "p2pkv_parked_stores",
            "Store jobs waiting for their consumer.",
            registry=registry,
            multiprocess_mode="livesum",
        )
        self.sessions = Gauge(
            "p2pkv_sessions", "Live sessions.", registry=registry, multiprocess_mode="livesum"
        )
        self._job_children: dict[tuple[str, str], tuple[Counter, Histogram]] = {}
        self._transfer_children: dict[bool, Counter] = {}

    def job(self, kind: str, outcome: str) -> tuple[Counter, Histogram]:
        """The ``jobs`` child of (``kind``, ``outcome``) and the ``job_seconds`` child of
        ``kind``, looked up on first use and kept. Driver thread (the observers')."""
        children = self._job_children.get((kind, outcome))
        if children is None:
            children = self._job_children[(kind, outcome)] = (
                self.jobs.labels(kind=kind, outcome=outcome),
                self.job_seconds.labels(kind=kind),
            )
        return children

    def transfer(self, success: bool) -> Counter:
        """The ``transfers`` child of a transfer's result, looked up on first use and kept."""
        child = self._transfer_children.get(success)
        if child is None:
            child = self._transfer_children[success] = self.transfers.labels(
                result="ok" if success else "failed"
            )
        return child
