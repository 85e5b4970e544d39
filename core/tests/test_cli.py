"""The ``p2pkv`` command: ``--version`` and ``plugins`` (text and ``--json``), in subprocesses."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import p2pkv
import pytest

CLI = ("-m", "p2pkv.cli")


def test_version(run_python: Any) -> None:
    proc = run_python(*CLI, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"p2pkv {p2pkv.__version__}"
    assert p2pkv.__version__ != "0.0.0"


def test_console_script_is_installed(run_python: Any) -> None:
    script = Path(sys.executable).parent / "p2pkv"
    if not script.exists():
        pytest.skip("p2pkv console script not installed next to this interpreter")
    proc = run_python(str(script), "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("p2pkv "), proc.stderr


def test_no_command_prints_help(run_python: Any) -> None:
    proc = run_python(*CLI)
    assert proc.returncode == 2
    assert "plugins" in proc.stdout


def test_plugins_json_lists_memory_transports(run_python: Any) -> None:
    proc = run_python(*CLI, "plugins", "--json")
    assert proc.returncode == 0, proc.stderr
    report = json.loads(proc.stdout)
    rows = {(r["kind"], r["name"]): r for r in report["transports"]}
    for kind in ("control", "data"):
        row = rows[(kind, "memory")]
        assert row["distribution"] == "p2pkv-memory"
        assert row["version"] == "0.1.0"
        assert row["available"] is True and row["reason"] == ""
        assert row["capabilities"]["cross_process"] is False
    installed = {(r["kind"], r["name"]) for r in report["transports"]}
    for row in report["not_installed"]:
        assert (row["kind"], row["name"]) not in installed
        assert row["install"] == f"pip install {row['distribution']}"


def test_plugins_json_reports_missing_known_transports(run_python: Any) -> None:
    proc = run_python(*CLI, "plugins", "--json", P2PKV_DISABLE_PLUGINS="memory")
    report = json.loads(proc.stdout)
    missing = {(r["kind"], r["name"]): r["install"] for r in report["not_installed"]}
    assert missing[("control", "memory")] == "pip install p2pkv-memory"
    assert missing[("data", "memory")] == "pip install p2pkv-memory"


def test_plugins_table(run_python: Any) -> None:
    proc = run_python(*CLI, "plugins", COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    memory_rows = [line for line in proc.stdout.splitlines() if " memory " in line]
    assert len(memory_rows) == 2
    assert all("p2pkv-memory" in line and "available" in line for line in memory_rows)


def test_plugins_table_shows_failures_and_conflicts(fixture_site: Path, run_python: Any) -> None:
    proc = run_python(*CLI, "plugins", site=fixture_site, COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "plugin fixture_broken (p2pkv-fixture-broken) failed" in out
    assert "plugin fixture_oldapi (p2pkv-fixture-oldapi) failed" in out
    assert "data transport 'fixture' refused: claimed by" in out
    assert "p2pkv-fixture-good" in out and "p2pkv-fixture-dup" in out
