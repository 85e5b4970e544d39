"""``p2pkv demo --metrics``: the Prometheus metrics of a real run, served while it runs or
printed at its end, and a one-line refusal before the run when they cannot be had.

The two-process runs use the default transports (zmq + nixl) with ``p2pkv-prometheus``
loaded in the role processes through its entry point; what the metrics say is checked
against the demo's own JSON summary.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from p2pkv.cli import main
from p2pkv.registry import Registry, default_registry

prometheus_client = pytest.importorskip("prometheus_client")
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

SMALL = ("--requests", "8", "--preset", "tiny", "--quiet")
GAUGES = ("p2pkv_sessions", "p2pkv_in_flight_transfers", "p2pkv_parked_stores")
HEADER = "# p2pkv demo: metrics of the run"


def _default_transports() -> bool:
    registry = default_registry()
    return all(
        (entry := registry.entries(kind).get(name)) is not None  # type: ignore[arg-type]
        and entry.cls.availability() is None
        for kind, name in (("control", "zmq"), ("data", "nixl"))
    )


needs_default_transports = pytest.mark.skipif(
    not _default_transports(), reason="needs the default transports (p2pkv-zmq, p2pkv-nixl)"
)


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _dumped(stdout: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """The samples ``--metrics dump`` printed after the summary (its header line included)."""
    assert HEADER in stdout, stdout
    return _samples(stdout[stdout.index(HEADER) :])


def _value(samples: dict[Any, float], name: str, **labels: str) -> float:
    return sum(v for (n, lab), v in samples.items() if n == name and dict(lab) == labels)


def _demo(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "summary.json"
    env = {k: v for k, v in os.environ.items() if k != "PROMETHEUS_MULTIPROC_DIR"}
    proc = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "demo", *SMALL, "--json", str(out), *args],
        env={**env, "UCX_NET_DEVICES": "lo"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, json.loads(out.read_text())


@needs_default_transports
def test_dump_prints_the_metrics_of_both_processes_after_the_run(tmp_path: Path) -> None:
    proc, summary = _demo(tmp_path, "--metrics", "dump")
    samples = _dumped(proc.stdout)
    stats = summary["tier_stats"]
    assert _value(samples, "p2pkv_bytes_read_total") == summary["bytes"]
    loads = stats["consumer"]["jobs_done"]
    assert _value(samples, "p2pkv_jobs_total", kind="load", outcome="done") == loads
    assert (
        _value(samples, "p2pkv_jobs_total", kind="store", outcome="done")
        == (stats["producer"]["jobs_done"])
    )
    assert _value(samples, "p2pkv_job_duration_seconds_count", kind="load") == loads
    assert not {name for name, _ in samples} & set(GAUGES), "gauges of exited roles remain"


def test_dump_in_the_one_process_mode(tmp_path: Path) -> None:
    proc, summary = _demo(tmp_path, "--metrics", "dump", "--control", "memory", "--data", "memory")
    samples = _dumped(proc.stdout)
    assert (
        _value(samples, "p2pkv_jobs_total", kind="load", outcome="done")
        == (summary["tier_stats"]["consumer"]["jobs_done"])
    )


@needs_default_transports
def test_port_serves_the_live_roles_during_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Scraped once the replay is over and before the roles stop: both role processes are
    live, so their gauges count; after the run the endpoint is gone."""
    import p2pkv_tools.demo.cli as demo_cli

    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    scraped: dict[str, str] = {}
    real_replay = demo_cli.replay  # type: ignore[attr-defined]  # patched where cli reads it

    def replay_then_scrape(*args: Any, **kwargs: Any) -> Any:
        result = real_replay(*args, **kwargs)
        found = re.search(r"http://\S+/metrics", capsys.readouterr().err)
        assert found, "the demo did not say where it serves its metrics"
        scraped["url"] = found.group(0)
        with urllib.request.urlopen(scraped["url"], timeout=10) as response:
            scraped["text"] = response.read().decode()
        return result

    monkeypatch.setattr(demo_cli, "replay", replay_then_scrape)
    out = tmp_path / "summary.json"
    assert main(["demo", *SMALL, "--metrics", "0", "--json", str(out)]) == 0
    summary = json.loads(out.read_text())
    samples = _samples(scraped["text"])
    assert _value(samples, "p2pkv_sessions") >= 2  # one per live role at least
    assert (
        _value(samples, "p2pkv_jobs_total", kind="load", outcome="done")
        == (summary["tier_stats"]["consumer"]["jobs_done"])
    )
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(scraped["url"], timeout=5)


def test_missing_plugin_is_refused_before_the_run(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import p2pkv_tools.demo.metrics as demo_metrics

    without = Registry.from_plugins([])
    monkeypatch.setattr(demo_metrics, "default_registry", lambda: without)
    assert (
        main(["demo", *SMALL, "--control", "memory", "--data", "memory", "--metrics", "dump"]) == 2
    )
    out, err = capsys.readouterr()
    assert err.strip() == (
        "p2pkv demo: --metrics needs the p2pkv-prometheus plugin: pip install p2pkv-prometheus"
    )
    assert out == ""  # refused before the run was even announced


def test_a_port_in_use_is_refused_before_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        assert (
            main(
                ["demo", *SMALL, "--control", "memory", "--data", "memory", "--metrics", str(port)]
            )
            == 2
        )
    out, err = capsys.readouterr()
    assert f"--metrics {port}: cannot serve on 127.0.0.1:{port}" in err
    assert "0 picks a free one" in err
    assert out == ""
