"""``p2pkv bench``: the quick matrix runs end to end, every cell moves verified bytes.

Benchmarks are not tests: nothing here looks at a rate or a latency value, only at structure
and verification.
"""

from __future__ import annotations

import itertools
import json
import sys
import types
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import pytest
from p2pkv.cli import main
from p2pkv.contracts import DataSettings, PollResult
from p2pkv.errors import ConfigError
from p2pkv.hookspecs import PLUGIN_API_VERSION, hookimpl
from p2pkv.registry import Registry, default_registry
from p2pkv_tools.bench.cli import parse_size
from p2pkv_tools.bench.endpoints import SeriesSpec, make_endpoint
from p2pkv_tools.bench.lanes import EndpointLane, MemcpyLane
from p2pkv_tools.bench.report import figure, geomean_ratios, plot
from p2pkv_tools.bench.runner import CellPlan, CellResult, CellTimeout, measure_cell
from p2pkv_tools.bench.target import LocalTarget

ROW_KEYS = {
    "series",
    "impl",
    "transport",
    "block_size",
    "batch",
    "concurrency",
    "requests",
    "reps",
    "gbps",
    "gbps_min",
    "gbps_max",
    "p50_us",
    "p99_us",
    "mean_us",
    "bytes_moved",
    "bytes_verified",
    "verified",
    "ratio_raw",
    "ratio_memcpy",
    "error",
    "skipped",
    "rep_gbps",
}


@pytest.fixture(scope="module")
def quick_doc(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bench") / "quick.json"
    assert main(["bench", "--quick", "--json", str(out)]) == 0
    doc: dict[str, Any] = json.loads(out.read_text())
    return doc


def test_quick_json_structure(quick_doc: dict[str, Any]) -> None:
    assert {"host", "config", "series", "rows", "summary", "unavailable"} <= set(quick_doc)
    assert quick_doc["host"]["cores"] >= 1
    rows = quick_doc["rows"]
    assert rows
    for row in rows:
        assert set(row) == ROW_KEYS


def test_every_cell_moved_verified_bytes(quick_doc: dict[str, Any]) -> None:
    for row in quick_doc["rows"]:
        if row["skipped"]:
            continue
        where = f"{row['series']} {row['block_size']} x{row['batch']} c{row['concurrency']}"
        assert row["error"] == "", where
        assert row["verified"], where
        assert row["bytes_verified"] >= row["block_size"] * row["batch"], where
        assert row["bytes_moved"] >= row["bytes_verified"], where
        assert len(row["rep_gbps"]) == row["reps"], where


def test_series_cover_baselines_and_installed_transports(quick_doc: dict[str, Any]) -> None:
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
            assert (
                f"raw {r['transport']}",
                r["block_size"],
                r["batch"],
                r["concurrency"],
            ) in by_cell
            assert r["ratio_raw"] is not None
        if r["impl"] != "memcpy":
            assert r["ratio_memcpy"] is not None


def test_memcpy_lane_detects_a_wrong_byte() -> None:
    src = np.zeros(64 * 1024, np.uint8)
    dst = np.zeros(64 * 1024, np.uint8)
    lane = MemcpyLane(dst, src)
    lane.open(4096)
    plan = CellPlan(block_size=4096, batch=4, concurrency=1, requests=3, reps=1, warmup=0)
    good = measure_cell(lane, plan, np.random.default_rng(0))
    assert good.verified and good.error == ""

    class Corrupting(MemcpyLane):
        def submit(self, local: list[int], remote: list[int]) -> int:
            tid = super().submit(local, remote)
            self.dest.words[local[0], 5] ^= np.uint64(1)
            return tid

    bad_lane = Corrupting(dst, src)
    bad_lane.open(4096)
    bad = measure_cell(bad_lane, plan, np.random.default_rng(0))
    assert not bad.verified
    assert "wrong blocks" in bad.error


class ServedReads:
    """A two-sided raw baseline in one process: a read lands only when the *source*
    endpoint's ``progress()`` serves it (as a tagged send would), so a bench whose target
    does not progress during the repetition never finishes a request."""

    name = "served"
    _regions: ClassVar[dict[str, ServedReads]] = {}
    _ids = itertools.count(1)

    @classmethod
    def create(cls, settings: DataSettings) -> ServedReads:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        raw = np.frombuffer(settings.region, np.uint8)
        self.blocks = raw.reshape(-1, settings.block_len)
        self.key = uuid.uuid4().hex
        self._regions[self.key] = self
        self.peers: dict[str, str] = {}
        self.to_serve: list[tuple[ServedReads, int, list[int], list[int]]] = []
        self.done: list[int] = []
        self.served = 0

    def descriptor(self) -> bytes:
        return self.key.encode()

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self.peers[peer_id] = descriptor.decode()

    def read_blocks(self, peer_id: str, local: Sequence[int], remote: Sequence[int]) -> int:
        tid = next(self._ids)
        self._regions[self.peers[peer_id]].to_serve.append((self, tid, list(local), list(remote)))
        return tid

    def progress(self) -> None:
        for reader, tid, local, remote in self.to_serve:
            reader.blocks[local] = self.blocks[remote]
            reader.done.append(tid)
            self.served += 1
        self.to_serve.clear()

    def poll(self, peer_id: str | None = None) -> PollResult:
        done, self.done = self.done, []
        return PollResult(done, ())

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        ended = set(transfer_ids)
        for source in self._regions.values():
            source.to_serve = [r for r in source.to_serve if r[0] is not self or r[1] not in ended]

    def close(self) -> list[int]:
        self._regions.pop(self.key, None)
        return []


def _registry_with(*baselines: type[Any]) -> Registry:
    plugin = types.ModuleType("bench_test_plugin")
    plugin.P2PKV_PLUGIN_API = PLUGIN_API_VERSION  # type: ignore[attr-defined]
    plugin.p2pkv_bench_baselines = hookimpl(lambda: list(baselines))  # type: ignore[attr-defined]
    return Registry.from_plugins([("bench-test", plugin)])


def test_reads_of_a_two_sided_baseline_are_served_by_the_progressing_target() -> None:
    registry = _registry_with(ServedReads)
    spec = SeriesSpec("raw", "served", cross_process=False)
    target = LocalTarget(256 * 1024, registry)
    lane = EndpointLane(spec, registry, np.zeros(256 * 1024, np.uint8).data, target)
    lane.open(4096)
    try:
        plan = CellPlan(
            block_size=4096,
            batch=4,
            concurrency=2,
            requests=12,
            reps=2,
            deadline=5.0,
            working_set=64 * 1024,
        )
        result = measure_cell(lane, plan, np.random.default_rng(0))
        assert result.error == "" and result.verified
        assert result.bytes_verified > 0
        source = target.state._sources[spec.label].endpoint  # the target served every read
        assert source.served == result.bytes_moved // (4 * 4096)
    finally:
        lane.close()
        target.shutdown()


def test_reads_the_target_never_serves_time_out_and_are_cancelled(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry = _registry_with(ServedReads)
    spec = SeriesSpec("raw", "served", cross_process=False)
    target = LocalTarget(64 * 1024, registry)
    monkeypatch.setattr(target.state, "pump", lambda: None)  # a source side that stalls
    lane = EndpointLane(spec, registry, np.zeros(64 * 1024, np.uint8).data, target)
    lane.open(4096)
    try:
        plan = CellPlan(block_size=4096, batch=2, concurrency=2, requests=4, reps=1, deadline=0.2)
        with pytest.raises(CellTimeout):
            measure_cell(lane, plan, np.random.default_rng(0))
        assert target.state._sources[spec.label].endpoint.to_serve == []
        assert not target.state.active  # the repetition ended: the target stopped pumping
    finally:
        lane.close()
        target.shutdown()


def test_a_baseline_without_read_blocks_is_refused() -> None:
    class WritesOnly:
        name = "legacy"

        @classmethod
        def create(cls, settings: DataSettings) -> WritesOnly:
            return cls()

        def write_blocks(self, peer_id: str, local: Sequence[int], remote: Sequence[int]) -> int:
            return 1

    region = np.zeros(8192, np.uint8)
    spec = SeriesSpec("raw", "legacy", cross_process=False)
    with pytest.raises(ConfigError, match="read_blocks"):
        make_endpoint(spec, _registry_with(WritesOnly), region.data, 4096)


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
        CellResult(
            "p2pkv nixl", "p2pkv", "nixl", 1, 1, 1, gbps=1.0, ratio_raw=0.5, ratio_memcpy=0.25
        ),
        CellResult(
            "p2pkv nixl", "p2pkv", "nixl", 2, 1, 1, gbps=1.0, ratio_raw=2.0, ratio_memcpy=0.25
        ),
    ]
    g = geomean_ratios(rows)["p2pkv nixl"]
    assert g["ratio_raw"] == pytest.approx(1.0)
    assert g["ratio_raw_min"] == 0.5
    assert g["ratio_memcpy"] == pytest.approx(0.25)


def test_bad_arguments_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "--block-sizes", "12"])
    assert "multiples of 8" in capsys.readouterr().err


def test_plot(quick_doc: dict[str, Any], tmp_path: Path) -> None:
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
                for series, impl, gbps in (
                    ("memcpy", "memcpy", 20.0),
                    ("raw ucx", "raw", 0.06),
                    ("p2pkv ucx", "p2pkv", 0.04),
                ):
                    if impl == "memcpy" and conc != 1:
                        continue  # as the matrix runs it
                    rate = gbps * conc * (1 + block / (1 << 20))
                    rows.append(
                        CellResult(
                            series,
                            impl,
                            "ucx" if impl != "memcpy" else "memcpy",
                            block,
                            batch,
                            conc,
                            gbps=rate,
                            gbps_min=rate * 0.9,
                            gbps_max=rate * 1.1,
                        )
                    )
    return rows


def test_plot_shows_every_concurrency_on_log_axes_with_the_legend_outside(
    tmp_path: Path,
) -> None:
    pytest.importorskip("matplotlib")
    fig = figure(_synthetic_results(), "synthetic")
    axes = fig.axes
    assert sorted(ax.get_title() for ax in axes) == sorted(
        f"batch {b}, concurrency {c}" for b in (1, 16) for c in (1, 4)
    )
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
    assert "pip install 'p2pkv-tools[plot]'" in capsys.readouterr().err


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
    assert {t["blocks"] for t in measured} == {1, 16, 32}
    for t in measured:
        assert t["cpu_us_per_request"] == min(t["cpu_us_runs"]) > 0
        assert t["requests"] == 200
        assert t["repeats"] == len(t["cpu_us_runs"]) == 3
    assert "sweeps" not in doc  # the full form only
