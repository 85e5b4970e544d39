"""The ``p2pkv`` command: ``--version``, ``plugins`` (text and ``--json``), hook tracing, and
what plugins add to it (fixture plugins: a misspelled hook, a disabled plugin, doctor checks),
in subprocesses."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import p2pkv
import pytest
from child_python import RunPython
from p2pkv import cli
from p2pkv.registry import PluginFailure, Registry

CLI = ("-m", "p2pkv.cli")
SCRIPT = Path(sys.executable).parent / "p2pkv"


def test_version(run_python: RunPython) -> None:
    proc = run_python(*CLI, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"p2pkv {p2pkv.__version__}"
    assert p2pkv.__version__ != "0.0.0"


def test_console_script_is_installed(run_python: RunPython) -> None:
    if not SCRIPT.exists():
        pytest.skip("p2pkv console script not installed next to this interpreter")
    proc = run_python(str(SCRIPT), "--version")
    assert proc.returncode == 0 and proc.stdout.startswith("p2pkv "), proc.stderr


def test_no_command_prints_help(run_python: RunPython) -> None:
    proc = run_python(*CLI)
    assert proc.returncode == 2
    assert "plugins" in proc.stdout


def test_plugins_json_lists_memory_transports(run_python: RunPython) -> None:
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


def test_plugins_json_reports_missing_known_transports(run_python: RunPython) -> None:
    proc = run_python(*CLI, "plugins", "--json", P2PKV_DISABLE_PLUGINS="memory")
    report = json.loads(proc.stdout)
    missing = {(r["kind"], r["name"]): r["install"] for r in report["not_installed"]}
    assert missing[("control", "memory")] == "pip install p2pkv-memory"
    assert missing[("data", "memory")] == "pip install p2pkv-memory"


def test_plugins_table(run_python: RunPython) -> None:
    proc = run_python(*CLI, "plugins", COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    memory_rows = [line for line in proc.stdout.splitlines() if " memory " in line]
    assert len(memory_rows) == 2
    assert all("p2pkv-memory" in line and "available" in line for line in memory_rows)


def test_plugins_table_shows_failures_and_conflicts(
    fixture_site: Path, run_python: RunPython
) -> None:
    proc = run_python(*CLI, "plugins", site=fixture_site, COLUMNS="200")
    assert proc.returncode == 0, proc.stderr
    out = " ".join(proc.stdout.split())
    assert "plugin fixture_broken (p2pkv-fixture-broken) failed" in out
    assert "plugin fixture_oldapi (p2pkv-fixture-oldapi) failed" in out
    assert (
        "plugin fixture_typo (p2pkv-fixture-typo) failed: implements unknown hook "
        "'p2pkv_transprots' (did you mean 'p2pkv_transports'?)"
    ) in out
    assert "data transport 'fixture' refused: claimed by" in out
    assert "p2pkv-fixture-good" in out and "p2pkv-fixture-dup" in out


def test_trace_hooks_shows_the_registration_hooks(run_python: RunPython) -> None:
    cli = (str(SCRIPT),) if SCRIPT.exists() else CLI
    proc = run_python(*cli, "plugins", "--json", P2PKV_TRACE_HOOKS="1")
    assert proc.returncode == 0, proc.stderr
    assert "p2pkv.hooks: hook p2pkv_transports() -> memory" in proc.stderr
    assert "hook p2pkv_cli_commands(subparsers=" in proc.stderr
    assert "-> p2pkv" in proc.stderr  # the built-in commands are p2pkv's own plugin


def test_a_disabled_plugin_is_listed_and_named_by_errors(
    fixture_site: Path, run_python: RunPython
) -> None:
    proc = run_python(
        *CLI, "plugins", site=fixture_site, P2PKV_DISABLE_PLUGINS="fixture_shm", COLUMNS="200"
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "plugin fixture_shm (p2pkv-fixture-shm) not loaded: disabled by P2PKV_DISABLE_PLUGINS"
    ) in " ".join(proc.stdout.split())
    proc = run_python(
        *CLI,
        "demo",
        "--control",
        "memory",
        "--data",
        "fixture_shm",
        site=fixture_site,
        P2PKV_DISABLE_PLUGINS="fixture_shm",
        COLUMNS="200",
    )
    assert proc.returncode == 2
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("p2pkv demo:")]
    assert line.startswith("p2pkv demo: unknown data transport 'fixture_shm'")
    assert "P2PKV_DISABLE_PLUGINS blocks it; remove 'fixture_shm' from that variable" in line


@pytest.mark.parametrize("command", ["demo", "bench", "doctor"])
def test_a_tool_command_without_p2pkv_tools_is_one_line_naming_the_fix(
    command: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(cli, "default_registry", lambda: Registry.from_plugins([], environ={}))
    assert cli.main([command, "--quick", "--json", "x.json", "extra"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err == f"p2pkv {command}: not installed: pip install 'p2pkv[cli]' (or p2pkv-tools)\n"


def test_a_tool_command_with_p2pkv_tools_broken_names_its_failure(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    reg = Registry.from_plugins([], environ={})
    reg.failures.append(PluginFailure("tools", "p2pkv-tools", "import failed: ImportError: x"))
    monkeypatch.setattr(cli, "default_registry", lambda: reg)
    assert cli.main(["demo"]) == 2
    assert capsys.readouterr().err == (
        "p2pkv demo: p2pkv-tools failed to load (import failed: "
        "ImportError: x); see 'p2pkv plugins'\n"
    )


def test_a_tool_command_with_p2pkv_tools_disabled_names_the_variable(run_python: RunPython) -> None:
    proc = run_python(*CLI, "bench", "--quick", P2PKV_DISABLE_PLUGINS="tools")
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr == (
        "p2pkv bench: p2pkv-tools is installed but P2PKV_DISABLE_PLUGINS "
        "blocks it; remove 'tools' from that variable\n"
    )


def test_unknown_arguments_of_an_installed_command_are_still_refused(run_python: RunPython) -> None:
    proc = run_python(*CLI, "plugins", "--bogus")
    assert proc.returncode == 2
    assert proc.stderr == "p2pkv: unrecognized arguments: --bogus (see 'p2pkv --help')\n"


def test_doctor_runs_and_prints_the_plugins_checks(
    fixture_site: Path, run_python: RunPython
) -> None:
    proc = run_python(
        *CLI, "doctor", "--no-probe", "--config", '{"port": 0}', site=fixture_site, COLUMNS="200"
    )
    assert proc.returncode == 1, proc.stderr  # a plugin's check failed
    assert "Traceback" not in proc.stderr + proc.stdout
    lines = proc.stdout.splitlines()
    assert "check fixture passes (fixture_shm): ok: all good" in lines
    assert "check fixture fails (fixture_shm): FAILED: set FIXTURE=1 to fix it" in lines
    assert (
        "check fixture raises (fixture_shm): FAILED: the check raised RuntimeError: "
        "fixture check bug (on purpose)"
    ) in lines
    proc = run_python(
        *CLI, "doctor", "--no-probe", "--json", "--config", '{"port": 0}', site=fixture_site
    )
    checks = {c["check"]: c for c in json.loads(proc.stdout)["plugin_checks"]}
    assert checks["fixture passes"] == {
        "plugin": "fixture_shm",
        "check": "fixture passes",
        "ok": True,
        "detail": "all good",
    }
    assert not checks["fixture raises"]["ok"]
