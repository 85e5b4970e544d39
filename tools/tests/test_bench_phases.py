"""``p2pkv bench --tier --phases``: each pull's time split at the moments the consumer's own
process sees (``read_blocks`` called and returned, the read's end, the result), both sides'
CPU by component, raw NIXL beside it; every byte checked. Asserts what was measured and
that it adds up, never a time."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from p2pkv.cli import main
from p2pkv.registry import default_registry
from p2pkv_tools.bench.tier_phases import PHASES, split
from p2pkv_tools.bench.tier_phases_side import component

pytestmark = pytest.mark.skipif(
    default_registry().transport("data", "nixl").availability() is not None, reason="needs NIXL"
)


def test_a_record_splits_into_phases_that_add_up() -> None:
    record = {
        "submitted": 10.0,
        "result": 10.9,
        "events": [("call", 10.2), ("posted", 10.5), ("ended", 10.6)],
    }
    phases = split(record)
    assert phases is not None
    assert phases["control"] == pytest.approx(0.2) and phases["post"] == pytest.approx(0.3)
    assert phases["read"] == pytest.approx(0.1) and phases["report"] == pytest.approx(0.3)
    parts = sum(phases[p] for p in PHASES if p != "total")
    assert parts == pytest.approx(phases["total"])
    assert split({"submitted": 1.0, "result": 2.0, "events": []}) is None
    pieces = split(
        {
            "submitted": 0.0,
            "result": 1.0,
            "events": [
                ("call", 0.1),
                ("posted", 0.2),
                ("ended", 0.4),
                ("call", 0.5),
                ("posted", 0.55),
                ("ended", 0.8),
            ],
        }
    )
    assert pieces is not None and pieces["post"] == pytest.approx(0.15)
    assert pieces["read"] == pytest.approx(0.55) and pieces["report"] == pytest.approx(0.2)


def test_components_are_named_by_path_and_the_staged_copies_apart() -> None:
    assert component("/x/p2pkv/session/client.py") == "session protocol"
    assert component("/x/site-packages/nixl_cu12/_api.py") == "NIXL"
    assert component("/x/p2pkv_nixl/staging.py", "copy_out") == "staged copy"
    assert component("/x/p2pkv_nixl/staging.py", "take") == "nixl transport"
    assert component("/usr/lib/python3.11/json/decoder.py") == "other"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_quick_form_splits_every_pull_and_checks_its_bytes(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    out = tmp_path / "phases.json"
    status = main(
        [
            "bench",
            "--tier",
            "--phases",
            "--quick",
            "--block-sizes",
            "64K",
            "--batches",
            "1,8",
            "--json",
            str(out),
        ]
    )
    print(capsys.readouterr().out)
    assert status == 0
    doc = json.loads(out.read_text())
    assert [(r["block_size"], r["batch"]) for r in doc["rows"]] == [(65536, 1), (65536, 8)]
    for row in doc["rows"]:
        assert row["error"] == "" and row["verified"], row
        assert row["requests"] == doc["plan"]["requests"] == 10
        phases = row["phases_us"]
        assert set(phases) == set(PHASES) and all(v >= 0 for v in phases.values())
        assert {"raw nixl", "raw nixl write"} <= set(row["raw_us"])
        for side in ("producer", "consumer"):
            assert row["cpu_us"][side] > 0
            assert row["components_us"][side]["thread total"] > 0
            assert "session protocol" in row["components_us"][side]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--phases"], "--phases is an option of the tier bench: add --tier"),
        (["--tier", "--phases", "--transports", "nixl,ucx"], "--phases profiles one data"),
    ],
)
def test_misuse_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", *argv]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err
