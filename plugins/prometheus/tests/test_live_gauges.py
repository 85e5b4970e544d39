"""Multi-process mode: the gauges of a process that exited leave the scrape, its counters stay.

Real processes (``gauge_process.py``) report through the plugin's hooks into one
``PROMETHEUS_MULTIPROC_DIR``; the test collects the directory the way a scrape does. The
process that leaves is a plain interpreter, a forked ``multiprocessing`` child (which exits
through ``os._exit``, skipping ``atexit``) or a spawned one.
"""

from __future__ import annotations

import os
import select
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry
from prometheus_client.multiprocess import MultiProcessCollector

HELPER = Path(__file__).with_name("gauge_process.py")
DEADLINE = 30.0


def _start(sessions: int, how: str, directory: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(directory)}
    proc = subprocess.Popen(
        [sys.executable, str(HELPER), str(sessions), how],
        env=env,
        text=True,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], DEADLINE)
    line = proc.stdout.readline() if readable else ""
    if line.strip() != "ready":
        proc.kill()
        _, err = proc.communicate(timeout=DEADLINE)
        pytest.fail(f"{how} reporter not ready within {DEADLINE}s: {line!r} {err}")
    return proc


def _finish(proc: subprocess.Popen[str]) -> None:
    _, err = proc.communicate(timeout=DEADLINE)  # closes stdin: the reporter exits
    assert proc.returncode == 0, err


def _scrape(directory: Path) -> dict[str, float]:
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(directory))  # type: ignore[no-untyped-call]
    return {s.name: s.value for family in registry.collect() for s in family.samples}


@pytest.mark.parametrize("how", ["plain", "fork", "spawn"])
def test_gauges_of_an_exited_process_leave_the_scrape(tmp_path: Path, how: str) -> None:
    staying = _start(2, "plain", tmp_path)
    leaving = None
    try:
        leaving = _start(5, how, tmp_path)
        assert _scrape(tmp_path)["p2pkv_sessions"] == 7
        _finish(leaving)
        after_one = _scrape(tmp_path)
        assert after_one["p2pkv_sessions"] == 2
        assert after_one["p2pkv_sessions_opened_total"] == 2
        _finish(staying)
        after_both = _scrape(tmp_path)
        assert "p2pkv_sessions" not in after_both
        assert after_both["p2pkv_sessions_opened_total"] == 2
        assert not list(tmp_path.glob("gauge_*.db"))
    finally:
        for proc in (staying, leaving):
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait(DEADLINE)


def test_the_supervisor_removes_the_gauges_of_a_killed_process(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGKILL leaves no chance to clean up: the gauges stay until whoever started the
    process marks it dead, as ``p2pkv demo --metrics`` does for its role processes."""
    from p2pkv_tools.demo.metrics import DemoMetrics

    killed = _start(5, "plain", tmp_path)
    killed.kill()
    killed.communicate(timeout=DEADLINE)
    assert _scrape(tmp_path)["p2pkv_sessions"] == 5
    monkeypatch.setenv("PROMETHEUS_MULTIPROC_DIR", str(tmp_path))
    with DemoMetrics("dump", host="127.0.0.1", inline=False) as metrics:
        metrics.forget([killed.pid, None])
    assert "p2pkv_sessions" not in _scrape(tmp_path)
    assert _scrape(tmp_path)["p2pkv_sessions_opened_total"] == 1
