"""The vLLM adapter's stats reporter without vLLM: counter deltas, gauge snapshots and the
job latency histogram, written into a recording payload through ``StatsReporter.fill``.

``fill`` is what ``report`` runs on vLLM's ``OffloadingConnectorStats``; the recording payload
has the same three methods. Time is a test clock, so the durations are exact.
"""

from __future__ import annotations

from typing import Any

import pytest
from p2pkv.metrics import LATENCY_BUCKETS
from p2pkv.types import JobResult, Outcome

metrics = pytest.importorskip("p2pkv_vllm.metrics")


class Recorded:
    """A ``StatsPayload`` that keeps every call."""

    def __init__(self) -> None:
        self.counters: list[tuple[str, float, tuple[str, ...]]] = []
        self.gauges: dict[str, float] = {}
        self.observed: list[tuple[str, float, tuple[str, ...]]] = []

    def increase_counter(
        self,
        counter_name: str,
        counter_increase_value: float = 1,
        labelvalues: tuple[str, ...] = (),
    ) -> None:
        self.counters.append((counter_name, counter_increase_value, labelvalues))

    def set_gauge(
        self, gauge_name: str, gauge_value: float, labelvalues: tuple[str, ...] = ()
    ) -> None:
        self.gauges[gauge_name] = gauge_value

    def observe_histogram(
        self, histogram_name: str, histogram_value: float, labelvalues: tuple[str, ...] = ()
    ) -> None:
        self.observed.append((histogram_name, histogram_value, labelvalues))


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _fill(reporter: Any, stats: dict[str, int] | None = None) -> Recorded:
    payload = Recorded()
    reporter.fill(payload, stats or {})
    return payload


def test_each_finished_job_is_observed_once_by_kind_and_outcome() -> None:
    clock = Clock()
    reporter = metrics.StatsReporter(clock=clock)
    reporter.job_submitted(1, is_load=True)
    reporter.job_submitted(2, is_load=False)
    clock.now += 0.25
    reporter.jobs_finished([JobResult(1, Outcome.DONE)])
    assert _fill(reporter).observed == [(metrics.JOB_SECONDS, 0.25, ("load", "done"))]
    assert _fill(reporter).observed == []  # reported once
    clock.now += 1.75
    reporter.jobs_finished([JobResult(2, Outcome.STORE_TIMEOUT), JobResult(99, Outcome.DONE)])
    assert _fill(reporter).observed == [
        (metrics.JOB_SECONDS, 2.0, ("store", "store_timeout")),  # job 99 was never submitted
    ]


def test_counters_are_deltas_and_gauges_snapshots_next_to_the_histogram() -> None:
    reporter = metrics.StatsReporter(clock=Clock())
    reporter.job_submitted(7, is_load=True)
    reporter.jobs_finished([JobResult(7, Outcome.LOAD_TIMEOUT)])
    first = _fill(reporter, {"jobs_load_timeout": 1, "bytes_sent": 4096, "sessions": 2})
    assert first.counters == [
        (metrics.JOBS, 1, ("load_timeout",)),
        (metrics.PREFIX + "bytes_sent", 4096, ()),
    ]
    assert first.gauges == {metrics.PREFIX + "sessions": 2}
    assert [labels for _, _, labels in first.observed] == [("load", "load_timeout")]
    second = _fill(reporter, {"jobs_load_timeout": 1, "bytes_sent": 6144, "sessions": 1})
    assert second.counters == [(metrics.PREFIX + "bytes_sent", 2048, ())]
    assert second.gauges == {metrics.PREFIX + "sessions": 1}
    assert second.observed == []


def test_unreported_durations_are_bounded() -> None:
    clock = Clock()
    reporter = metrics.StatsReporter(clock=clock)
    total = metrics.MAX_UNREPORTED_DURATIONS + 5
    for job_id in range(total):
        reporter.job_submitted(job_id, is_load=True)
    clock.now += 1.0
    reporter.jobs_finished(JobResult(job_id, Outcome.DONE) for job_id in range(total))
    assert len(_fill(reporter).observed) == metrics.MAX_UNREPORTED_DURATIONS


def test_buckets_match_the_prometheus_plugin() -> None:
    """Both families bucket job durations alike, so their histograms compare."""
    prometheus = pytest.importorskip("p2pkv_prometheus.metrics")
    registry = pytest.importorskip("prometheus_client").CollectorRegistry()
    prometheus.Metrics(registry).job_seconds.labels(kind="load")
    bounds = [
        float(s.labels["le"])
        for family in registry.collect()
        for s in family.samples
        if s.name == "p2pkv_job_duration_seconds_bucket"
    ]
    assert tuple(bounds) == (*LATENCY_BUCKETS, float("inf"))


def test_the_isolation_stats_are_exported() -> None:
    """``slow_ticks`` and ``data_calls_over_bound`` as counters, ``data_held`` as a gauge
    (docs/observability.md, "Isolation")."""
    reporter = metrics.StatsReporter(clock=Clock())
    stats = {"slow_ticks": 1, "data_calls_over_bound": 3, "data_held": 12}
    filled = _fill(reporter, stats)
    assert sorted(filled.counters) == [
        (metrics.PREFIX + "data_calls_over_bound", 3, ()),
        (metrics.PREFIX + "slow_ticks", 1, ()),
    ]
    assert filled.gauges == {metrics.PREFIX + "data_held": 12}


def test_every_peer_policy_stat_reaches_metrics() -> None:
    """A fleet's operator reads ``/metrics``, not ``P2PTier.stats()``: each ``peers_*`` key
    of a real tier's stats is a counter or a gauge, as docs/observability.md says."""
    from p2pkv import TierConfig
    from p2pkv.tier import P2PTier

    config = TierConfig.from_dict(
        {"control": "zmq", "data": "memory", "host": "127.0.0.1", "port": 0}
    )
    tier = P2PTier(config, memoryview(bytearray(8192)), 4096)
    try:
        stats = tier.stats()
    finally:
        tier.shutdown()
    peers = {key for key in stats if key.startswith("peers_")}
    gauges = {"peers_warm", "peers_warm_ready", "peers_dialing", "peers_waiting"}
    assert gauges <= peers
    assert peers - gauges == {key for key in metrics.COUNTERS if key.startswith("peers_")}
    assert gauges == {key for key in metrics.GAUGES if key.startswith("peers_")}
    filled = _fill(metrics.StatsReporter(clock=Clock()), {**stats, "peers_refused": 2})
    assert (metrics.PREFIX + "peers_refused", 2, ()) in filled.counters
    assert filled.gauges[metrics.PREFIX + "peers_warm"] == 0
