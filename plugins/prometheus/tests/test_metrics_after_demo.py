"""After a real two-process demo run, the scraped metrics match what moved.

The demo's producer and consumer run in their own processes with the plugin loaded through
its entry point; ``PROMETHEUS_MULTIPROC_DIR`` makes them write their samples where this test
aggregates them with ``MultiProcessCollector`` (the multi-process deployment mode). Both have
exited when the test collects: their counters and histograms count, their gauges are gone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.multiprocess import MultiProcessCollector  # noqa: E402

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
"""Scraped values by (name, sorted labels)."""


def _samples(directory: Path) -> Samples:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    out: Samples = {}
    for family in registry.collect():
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _total(samples: Samples, name: str, **labels: str) -> float:
    return sum(
        v
        for (n, lab), v in samples.items()
        if n == name and all(dict(lab).get(k) == want for k, want in labels.items())
    )


def test_metrics_match_a_demo_run(tmp_path: Path) -> None:
    metrics_dir = tmp_path / "metrics"
    metrics_dir.mkdir()
    summary_path = tmp_path / "demo.json"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(metrics_dir), "UCX_NET_DEVICES": "lo"}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "p2pkv.cli",
            "demo",
            "--requests",
            "8",
            "--preset",
            "tiny",
            "--quiet",
            "--json",
            str(summary_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads(summary_path.read_text())
    stats = summary["tier_stats"]
    samples = _samples(metrics_dir)

    assert _total(samples, "p2pkv_bytes_read_total") == summary["bytes"]
    assert _total(samples, "p2pkv_jobs_total", kind="load") == stats["consumer"]["jobs_done"]
    assert _total(samples, "p2pkv_jobs_total", kind="store") == stats["producer"]["jobs_done"]
    assert _total(samples, "p2pkv_jobs_total") == _total(
        samples, "p2pkv_jobs_total", outcome="done"
    )
    assert _total(samples, "p2pkv_transfers_total", result="failed") == 0
    assert _total(samples, "p2pkv_transfers_total", result="ok") >= summary["requests"]
    assert _total(samples, "p2pkv_sessions_opened_total") >= 2  # one per side at least
    assert _total(samples, "p2pkv_protocol_errors_total") == 0
    assert (
        _total(samples, "p2pkv_job_duration_seconds_count", kind="load")
        == (stats["consumer"]["jobs_done"])
    )
    gauges = {"p2pkv_sessions", "p2pkv_in_flight_transfers", "p2pkv_parked_stores"}
    assert not gauges & {name for name, _ in samples}, "gauges of exited processes remain"
    assert not list(metrics_dir.glob("gauge_*.db"))
