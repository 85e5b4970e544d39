"""Every misuse of the ``p2pkv`` CLI ends in one line on stderr, with the right exit status.

Table-driven, each row the real ``p2pkv`` console script in a subprocess: the exit status,
exactly one non-empty line on stderr that names the input and the fix, and no ``Traceback``
anywhere. ``COLUMNS=60`` proves the line is not wrapped. Every row fails before any work
starts (output paths and transports are checked before a run), so each takes a second.
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "p2pkv"
DEAD = "http://127.0.0.1:9"
UPSTREAMS = ("--prefiller", DEAD, "--decoder", DEAD)


def cli(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """``p2pkv *args`` as a user runs it: no P2PKV_* variables and outside pytest (so test-only
    plugins stay hidden), plus ``env``."""
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("P2PKV_") and k != "PYTEST_VERSION"
    }
    base.update({"COLUMNS": "60", "UCX_NET_DEVICES": "lo"}, **env)
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "p2pkv.cli"]
    return subprocess.run(
        [*command, *args], env=base, capture_output=True, text=True, timeout=60, check=False
    )


@dataclass(frozen=True)
class Misuse:
    args: tuple[str, ...]
    names: tuple[str, ...]
    """Substrings of the one stderr line: the input, and the fix."""
    status: int = 2
    env: dict[str, str] = field(default_factory=dict)
    needs: tuple[str, ...] = ()
    """Modules the row needs (the proxy rows: p2pkv-vllm with its proxy extra)."""


PROXY = ("p2pkv_vllm", "uvicorn", "aiohttp")
ROWS = {
    "proxy port out of range": Misuse(
        ("proxy", "--port", "70000", *UPSTREAMS), ("--port 70000", "0..65535"), needs=PROXY
    ),
    "proxy policy typo": Misuse(
        ("proxy", "--policy", "least-inflightt", *UPSTREAMS),
        ("'least-inflightt'", "least-inflight"),
        needs=PROXY,
    ),
    "proxy port not a number": Misuse(
        ("proxy", "--port", "abc", *UPSTREAMS), ("--port", "'abc'", "--help"), needs=PROXY
    ),
    "doctor config file missing": Misuse(
        ("doctor", "--no-probe", "--config", "@missing.json"),
        ("--config @missing.json", "No such file"),
    ),
    "doctor config not an object": Misuse(
        ("doctor", "--no-probe", "--config", "[1]"), ("--config", "JSON object")
    ),
    "doctor config unknown key": Misuse(
        ("doctor", "--no-probe", "--config", '{"dp_rank": 1}'), ("'dp_rank'", "valid keys")
    ),
    "doctor last rank's port out of range": Misuse(
        ("doctor", "--no-probe", "--dp-size", "2"),
        ("P2PKV_PORT", "--dp-size 2", "1..65535"),
        env={"P2PKV_PORT": "65535"},
    ),
    "vLLM port out of range for doctor": Misuse(
        ("doctor", "--no-probe", "--dp-size", "2"),
        ("VLLM_P2P_SIDE_CHANNEL_PORT", "--dp-size 2"),
        env={"VLLM_P2P_SIDE_CHANNEL_PORT": "65535"},
        needs=("p2pkv_vllm",),
    ),
    "doctor dp size zero": Misuse(("doctor", "--dp-size", "0"), ("--dp-size", "1..65535")),
    "doctor dp size of 5,000 digits": Misuse(
        ("doctor", "--data-parallel-size", "9" * 5000),
        ("--data-parallel-size", "1..65535", "(5000 characters)"),
    ),
    "check-config dp size of 5,000 digits": Misuse(
        ("check-config", "--kv-transfer-config", "{}", "--data-parallel-size", "9" * 5000),
        ("--data-parallel-size", "1..65535", "(5000 characters)"),
    ),
    "demo json into a missing directory": Misuse(
        ("demo", "--json", "/nonexistent/dir/x.json"),
        ("--json /nonexistent/dir/x.json", "does not exist"),
    ),
    "bench json into a missing directory": Misuse(
        ("bench", "--json", "/nonexistent/dir/x.json"),
        ("--json /nonexistent/dir/x.json", "does not exist"),
    ),
    "bench plot into a missing directory": Misuse(
        ("bench", "--plot", "/nonexistent/dir/x.png"),
        ("--plot /nonexistent/dir/x.png", "does not exist"),
    ),
    "bench control json into a missing directory": Misuse(
        ("bench", "--control", "--json", "/nonexistent/dir/x.json"), ("--json", "does not exist")
    ),
    "bench json onto a directory": Misuse(("bench", "--json", "/"), ("--json /", "directory")),
    "bench unknown transport named": Misuse(
        ("bench", "--quick", "--transports", "nixll"), ("'nixll'", "installed:")
    ),
    "bench zero repetitions": Misuse(("bench", "--quick", "--reps", "0"), ("--reps", ">= 1")),
    "demo unknown transport": Misuse(("demo", "--data", "no-such"), ("'no-such'", "installed:")),
    "demo disabled transport": Misuse(
        ("demo", "--control", "memory", "--data", "memory"),
        ("'memory' is disabled", "P2PKV_DISABLE_PLUGINS", "remove 'memory'"),
        env={"P2PKV_DISABLE_PLUGINS": "memory"},
    ),
    "demo emoji code in the input": Misuse(
        ("demo", "--prompt-dist", "lognormal:abc:0.6"), ("'lognormal:abc:0.6'", "fixed:N")
    ),
    "demo bad preset": Misuse(("demo", "--preset", "gpt-17"), ("--preset", "'gpt-17'")),
    "demo metrics neither a port nor dump": Misuse(
        ("demo", "--metrics", "scrape"), ("--metrics", "'scrape'", "'dump'")
    ),
    "demo metrics port out of range": Misuse(
        ("demo", "--metrics", "70000"), ("--metrics", "'70000'", "0..65535")
    ),
    "demo metrics with the prometheus plugin disabled": Misuse(
        ("demo", "--metrics", "dump", "--control", "memory", "--data", "memory"),
        (
            "--metrics needs the p2pkv-prometheus plugin",
            "P2PKV_DISABLE_PLUGINS",
            "remove 'prometheus'",
        ),
        env={"P2PKV_DISABLE_PLUGINS": "prometheus"},
        needs=("p2pkv_prometheus",),
    ),
    "log level unknown before the command": Misuse(
        ("--log-level", "LOUD", "plugins"), ("--log-level", "'LOUD'", "DEBUG")
    ),
    "log level unknown after the command": Misuse(
        ("demo", "--log-level", "LOUD"), ("--log-level", "'LOUD'", "DEBUG")
    ),
    "unknown command": Misuse(("shout",), ("'shout'", "--help")),
}


@pytest.mark.parametrize("row", ROWS.values(), ids=ROWS.keys())
def test_misuse_is_one_line_with_the_fix(row: Misuse) -> None:
    for module in row.needs:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    proc = cli(*row.args, **row.env)
    output = proc.stdout + proc.stderr
    assert "Traceback" not in output, output
    assert proc.returncode == row.status, output
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("p2pkv"), lines[0]
    for part in row.names:
        assert part in lines[0], (part, lines[0])


def test_log_level_is_accepted_after_the_command() -> None:
    proc = cli("plugins", "--log-level", "info", "--json")
    assert proc.returncode == 0, proc.stderr


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
def test_demo_listens_on_an_ipv6_host() -> None:
    proc = cli(
        "demo",
        "--host",
        "::1",
        "--requests",
        "1",
        "--preset",
        "tiny",
        "--control",
        "zmq",
        "--data",
        "memory",
        "--quiet",
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_disabled_plugins_are_shown_as_disabled() -> None:
    proc = cli("plugins", COLUMNS="200", P2PKV_DISABLE_PLUGINS="memory")
    assert proc.returncode == 0, proc.stderr
    memory_rows = [line for line in proc.stdout.splitlines() if line.startswith("│ memory ")]
    assert len(memory_rows) == 2, proc.stdout
    for line in memory_rows:
        assert "disabled by P2PKV_DISABLE_PLUGINS" in line and "not installed" not in line
    assert "plugin memory (p2pkv-memory) not loaded: disabled by P2PKV_DISABLE_PLUGINS" in (
        proc.stdout
    )


@pytest.mark.skipif(
    importlib.util.find_spec("p2pkv_loopback") is None,
    reason="the example plugin (tests/example_plugin) is not installed",
)
def test_test_only_plugins_stay_out_of_what_a_user_runs() -> None:
    hidden = json.loads(cli("plugins", "--json").stdout)
    assert "loopback" not in {t["name"] for t in hidden["transports"]}
    assert {
        "plugin": "loopback",
        "distribution": "p2pkv-example-loopback",
        "reason": "test-only, hidden (P2PKV_TEST_PLUGINS=1 loads it)",
    } in (hidden["skipped_plugins"])
    shown = json.loads(cli("plugins", "--json", P2PKV_TEST_PLUGINS="1").stdout)
    assert "loopback" in {t["name"] for t in shown["transports"]}
    under_pytest = json.loads(cli("plugins", "--json", PYTEST_VERSION="9").stdout)
    assert "loopback" in {t["name"] for t in under_pytest["transports"]}


@pytest.mark.skipif(
    importlib.util.find_spec("p2pkv_prometheus") is None,
    reason="needs an observer plugin (p2pkv-prometheus) for hooks to be called",
)
def test_trace_hooks_print_at_the_default_log_level() -> None:
    proc = cli(
        "demo",
        "--control",
        "memory",
        "--data",
        "memory",
        "--requests",
        "1",
        "--preset",
        "tiny",
        "--quiet",
        P2PKV_TRACE_HOOKS="1",
    )
    assert proc.returncode == 0, proc.stderr
    assert "p2pkv.hooks: hook p2pkv_job_finished(" in proc.stderr


def test_doctor_accepts_a_vllm_secondary_tiers_entry(tmp_path: Path) -> None:
    """What an operator pastes from --kv-transfer-config: ``type`` and ``module_path`` are
    the engine's keys, not refused as unknown tier keys."""
    entry = tmp_path / "entry.json"
    entry.write_text(
        '{"type": "P2PKVTier", "module_path": "p2pkv_vllm", "control": "zmq", '
        '"data": "memory", "port": 0}'
    )
    done = cli("doctor", "--config", f"@{entry}", "--json")
    assert done.returncode == 0, done.stderr
    assert "module_path" not in done.stderr
