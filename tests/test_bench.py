"""``p2pkv bench``: the quick matrix runs end to end, every cell moves verified bytes.

Benchmarks are not tests: nothing here looks at a rate or a latency value, only at structure
and verification.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from p2pkv.bench.cli import parse_size
from p2pkv.bench.lanes import MemcpyLane
from p2pkv.bench.report import figure, geomean_ratios, plot
from p2pkv.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv.cli import main
from p2pkv.registry import default_registry

ROW_KEYS = {
    "series", "impl", "transport", "block_size", "batch", "concurrency", "requests", "reps",
    "gbps", "gbps_min", "gbps_max", "p50_us", "p99_us", "mean_us", "bytes_moved",
    "bytes_verified", "verified", "ratio_raw", "ratio_memcpy", "error", "skipped", "rep_gbps",
}


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    return json.loads(out.read_text())


def test_quick_json_structure(quick_doc: dict) -> None:
    assert {"host", "config", "series", "rows", "summary", "unavailable"} <= set(quick_doc)
    assert quick_doc["host"]["cores"] >= 1
    rows = quick_doc["rows"]
    assert rows
    for row in rows:
        assert set(row) == ROW_KEYS


def test_every_cell_moved_verified_bytes(quick_doc: dict) -> None:
    for row in quick_doc["rows"]:
        if row["skipped"]:
            continue
        where = f"{row['series']} {row['block_size']} x{row['batch']} c{row['concurrency']}"
        assert row["error"] == "", where
        assert row["verified"], where
        assert row["bytes_verified"] >= row["block_size"] * row["batch"], where
        assert row["bytes_moved"] >= row["bytes_verified"], where
        assert len(row["rep_gbps"]) == row["reps"], where


def test_series_cover_baselines_and_installed_transports(quick_doc: dict) -> None:
    series = set(quick_doc["series"])
    assert "memcpy" in series
    registry = default_registry()
    for name, entry in registry.entries("data").items():
        if entry.cls.availability() is None:
            assert f"p2pkv {name}" in series
    for name in registry.bench_baselines():
        assert f"raw {name}" in series or f"raw {name}" in quick_doc["unavailable"]
    # ratios are filled in wherever the baseline of the same cell exists
    rows = quick_doc["rows"]
    by_cell = {(r["series"], r["block_size"], r["batch"], r["concurrency"]) for r in rows}
    for r in rows:
        if r["impl"] == "p2pkv" and f"raw {r['transport']}" in series:
            assert (f"raw {r['transport']}", r["block_size"], r["batch"], r["concurrency"]) \
                in by_cell
            assert r["ratio_raw"] is not None
        if r["impl"] != "memcpy":
            assert r["ratio_memcpy"] is not None


def test_memcpy_lane_detects_a_wrong_byte() -> None:
    src = np.zeros(64 * 1024, np.uint8)
    dst = np.zeros(64 * 1024, np.uint8)
    lane = MemcpyLane(src, dst)
    lane.open(4096)
    plan = CellPlan(block_size=4096, batch=4, concurrency=1, requests=3, reps=1, warmup=0)
    good = measure_cell(lane, plan, np.random.default_rng(0))
    assert good.verified and good.error == ""

    class Corrupting(MemcpyLane):
        def submit(self, local: list[int], remote: list[int]) -> int:
            tid = super().submit(local, remote)
            self._dest.words[remote[0], 5] ^= np.uint64(1)
            return tid

    bad_lane = Corrupting(src, dst)
    bad_lane.open(4096)
    bad = measure_cell(bad_lane, plan, np.random.default_rng(0))
    assert not bad.verified
    assert "wrong blocks" in bad.error


def test_cell_too_big_for_the_region_is_skipped() -> None:
    lane = MemcpyLane(np.zeros(8192, np.uint8), np.zeros(8192, np.uint8))
    lane.open(4096)
    plan = CellPlan(block_size=4096, batch=4, concurrency=1, requests=2, reps=1)
    result = measure_cell(lane, plan, np.random.default_rng(0))
    assert result.skipped and not result.verified


def test_sizes_and_geomean() -> None:
    assert parse_size("64K") == 65536
    assert parse_size("4MiB") == 4 << 20
    assert parse_size("1g") == 1 << 30
    rows = [
        CellResult("p2pkv nixl", "p2pkv", "nixl", 1, 1, 1, gbps=1.0, ratio_raw=0.5,
                   ratio_memcpy=0.25),
        CellResult("p2pkv nixl", "p2pkv", "nixl", 2, 1, 1, gbps=1.0, ratio_raw=2.0,
                   ratio_memcpy=0.25),
    ]
    g = geomean_ratios(rows)["p2pkv nixl"]
    assert g["ratio_raw"] == pytest.approx(1.0)
    assert g["ratio_raw_min"] == 0.5
    assert g["ratio_memcpy"] == pytest.approx(0.25)


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--block-sizes", "12"])
    assert "multiples of 8" in capsys.readouterr().err


def test_plot(quick_doc: dict, tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "bench.png"
    plot([CellResult(**row) for row in quick_doc["rows"]], str(out), "quick")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _synthetic_results() -> list[CellResult]:
    """memcpy far above two ucx series near 0.05 GB/s, 2 batches x 2 concurrencies."""
    rows = []
    for block in (64 << 10, 1 << 20):
        for batch in (1, 16):
            for conc in (1, 4):
                for series, impl, gbps in (("memcpy", "memcpy", 20.0),
                                           ("raw ucx", "raw", 0.06), ("p2pkv ucx", "p2pkv", 0.04)):
                    if impl == "memcpy" and conc != 1:
                        continue  # as the matrix runs it
                    rate = gbps * conc * (1 + block / (1 << 20))
                    rows.append(CellResult(series, impl, "ucx" if impl != "memcpy" else "memcpy",
                                           block, batch, conc, gbps=rate, gbps_min=rate * 0.9,
                                           gbps_max=rate * 1.1))
    return rows


def test_plot_shows_every_concurrency_on_log_axes_with_the_legend_outside(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    fig = figure(_synthetic_results(), "synthetic")
    axes = fig.axes
    assert sorted(ax.get_title() for ax in axes) == sorted(
        f"batch {b}, concurrency {c}" for b in (1, 16) for c in (1, 4))
    assert {ax.get_yscale() for ax in axes} == {"log"}
    for ax in axes:  # memcpy (run at concurrency 1) is the reference in every panel
        assert ax.get_legend_handles_labels()[1] == ["memcpy", "raw ucx", "p2pkv ucx"]
        assert ax.get_legend() is None
        low, high = ax.get_ylim()
        ys = [y for series in ax.containers for y in series[0].get_ydata()]
        assert low < min(ys) and max(ys) < high
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == ["memcpy", "raw ucx", "p2pkv ucx"]
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    box = legend.get_window_extent(renderer)
    assert not any(box.overlaps(ax.get_window_extent(renderer)) for ax in axes)
    assert "every concurrency" in " ".join(t.get_text() for t in fig.texts)
    pytest.importorskip("matplotlib.pyplot").close(fig)
    out = tmp_path / "bench.png"
    plot(_synthetic_results(), str(out), "synthetic")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert main(["bench", "--quick", "--plot", "x.png"]) == 2
    assert "pip install 'p2pkv[plot]'" in capsys.readouterr().err


def test_control_mode_json(tmp_path: Path) -> None:
    out = tmp_path / "control.json"
    assert main(["bench", "--control", "--quick", "--json", str(out)]) == 0
    doc = json.loads(out.read_text())
    registry = default_registry()
    if "zmq" in registry.entries("control"):
        lanes = doc["round_trips"]["lanes"]
        assert set(lanes) == {"raw-pyzmq", "p2pkv-zmq"}
        assert all(lane["p50_us"] > 0 for lane in lanes.values())
    measured = [t for t in doc["tier"] if "skipped" not in t]
    assert {t["control"] for t in measured} >= {"memory"} & set(registry.entries("control"))
    for t in measured:
        assert t["cpu_us_per_request"] > 0
        assert t["requests"] == 100
