"""``p2pkv demo``: real processes over the default transports, the one-process memory mode,
and the pieces that make its verdict trustworthy (presets, workload, byte check)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from p2pkv.cli import main
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry
from p2pkv_tools.demo.content import BlockRegion, key_seed
from p2pkv_tools.demo.presets import PRESETS, resolve_preset
from p2pkv_tools.demo.workload import ORDERS, PromptDistribution, make_stream, parse_orders

SMALL = ["--requests", "9", "--region", "64M", "--max-tokens", "384", "--quiet"]


def _run_demo(
    tmp_path: Path, *extra: str
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "summary.json"
    env = dict(os.environ, UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES", "lo"))
    proc = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "demo", *SMALL, "--json", str(out), *extra],
        capture_output=True,
        text=True,
        timeout=150,
        env=env,
        check=False,
    )
    summary = json.loads(out.read_text()) if out.exists() else {}
    return proc, summary


def _check_clean_run(proc: subprocess.CompletedProcess[str], summary: dict[str, Any]) -> None:
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert summary["requests"] == 9
    assert summary["failures"] == 0, summary["failure_details"]
    assert summary["mismatched_blocks"] == 0
    assert set(summary["by_order"]) == set(ORDERS)  # both arrival orders and symmetric lookups
    assert summary["blocks"] > 0
    assert summary["bytes"] == summary["blocks"] * summary["block_bytes"]
    assert "failures" in proc.stdout


def _installed(kind: str, name: str) -> bool:
    entry = default_registry().entries(kind).get(name)  # type: ignore[arg-type]
    return entry is not None and entry.cls.availability() is None


@pytest.mark.skipif(
    not (_installed("control", "zmq") and _installed("data", "nixl")),
    reason="needs the default transports (p2pkv-zmq, p2pkv-nixl)",
)
def test_demo_two_processes_default_transports(tmp_path: Path) -> None:
    proc, summary = _run_demo(tmp_path)
    _check_clean_run(proc, summary)
    assert summary["processes"] == 2
    assert (summary["control"], summary["data"]) == ("zmq", "nixl")


def test_demo_memory_data_is_one_process(tmp_path: Path) -> None:
    proc, summary = _run_demo(tmp_path, "--data", "memory", "--control", "memory")
    _check_clean_run(proc, summary)
    assert summary["processes"] == 1


def test_demo_fails_on_a_wrong_byte(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    real_verify = BlockRegion.verify

    def corrupt_then_verify(self: BlockRegion, slots: list[int], keys: list[bytes]) -> list[int]:
        self.words[slots[0], 0] ^= np.uint64(1)
        return real_verify(self, slots, keys)

    monkeypatch.setattr(BlockRegion, "verify", corrupt_then_verify)
    code = main(["demo", *SMALL, "--requests", "3", "--data", "memory", "--control", "memory"])
    assert code == 1
    assert "wrong bytes" in capsys.readouterr().out


def test_demo_names_the_package_of_a_missing_transport(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo", "--data", "no-such-transport", "--quiet"]) == 2
    assert "unknown data transport 'no-such-transport'" in capsys.readouterr().err


# -- presets, workload, content ------------------------------------------------------------


def test_preset_block_sizes_follow_the_formula() -> None:
    assert resolve_preset("llama-3-8b").block_bytes == 32 * 8 * 128 * 16 * 2 * 2  # 2 MiB
    assert resolve_preset("qwen3-8b").block_bytes == 36 * 8 * 128 * 16 * 2 * 2
    deepseek = resolve_preset("deepseek-v3")  # MLA: one latent (512 + 64) per token, no K/V pair
    assert deepseek.block_bytes == 61 * 1 * 576 * 16 * 2 * 1
    assert "MLA latent" in deepseek.formula()
    assert resolve_preset("llama-3-8b", tokens_per_block=32).block_bytes == 4 << 20
    assert resolve_preset("tiny", block_bytes=65536).block_bytes == 65536
    for preset in PRESETS.values():
        assert preset.block_bytes % 8 == 0
    assert resolve_preset("llama-3-8b-fp8").block_bytes == 1 << 20  # half of bf16
    assert resolve_preset("gpt-oss-120b").block_bytes == 36 * 8 * 64 * 16 * 2 * 2


def test_tensor_parallelism_sizes_the_chunk_of_every_rank() -> None:
    """A chunk holds every rank's heads: the same bytes while TP divides the KV heads, TP
    copies of one head beyond them; an MLA latent stays one copy."""
    base = resolve_preset("llama-3-8b").block_bytes
    assert resolve_preset("llama-3-8b", tp=4).block_bytes == base
    assert resolve_preset("llama-3-8b", tp=16).block_bytes == 2 * base  # 16 ranks x 1 head
    assert "TP 16: 1 per rank x 16" in resolve_preset("llama-3-8b", tp=16).formula()
    deepseek = resolve_preset("deepseek-v3")
    assert resolve_preset("deepseek-v3", tp=8).block_bytes == deepseek.block_bytes
    with pytest.raises(ConfigError, match="--tp 3: llama-3-8b has 8 KV heads"):
        resolve_preset("llama-3-8b", tp=3)


@pytest.mark.parametrize("kwargs", [{"block_bytes": 12}, {"tokens_per_block": 0}])
def test_bad_preset_overrides_are_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        resolve_preset("llama-3-8b", **kwargs)
    with pytest.raises(ConfigError, match="choose one of"):
        resolve_preset("gpt-17")


def test_stream_mixes_orders_and_clips_lengths() -> None:
    stream = make_stream(
        10,
        PromptDistribution.parse("lognormal:1024:1.5"),
        tokens_per_block=16,
        max_blocks=40,
        orders=parse_orders("consumer_first=2,producer_first=2,symmetric=1"),
    )
    assert [r.order for r in stream].count("symmetric") == 2
    assert {r.order for r in stream} == set(ORDERS)
    assert all(1 <= r.num_blocks <= 40 for r in stream)
    keys = [k for r in stream for k in r.keys]
    assert len(keys) == len(set(keys))
    for r in stream:
        assert r.hits == (r.num_blocks if r.order != "symmetric" else max(1, r.num_blocks * 3 // 4))


@pytest.mark.parametrize("text", ["normal:1:2", "uniform:9:3", "fixed:-1", "lognormal:x:1"])
def test_bad_prompt_distributions_are_refused(text: str) -> None:
    with pytest.raises(ConfigError):
        PromptDistribution.parse(text)


def test_content_check_catches_wrong_key_slot_and_stale_bytes() -> None:
    region = BlockRegion(np.zeros(8 * 64, np.uint8), 64)
    keys = [b"a", b"b", b"c"]
    region.fill([1, 2, 3], keys)
    assert region.verify([1, 2, 3], keys) == []
    assert region.verify([1], [b"a"]) == [1], "verification consumes the slot"
    region.fill([4, 5], [b"x", b"y"])
    assert region.verify([5, 4], [b"x", b"y"]) == [5, 4], "swapped slots"
    region.fill([6], [b"z"])
    region.words[6, 7] ^= np.uint64(1 << 63)
    assert region.verify([6], [b"z"]) == [6], "one flipped bit"
    assert key_seed(b"") & 1
