"""``p2pkv bench --tier --netns`` (issue 31): the quick namespaced tier bench.

One cell (64 KiB x 4 blocks, one request in flight, both arrival orders) with the producer
and the consumer tier, and the raw NIXL baselines' source and reader (``raw nixl``: the
reader's READ; ``raw nixl write``: the source's WRITE), in two network namespaces joined by a
veth shaped with ``tc``, UCX over TCP: every byte verified, both raw baselines measured in the
same run over the same link (the veth's own counters show that they crossed it), and the
run's namespaces gone afterwards, also when the run is interrupted. Skipped, saying why,
without root or iproute2. The misuses of ``--netns``/``--rate`` that need no root are in
``tests/test_bench_tier.py``.

Benchmarks are not tests: nothing here looks at a rate or a latency value.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest
from chaos_netlab import netlab_problem
from p2pkv.cli import main
from p2pkv.registry import default_registry
from p2pkv.testing.waiting import wait_until
from p2pkv_tools.bench.netns import PREFIX, open_link, parse_rate

RATE = "2gbit"
ONE_CELL = ("--quick", "--block-sizes", "64K", "--batches", "4", "--concurrency", "1")
ENDLESS = (
    "--block-sizes",
    "64K",
    "--batches",
    "4",
    "--concurrency",
    "1",
    "--reps",
    "200",
    "--bytes-per-rep",
    "1G",
    "--no-memcpy",
)
"""A run that cannot end by itself before the signal: 200 repetitions of 1 GB per cell."""
T = 60.0


def _needs_namespaces() -> None:
    problem = netlab_problem()
    if problem is not None:
        pytest.skip(f"network namespaces unavailable: {problem}")
    if shutil.which("tc") is None:
        pytest.skip("tc (iproute2) is not installed")
    registry = default_registry()
    for kind, name in (("data", "nixl"), ("control", "zmq")):
        entry = registry.entries(kind).get(name)  # type: ignore[arg-type]
        if entry is None or entry.cls.availability() is not None:
            pytest.skip(f"needs the {name} {kind} transport")


def _namespaces(prefix: str) -> list[str]:
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=True
    ).stdout
    return [
        line.split()[0] for line in listed.splitlines() if line.strip() and line.startswith(prefix)
    ]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "p2pkv.cli", "bench", *args]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The quick namespaced run, in this process (its namespaces carry this pid)."""
    _needs_namespaces()
    prefix = f"{PREFIX}{os.getpid()}-"
    assert _namespaces(prefix) == []
    out = tmp_path_factory.mktemp("netns") / "tier.json"
    assert main(["bench", "--tier", "--netns", "--rate", RATE, *ONE_CELL, "--json", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_one_cell_moves_verified_bytes_in_both_orders(run: dict[str, Any]) -> None:
    assert run["verified"] is True
    assert sorted(r["order"] for r in run["rows"]) == ["consumer_first", "producer_first"]
    for row in run["rows"]:
        assert (row["block_size"], row["batch"], row["concurrency"]) == (64 * 1024, 4, 1)
        assert row["error"] == "" and row["verified"], row
        assert row["bytes_verified"] > 0
    (first,) = run["first_pull"]
    assert first["errors"] == [] and first["first_pull_ms"] > 0


def test_raw_nixl_is_measured_over_the_same_link(run: dict[str, Any]) -> None:
    """Both raw baselines (READ and WRITE) ran verified in the same run, every tier row has
    the ratio to each and to the faster one, and the veth's source end sent at least the
    bytes each phase moved across it."""
    raws = [r for r in run["baseline_rows"] if r["impl"] == "raw"]
    assert sorted(r["series"] for r in raws) == ["raw nixl", "raw nixl write"]
    for raw in raws:
        assert raw["error"] == "" and raw["verified"] and raw["bytes_verified"] > 0, raw
    for row in run["rows"]:
        assert set(row["ratios_raw"]) == {"raw nixl", "raw nixl write"}
        assert row["ratio_raw"] == min(row["ratios_raw"].values())
        assert row["ratios_raw"][row["raw_series"]] == row["ratio_raw"]
    carried = run["link"]["carried_bytes"]
    assert carried["baselines"] >= sum(raw["bytes_moved"] for raw in raws)
    assert carried["tier"] >= sum(r["bytes_moved"] for r in run["rows"])


def test_the_link_is_named_in_the_json(run: dict[str, Any]) -> None:
    link = run["link"]
    assert link["kind"] == "netns"
    assert link["rate"] == RATE and link["rate_bits_per_s"] == parse_rate(RATE)
    assert link["qdisc"] in ("tbf", "htb")
    for side in ("producer", "consumer"):
        assert link["namespaces"][side].startswith(f"{PREFIX}{os.getpid()}-")
        assert link["env"][side] == {"UCX_TLS": "tcp", "UCX_NET_DEVICES": link["veth"][side]}
    assert run["tier"]["control_options"] == {"insecure": True}


def test_the_run_leaves_no_namespace_behind(run: dict[str, Any]) -> None:
    assert _namespaces(f"{PREFIX}{os.getpid()}-") == []


def test_the_link_is_built_as_described_and_removed_on_failure() -> None:
    _needs_namespaces()
    with pytest.raises(RuntimeError, match="failed inside"), open_link(parse_rate(RATE)) as link:
        names = {link.source.netns, link.reader.netns}
        assert names <= set(_namespaces(PREFIX))
        for end in (link.source, link.reader):
            qdisc = subprocess.run(
                ["tc", "-n", end.netns, "qdisc", "show", "dev", end.device],
                capture_output=True,
                text=True,
                timeout=20,
            ).stdout
            assert link.qdisc is not None and f"qdisc {link.qdisc}" in qdisc
        raise RuntimeError("failed inside")
    assert names.isdisjoint(_namespaces(PREFIX))


@pytest.mark.interrupted_bench
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_an_interrupted_run_removes_its_namespaces(signum: int, tmp_path: Path) -> None:
    """Ctrl-C or SIGTERM while the run's processes live in both namespaces: the run ends
    with the status of that signal, its namespaces are gone, and none of the processes that
    were in them is left."""
    _needs_namespaces()
    proc = subprocess.Popen(
        _cli("--tier", "--netns", *ENDLESS, "--json", str(tmp_path / "x.json")),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    prefix = f"{PREFIX}{proc.pid}-"
    inside: dict[int, psutil.Process] = {}  # taken while the pids are surely the run's
    populated_ends: set[str] = set()
    try:

        def populated() -> bool:
            for name in (f"{prefix}a", f"{prefix}b"):
                pids = subprocess.run(
                    ["ip", "netns", "pids", name], capture_output=True, text=True, timeout=20
                ).stdout.split()
                for pid in map(int, pids):
                    populated_ends.add(name)
                    if pid not in inside and (process := _process(pid)) is not None:
                        inside[pid] = process
            return len(populated_ends) == 2 or proc.poll() is not None

        wait_until(populated, timeout=T, what="processes in both namespaces")
        assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        proc.send_signal(signum)
        _, err = proc.communicate(timeout=T)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(T)
    assert proc.returncode == 128 + signum, err  # 130: "interrupted"; 143: SystemExit
    assert "Traceback" not in err, err
    assert _namespaces(prefix) == []
    alive = psutil.wait_procs(list(inside.values()), timeout=T)[1]
    for leftover in alive:
        leftover.kill()  # the run's own children: they must not outlive the test
    assert not alive, [p.pid for p in alive]


def _process(pid: int) -> psutil.Process | None:
    try:
        return psutil.Process(pid)
    except psutil.NoSuchProcess:
        return None
