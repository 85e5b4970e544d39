"""``p2pkv bench --fleet --quick``: the fleet simulator runs end to end (a tier under test and
its peers in real processes, zmq control) and its JSON has every field, for every size and
both floods; the doc's tables come from that JSON; every misuse of its flags ends in one
line. Benchmarks are not tests: no figure is looked at, only structure and verified bytes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from p2pkv.cli import main
from p2pkv.registry import default_registry
from p2pkv_tools.bench.fleet import QUICK
from p2pkv_tools.bench.fleet_report import FLOOD_COLUMNS, SIZE_COLUMNS, markdown

SIZE_FIELDS = {key for key, _ in SIZE_COLUMNS} | {
    "processes",
    "rate_rps",
    "rate_requests",
    "rate_p50_ms",
    "rate_outcomes",
    "cold_outcomes",
    "cold_details",
    "heartbeat_segments_per_s_per_session",
    "mismatched",
}
FLOOD_FIELDS = {key for key, _ in FLOOD_COLUMNS} | {
    "flood_rate",
    "window_s",
    "cpu_pct_alone",
    "flood_outcomes",
    "newcomer_p50_ms",
    "newcomer_details",
    "mismatched",
}


@pytest.fixture(scope="module")
def fleet_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    entry = default_registry().entries("control").get("zmq")
    if entry is None or entry.cls.availability() is not None:
        pytest.skip("needs the zmq control transport")
    out = tmp_path_factory.mktemp("fleet") / "fleet.json"
    assert main(["bench", "--fleet", "--quick", "--fleet-label", "test", "--json", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_quick_json_has_every_field_for_every_size(fleet_doc: dict[str, Any]) -> None:
    assert [row["peers"] for row in fleet_doc["sizes"]] == list(QUICK.sizes)
    for row in fleet_doc["sizes"]:
        assert set(row) >= SIZE_FIELDS, SIZE_FIELDS - set(row)
        assert row["mismatched"] == 0
    for key in ("host", "date", "load_avg", "config", "elapsed_s", "label", "command"):
        assert key in fleet_doc


def test_quick_json_has_both_floods_with_the_newcomer(fleet_doc: dict[str, Any]) -> None:
    assert [row["kind"] for row in fleet_doc["floods"]] == ["refusing", "black-holed"]
    assert [row["round"] for row in fleet_doc["floods"]] == [1, 1]
    for row in fleet_doc["floods"]:
        assert set(row) >= FLOOD_FIELDS, FLOOD_FIELDS - set(row)
        assert sum(row["newcomer_outcomes"].values()) == 4  # every first load has an outcome
        assert row["mismatched"] == 0


def test_quick_json_says_the_tier_under_test_had_a_core_of_its_own(
    fleet_doc: dict[str, Any],
) -> None:
    cores = fleet_doc["placement"]
    if len(os.sched_getaffinity(0)) < 2:
        assert cores is None
        return
    assert len(cores["tut"]) == 1 and cores["tut"][0] not in cores["peers"]
    assert set(cores["tut"]) | set(cores["peers"]) == os.sched_getaffinity(0)


def test_the_doc_tables_come_from_the_json(fleet_doc: dict[str, Any], tmp_path: Path) -> None:
    path = tmp_path / "run.json"
    path.write_text(json.dumps(fleet_doc))
    proc = subprocess.run(
        [sys.executable, "-m", "p2pkv_tools.bench.fleet_report", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert proc.stdout == markdown(fleet_doc) + "\n"
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ")]
    assert len(rows) == 2 + len(fleet_doc["sizes"]) + len(fleet_doc["floods"])
    summary = [line for line in proc.stdout.splitlines() if line.startswith("- ")]
    assert [line.split(":")[0] for line in summary][:2] == ["- refusing", "- black-holed"]


MISUSES = {
    "sizes without fleet": (("--fleet-sizes", "16"), "add --fleet"),
    "no floods without fleet": (("--no-floods",), "add --fleet"),
    "flood rounds without fleet": (("--flood-rounds", "2"), "add --fleet"),
    "fleet and tier": (("--fleet", "--tier"), "separate benchmarks"),
    "fleet and control": (("--fleet", "--control"), "separate benchmarks"),
    "too few peers": (("--fleet", "--fleet-sizes", "4"), "--fleet-sizes"),
    "fleet plot": (("--fleet", "--plot", "x.png"), "--fleet has no plot"),
    "tut path without p2pkv": (("--fleet", "--fleet-tut-path", "/"), "--fleet-tut-path"),
}


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_misuse_ends_in_one_line(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    args, named = MISUSES[case]
    assert main(["bench", *args]) == 2
    out = capsys.readouterr()
    lines = [line for line in out.err.splitlines() if line.strip()]
    assert len(lines) == 1 and named in lines[0], out.err
    assert "Traceback" not in out.err + out.out
