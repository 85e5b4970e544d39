"""``p2pkv bench --tier``: the quick tier matrix runs end to end over two real tiers (zmq
control + nixl data, two processes), every cell in both arrival orders moves verified bytes,
a wrong byte fails its cell, and every misuse of the tier flags ends in one line (the
``--netns``/``--rate`` ones that need no root too; the namespaced run itself is in the chaos
suite, ``tests/chaos/test_bench_tier_netns.py``).

Benchmarks are not tests: nothing here looks at a rate or a latency value, only at structure
and verification.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from p2pkv.cli import main
from p2pkv.registry import default_registry
from p2pkv_tools.bench.cli import QUICK
from p2pkv_tools.bench.netns import Link, Placement, Traffic
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.tier_lane import ORDERS, TierLane
from p2pkv_tools.bench.tier_rounds import (
    ROUNDS,
    cell_steps,
    merge_rounds,
    pair_ratios,
    reps_per_round,
)

Doc = tuple[dict[str, Any], Path]
"""The quick run's JSON document and where its plot went."""

TIER_KEYS = {
    "order",
    "producer_cpu_us",
    "consumer_cpu_us",
    "descriptors_per_request",
    "raw_series",
    "ratios_raw",
    "pair_ratios",
}


def _needs_nixl_and_zmq() -> None:
    registry = default_registry()
    for kind, name in (("data", "nixl"), ("control", "zmq")):
        entry = registry.entries(kind).get(name)  # type: ignore[arg-type]
        if entry is None or entry.cls.availability() is not None:
            pytest.skip(f"needs the {name} {kind} transport")


@pytest.fixture(scope="module")
def tier_doc(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path]:
    _needs_nixl_and_zmq()
    out = tmp_path_factory.mktemp("tier") / "tier.json"
    png = out.with_suffix(".png")
    args = [
        "bench",
        "--tier",
        "--quick",
        "--json",
        str(out),
        "--recompute-rate",
        "20000",
        "--preset",
        "qwen2.5-7b",
    ]
    try:
        import matplotlib  # noqa: F401

        args += ["--plot", str(png)]
    except ImportError:
        pass
    assert main(args) == 0
    return json.loads(out.read_text()), png


def test_quick_json_has_every_cell_in_both_orders(tier_doc: Doc) -> None:
    doc, _ = tier_doc
    assert doc["tier"]["control"] == "zmq" and doc["tier"]["data"] == ["nixl"]
    cells = {(r["block_size"], r["batch"], r["concurrency"]) for r in doc["rows"]}
    assert len(cells) == 8  # 2 block sizes x 2 batches x 2 concurrencies
    for cell in cells:
        orders = sorted(
            r["order"]
            for r in doc["rows"]
            if (r["block_size"], r["batch"], r["concurrency"]) == cell
        )
        assert orders == sorted(ORDERS)
    for row in doc["rows"]:
        assert set(row) >= TIER_KEYS
        assert row["impl"] == "tier" and row["series"] == f"tier nixl {row['order']}"


def test_every_tier_cell_moved_verified_bytes(tier_doc: Doc) -> None:
    doc, _ = tier_doc
    assert doc["verified"] is True
    for row in doc["rows"]:
        assert row["error"] == "" and row["verified"], row
        assert row["bytes_verified"] > 0
        assert row["p50_us"] > 0 and row["p99_us"] >= row["p50_us"]
        assert row["producer_cpu_us"] > 0 and row["consumer_cpu_us"] > 0


def test_descriptors_per_request_come_from_the_tier_stats(tier_doc: Doc) -> None:
    """nixl counts its descriptors (``DataTransport.descriptors_posted``, passed on by
    ``P2PTier.stats``): at least one per request, at most one per block (runs coalesce)."""
    for row in tier_doc[0]["rows"]:
        per_request = row["descriptors_per_request"]
        assert per_request is not None, row
        assert 1 <= per_request <= row["batch"], row


def test_first_pulls_are_reported_cold_after_connect_and_after_discovery(tier_doc: Doc) -> None:
    """One fresh pair of each kind per data transport (--quick), every pull verified; the
    discovered pair met through ``peers.connect`` naming the producer by host name."""
    (first,) = tier_doc[0]["first_pull"]
    assert first["transport"] == "nixl" and first["errors"] == []
    samples = first["samples"]
    assert {k: len(v) for k, v in samples.items()} == {
        "cold_ms": 1,
        "handshake_ms": 1,
        "after_connect_ms": 1,
        "connect_ms": 1,
        "after_discovery_ms": 1,
        "discovery_ms": 1,
    }
    assert first["first_pull_ms"] == samples["cold_ms"][0] > 0
    assert 0 < first["first_pull_handshake_ms"] <= first["first_pull_ms"]
    assert first["first_pull_after_connect_ms"] > 0 and first["connect_ms"] > 0
    assert first["first_pull_after_discovery_ms"] > 0 and first["discovery_ms"] > 0


RAW = ("raw nixl", "raw nixl write")
"""The raw NIXL baselines: the reader's READ, and the source's WRITE the reader asks for."""


def test_both_raw_baselines_move_verified_bytes_in_the_same_run(tier_doc: Doc) -> None:
    doc, _ = tier_doc
    series = {r["series"] for r in doc["baseline_rows"]}
    assert series <= {*RAW, "memcpy"} and "memcpy" in series
    if series & set(RAW):
        assert set(RAW) <= series
    for row in doc["baseline_rows"]:
        assert row["error"] == "" and row["verified"] and row["bytes_verified"] > 0, row


def test_ratios_come_from_rounds_paired_in_the_same_cell(tier_doc: Doc) -> None:
    """Each tier row's ratio to a raw series is the median of its rounds' ratios, each
    round's tier GB/s over that series' in the same round (``pair_ratios``); ``ratio_raw``
    is the lowest, to the series named in ``raw_series``. ``--quick`` runs one timed
    repetition per round, so a round's rate is its entry in ``rep_gbps``."""
    doc, _ = tier_doc
    per_round = reps_per_round(QUICK.reps)
    assert per_round == 1
    raw_rows = {
        (r["series"], r["block_size"], r["batch"], r["concurrency"]): r
        for r in doc["baseline_rows"]
        if r["gbps"] > 0 and r["impl"] == "raw"
    }
    for r in raw_rows.values():
        assert r["reps"] == ROUNDS * per_round and len(r["rep_gbps"]) == ROUNDS
    for row in doc["rows"]:
        assert row["ratio_memcpy"] is not None
        assert len(row["rep_gbps"]) == ROUNDS
        cell = (row["block_size"], row["batch"], row["concurrency"])
        measured = {s: raw_rows[(s, *cell)] for s in RAW if (s, *cell) in raw_rows}
        assert set(row["pair_ratios"]) == set(row["ratios_raw"]) == set(measured)
        if not measured:
            assert row["ratio_raw"] is None and row["raw_series"] is None
            continue
        for series, pairs in row["pair_ratios"].items():
            rounds = zip(row["rep_gbps"], measured[series]["rep_gbps"], strict=True)
            assert pairs == pytest.approx([t / r for t, r in rounds])
            assert row["ratios_raw"][series] == pytest.approx(float(np.median(pairs)))
        assert row["ratio_raw"] == min(row["ratios_raw"].values())
        assert row["ratios_raw"][row["raw_series"]] == row["ratio_raw"]


def test_raw_and_tier_alternate_round_by_round() -> None:
    """Every round of a cell holds each raw series and each arrival order once, raw first
    in even rounds and the tier first in odd ones (ABBA); memcpy once, at concurrency 1."""
    raw = ["raw nixl", "raw nixl write"]
    steps = cell_steps(1, raw, ORDERS, memcpy=True, rounds=4)
    kinds = [s.kind for s in steps]
    base = ["raw", "raw"]
    assert kinds == [
        *base, "memcpy", "tier", "tier",
        "tier", "tier", *base,
        *base, "tier", "tier",
        "tier", "tier", *base,
    ]  # fmt: skip
    assert [s.round for s in steps] == [0] * 5 + [1] * 4 + [2] * 4 + [3] * 4
    for r in range(4):
        own = [s.label for s in steps if s.round == r and s.kind != "memcpy"]
        assert sorted(own) == sorted([*raw, *ORDERS])
    assert all(s.concurrency == 1 for s in steps)
    four = cell_steps(4, raw, ORDERS, memcpy=True)
    assert "memcpy" not in [s.kind for s in four] and len(four) == ROUNDS * 4
    alone = cell_steps(1, [], ORDERS, memcpy=True)
    assert [(s.kind, s.round) for s in alone] == [("tier", 0), ("tier", 0)]


def test_rounds_merge_into_one_row() -> None:
    """Rates pool across rounds; bytes and repetitions add up; an error names its round;
    pairs skip a round either side measured nothing."""

    def part(rates: list[float], error: str = "", p50: float = 10.0) -> CellResult:
        return CellResult(
            "s", "raw", "nixl", 65536, 4, 1, requests=8, reps=len(rates), gbps=max(rates),
            p50_us=p50, p99_us=2 * p50, mean_us=p50, bytes_moved=100, bytes_verified=100,
            verified=not error, error=error, rep_gbps=rates,
        )  # fmt: skip

    merged = merge_rounds([part([1.0, 2.0]), part([3.0], "1 wrong blocks", p50=30.0)])
    assert merged.rep_gbps == [1.0, 2.0, 3.0] and merged.gbps == 2.0
    assert (merged.gbps_min, merged.gbps_max, merged.reps) == (1.0, 3.0, 3)
    assert merged.p50_us == 20.0 and merged.p99_us == 60.0
    assert merged.bytes_moved == merged.bytes_verified == 200
    assert not merged.verified and merged.error == "round 1: 1 wrong blocks"
    tier = [part([2.0]), part([0.0]), part([3.0])]
    raw = {"raw nixl": [part([4.0]), part([4.0]), part([2.0])], "raw x": [part([0.0])] * 3}
    assert pair_ratios(tier, raw) == {"raw nixl": [0.5, 1.5]}


def test_crossover_is_reported_per_order(tier_doc: Doc) -> None:
    cross = tier_doc[0]["crossover"]
    assert cross["preset"] == "qwen2.5-7b"
    assert cross["bytes_per_token"] == 28 * 4 * 128 * 2 * 2  # layers x kv heads x dim x K,V x bf16
    assert sorted(o["order"] for o in cross["orders"]) == sorted(ORDERS)
    for o in cross["orders"]:
        assert (o["tokens"] is None) == ("why" in o)
        if o["tokens"] is None:
            continue
        model = o["cost_model"]  # the same fit in llm-d's router units
        assert model["prefillMicrosecondsPerToken"] == 50.0  # 1 / 20,000 tokens/s
        assert model["transferFixedMs"] == pytest.approx(max(o["fixed_us"], 0) / 1000, abs=1e-3)
        assert model["minCachedTokenDelta"] == max(1, o["tokens"])
        if o["gbps_marginal"]:
            per_token_us = cross["bytes_per_token"] / (o["gbps_marginal"] * 1e9) * 1e6
            assert model["transferMicrosecondsPerToken"] == pytest.approx(per_token_us, abs=1e-4)


def test_the_cost_model_prints_as_router_yaml() -> None:
    from p2pkv_tools.bench.tier_report import print_cost_model
    from rich.console import Console

    console = Console(record=True, width=200)
    model = {
        "prefillMicrosecondsPerToken": 50.0,
        "transferMicrosecondsPerToken": 0.0153,
        "transferFixedMs": 0.742,
        "minCachedTokenDelta": 22,
    }
    print_cost_model(
        console,
        {
            "preset": "llama-3-8b",
            "recompute_tokens_per_s": 20000,
            "orders": [
                {"order": ORDERS[0], "cost_model": model},
                {"order": ORDERS[1], "tokens": None, "why": "x"},
            ],
        },
    )
    lines = console.export_text().splitlines()
    assert lines[1:6] == [
        "minCachedTokenDelta: 22",
        "costModel:",
        "  prefillMicrosecondsPerToken: 50.0",
        "  transferMicrosecondsPerToken: 0.0153",
        "  transferFixedMs: 0.742",
    ]
    assert lines[0].startswith("# llm-d EPP") and lines[6].lstrip().startswith("# sourceWaitMs")
    assert len(lines) == 7  # nothing for an order without a fit


def test_plot_is_written(tier_doc: Doc) -> None:
    pytest.importorskip("matplotlib")
    assert tier_doc[1].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


class _WrongSource(TierLane):
    """Writes other content into the producer's slots than the runner will check for."""

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        super().fill(slots, [s ^ 2 for s in seeds])


def test_a_wrong_byte_fails_the_cell(monkeypatch: pytest.MonkeyPatch) -> None:
    _needs_nixl_and_zmq()
    monkeypatch.setenv("UCX_NET_DEVICES", os.environ.get("UCX_NET_DEVICES", "lo"))
    lane = _WrongSource("zmq", "nixl", 4 * 1024 * 1024, timeout=60.0)
    plan = CellPlan(
        block_size=64 * 1024, batch=2, concurrency=1, requests=2, reps=1, warmup=0, rep_seconds=0.1
    )
    try:
        lane.open(plan.block_size)
        result = measure_cell(lane, plan, np.random.default_rng(0))
    finally:
        lane.close()
    assert not result.verified and result.bytes_verified == 0
    assert "wrong blocks" in result.error


MISUSES = {
    "rate not positive": (("--tier", "--recompute-rate", "0"), "--recompute-rate"),
    "rate not a number": (("--tier", "--recompute-rate", "fast"), "--recompute-rate"),
    "preset without rate": (("--tier", "--preset", "llama-3-8b"), "--recompute-rate"),
    "unknown preset": (("--tier", "--recompute-rate", "1", "--preset", "gpt"), "--preset"),
    "rate without tier": (("--recompute-rate", "100"), "add --tier"),
    "tier control without tier": (("--tier-control", "zmq"), "add --tier"),
    "tier and control": (("--tier", "--control"), "--tier and --control"),
    "process-local data": (("--tier", "--transports", "memory"), "--transports memory"),
    "process-local control": (("--tier", "--tier-control", "memory"), "--tier-control memory"),
    "tc rate without netns": (("--tier", "--rate", "25gbit"), "add --netns"),
    "netns without tier": (("--netns",), "--netns is an option of the tier bench"),
    "tc rate not a rate": (("--tier", "--netns", "--rate", "fast"), "--rate"),
    "tc rate zero": (("--tier", "--netns", "--rate", "0gbit"), "--rate"),
    "netns without ip": (("--tier", "--netns"), "--netns needs root and iproute2 (ip, tc): "),
}
NO_TOOLS = {"netns without ip"}
"""Cases run with an empty PATH: no ``ip``, no ``tc`` (as root the link is then refused for
the missing ``ip``; otherwise for not being root: one line either way, nothing built)."""


@pytest.mark.parametrize("case", sorted(MISUSES))
def test_misuse_ends_in_one_line(case: str, tmp_path: Path) -> None:
    args, named = MISUSES[case]
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PKV_")}
    env.update(COLUMNS="60", UCX_NET_DEVICES="lo")
    if case in NO_TOOLS:
        env["PATH"] = str(tmp_path)
    proc = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "bench", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1 and named in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout


def test_netns_not_as_root_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _needs_nixl_and_zmq()
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["bench", "--tier", "--netns", "--quick"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [
        "p2pkv bench: --netns needs root and iproute2 (ip, tc): this process "
        "runs as uid 1000, not root"
    ]


def test_traffic_adds_up_a_phase_entered_in_turns(monkeypatch: pytest.MonkeyPatch) -> None:
    """A phase entered again adds to its count (the engine bench counts each tier over its
    turns); a reading ``ip`` cannot give makes that phase None from then on."""
    end = Placement("ns", "dev", "10.0.0.1")
    readings = iter([100, 150, 150, None, 175, 200, 300, 310])
    monkeypatch.setattr(Link, "sent_bytes", lambda self: next(readings))
    traffic = Traffic(Link(end, end))
    for name in ("a", "b", "a", "b"):
        with traffic.phase(name):
            pass
    assert traffic.phases == {"a": 50 + 25, "b": None}
