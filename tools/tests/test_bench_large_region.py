"""``p2pkv bench --large-region``: a 6 GiB region per side, registered in slices, read
byte-exact near its start, past 4 GiB, across slice boundaries, at its end and scattered, on
nixl's direct lane (``cma``), nixl's staged lane (``UCX_TLS=tcp``) and ucx; and the flags'
misuses. Each lane's test prints its table (registration time, GB/s per offset class): a
reporting test, asserting bytes and behaviour, never a time.

The regions come from the transports' ``allocate_region`` and are never written whole, so
each side's resident memory stays far below the region (asserted: under 2 GiB each).
"""

from __future__ import annotations

import pytest
from p2pkv.cli import main
from p2pkv.registry import default_registry
from p2pkv.runs import SLICE_BYTES
from p2pkv_tools.bench.large_region import (
    DEFAULT,
    FOUR_GIB,
    GiB,
    LargeRegionConfig,
    MiB,
    offset_classes,
    render,
    run_large_region,
)

ODD_SLICE = GiB + 3 * MiB // 2
"""A slice size that is not a whole number of blocks: 1,025 blocks of 1 MiB per slice."""
CLASSES = {"start", "past 4 GiB", "across slices", "end", "scattered"}


def _usable(transport: str) -> bool:
    return default_registry().transport("data", transport).availability() is None


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("lane", ["nixl", "nixl-tcp", "ucx"])
def test_a_6_gib_region_in_slices_reads_byte_exact_at_every_offset(
    lane: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if not _usable("ucx" if lane == "ucx" else "nixl"):
        pytest.skip(f"{lane}: transport not installed here")
    monkeypatch.setenv("UCX_NET_DEVICES", "lo")
    config = LargeRegionConfig(
        region_bytes=6 * GiB,
        block_len=MiB,
        run_blocks=8,
        reps=1,
        slice_bytes=(DEFAULT, ODD_SLICE),
        lanes=(lane,),
    )
    doc = run_large_region(config, print)
    print(f"\n{render(doc)}")
    assert [row["slice_bytes"] for row in doc["rows"]] == [SLICE_BYTES, ODD_SLICE]
    assert [row["slices"] for row in doc["rows"]] == [2, 6]
    for row in doc["rows"]:
        assert row["error"] == "", row
        assert {c["name"] for c in row["classes"]} == CLASSES
        assert all(c["verified"] and c["bytes"] == 8 * MiB for c in row["classes"])
        assert max(row["rss"].values()) < 2 * GiB, row["rss"]  # untouched pages stay so
        assert min(row["create_ms"].values()) > 0


def test_the_offset_classes_cover_the_region_ends_4_gib_and_slice_boundaries() -> None:
    classes = {c.name: c for c in offset_classes(6144, MiB, 1025, 8)}
    assert classes["start"].remote == tuple(range(8))
    assert classes["past 4 GiB"].remote[0] * MiB == FOUR_GIB
    across = classes["across slices"]
    assert across.remote[0] < 1025 <= across.remote[-1]  # the producer's first boundary
    assert across.local[0] < 5125 <= across.local[-1]  # the consumer's last one
    assert classes["end"].remote[-1] == classes["end"].local[-1] == 6143
    scattered = classes["scattered"]
    assert len(set(scattered.remote)) == len(set(scattered.local)) == 8
    small = {c.name for c in offset_classes(64, MiB, 64, 8)}
    assert small == {"start", "mid-region", "end", "scattered"}  # one slice, below 4 GiB


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--lanes", "nixl"], "--lanes apply to --large-region only: add it"),
        (["--large-region", "--tier"], "--large-region is a mode of its own: drop --tier"),
        (["--large-region", "--lanes", "rdma"], "unknown lane(s) ['rdma']"),
        (
            ["--large-region", "--region", "64M", "--run-blocks", "16", "--block-sizes", "2M"],
            "holds fewer than 4 runs",
        ),
        (["--large-region", "--slice-bytes", "0"], "a slice size must be positive"),
    ],
)
def test_misuse_is_one_line_and_exit_2(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    try:
        status = main(["bench", *argv])
    except SystemExit as exited:  # argparse refuses a flag's value itself
        status = exited.code  # type: ignore[assignment]
    assert status == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(err) == 1 and says in err[0], err
