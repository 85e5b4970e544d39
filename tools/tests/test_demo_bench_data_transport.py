"""``p2pkv demo`` and ``p2pkv bench`` run over the data transport's own memory and options.

The ``memory`` data transport is given an ``allocate_region`` of its own (``/dev/shm``-like
``mmap`` regions, recorded) and a ``create`` that refuses any other region, so a run passes
only when every region it registers came from ``allocate_region``, with ``--data-options``.
"""

from __future__ import annotations

import json
import mmap
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from p2pkv.cli import main
from p2pkv.contracts import DataSettings, DataTransport
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry

DEMO = [
    "demo",
    "--requests",
    "3",
    "--region",
    "16M",
    "--max-tokens",
    "256",
    "--quiet",
    "--data",
    "memory",
    "--control",
    "memory",
]
BENCH = [
    "bench",
    "--transports",
    "memory",
    "--no-raw",
    "--block-sizes",
    "64K",
    "--batches",
    "1,2",
    "--concurrency",
    "1",
    "--reps",
    "1",
    "--warmup",
    "0",
    "--region",
    "1M",
    "--bytes-per-rep",
    "256K",
]
OPTIONS = {"completion_polls": 1}


def _address(region: memoryview) -> int:
    return int(np.frombuffer(region, dtype=np.uint8).ctypes.data)


@dataclass
class OwnMemory:
    """What the patched memory transport allocated and registered."""

    allocated: dict[int, tuple[int, int, dict[str, Any]]] = field(default_factory=dict)
    """address -> (num_blocks, block_len, options) of every ``allocate_region``."""
    registered: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """(address, options) of every transport created."""

    def allocations(self, block_len: int) -> list[tuple[int, int, dict[str, Any]]]:
        return [a for a in self.allocated.values() if a[1] == block_len]


@pytest.fixture
def own_memory(monkeypatch: pytest.MonkeyPatch) -> OwnMemory:
    cls: Any = default_registry().transport("data", "memory")
    record = OwnMemory()
    real_create = cls.create.__func__

    def allocate_region(
        klass: type[DataTransport], num_blocks: int, block_len: int, options: Mapping[str, Any]
    ) -> memoryview:
        region = memoryview(mmap.mmap(-1, num_blocks * block_len))
        record.allocated[_address(region)] = (num_blocks, block_len, dict(options))
        return region

    def create(klass: type[DataTransport], settings: DataSettings) -> DataTransport:
        if _address(settings.region) not in record.allocated:
            raise ConfigError("this memory transport registers only regions it allocated")
        record.registered.append((_address(settings.region), dict(settings.options)))
        transport: DataTransport = real_create(klass, settings)
        return transport

    monkeypatch.setattr(cls, "allocate_region", classmethod(allocate_region))
    monkeypatch.setattr(cls, "create", classmethod(create))
    return record


# -- regions ---------------------------------------------------------------------------------


def test_demo_roles_register_the_transports_own_memory_with_the_options(
    own_memory: OwnMemory, tmp_path: Path
) -> None:
    out = tmp_path / "summary.json"
    code = main([*DEMO, "--json", str(out), "--data-options", json.dumps(OPTIONS)])
    assert code == 0
    summary = json.loads(out.read_text())
    assert summary["failures"] == 0 and summary["mismatched_blocks"] == 0
    block = summary["block_bytes"]
    roles = own_memory.allocations(block)
    assert len(roles) == 2, "one region per role, each from allocate_region"
    assert all(options == OPTIONS for _, _, options in roles)
    role_addresses = {a for a, (_, b, _) in own_memory.allocated.items() if b == block}
    tiers = [(a, o) for a, o in own_memory.registered if a in role_addresses]
    assert len(tiers) == 2 and all(o == OPTIONS for _, o in tiers)


def test_bench_p2pkv_series_register_the_transports_own_memory_with_the_options(
    own_memory: OwnMemory, tmp_path: Path
) -> None:
    out = tmp_path / "bench.json"
    code = main([*BENCH, "--json", str(out), "--data-options", json.dumps(OPTIONS)])
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["data_options"] == {"memory": OPTIONS}
    rows = [r for r in doc["rows"] if r["series"] == "p2pkv memory"]
    assert rows and all(r["verified"] and not r["error"] for r in rows)
    assert {r["series"] for r in doc["rows"]} == {"p2pkv memory", "memcpy"}
    # the initiator's region and the target's, 16 blocks of 64 KiB each; memcpy has its own
    assert own_memory.allocations(64 * 1024) == [(16, 64 * 1024, OPTIONS)] * 2
    measured = [o for a, o in own_memory.registered if own_memory.allocated[a][1] == 64 * 1024]
    assert measured == [OPTIONS, OPTIONS]


# -- --data-options misuse ---------------------------------------------------------------------


@pytest.mark.parametrize("value", ["{not json", "[1, 2]", '"text"', "@/nonexistent/options.json"])
@pytest.mark.parametrize("command", [DEMO, BENCH], ids=["demo", "bench"])
def test_data_options_that_are_not_a_json_object_are_one_line(
    command: list[str], value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--data-options", value]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith(f"p2pkv {command[0]}: --data-options")
    assert "e.g. --data-options" in err


@pytest.mark.parametrize("command", [DEMO, BENCH], ids=["demo", "bench"])
def test_an_unknown_data_option_is_the_transports_config_error(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert main([*command, "--data-options", '{"no_such_option": 1}']) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "no_such_option" in err


def test_data_options_are_read_from_a_file(tmp_path: Path) -> None:
    path = tmp_path / "options.json"
    path.write_text(json.dumps(OPTIONS))
    assert main([*DEMO, "--data-options", f"@{path}"]) == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["bench", "--data-options", json.dumps(OPTIONS)], "needs --transports"),
        (["bench", "--control", "--data-options", json.dumps(OPTIONS)], "--control"),
    ],
    ids=["without-transports", "with-control"],
)
def test_bench_data_options_need_the_transports_they_are_for(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("p2pkv bench: --data-options") and says in err


def test_bench_takes_each_transports_own_options_in_one_run(
    tmp_path: Path, own_memory: OwnMemory
) -> None:
    """``NAME=JSON`` (the flag repeats) gives each transport of ``--transports`` its own
    options in one comparison run: ``memory`` is built and allocates with its own, and the
    example plugin's ``loopback``, which refuses any option, with none."""
    pytest.importorskip("p2pkv_loopback", reason="the example plugin is needed")
    out = tmp_path / "bench.json"
    two = ["--transports", "memory,loopback", "--batches", "1", "--no-memcpy"]
    code = main(
        [
            *BENCH,
            *two,
            "--json",
            str(out),
            "--data-options",
            "{}",
            "--data-options",
            f"memory={json.dumps(OPTIONS)}",
        ]
    )
    assert code == 0
    doc = json.loads(out.read_text())
    assert doc["config"]["data_options"] == {"memory": OPTIONS, "loopback": {}}
    rows = [r for r in doc["rows"] if r["series"] in ("p2pkv memory", "p2pkv loopback")]
    assert {r["series"] for r in rows} == {"p2pkv memory", "p2pkv loopback"}
    assert all(r["verified"] and not r["error"] for r in rows)
    assert own_memory.registered and all(o == OPTIONS for _, o in own_memory.registered)


@pytest.mark.parametrize(
    ("values", "says"),
    [
        (["nixl={}"], "names 'nixl', which is not in --transports memory: add it there"),
        (["memory={}", "memory={}"], "names 'memory' twice"),
        (["{}", "{}"], "gives options for every transport twice"),
        (["memory=[1]"], "JSON object"),
    ],
    ids=["not in --transports", "twice", "plain twice", "not an object"],
)
def test_misnamed_per_transport_options_are_one_line(
    values: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*BENCH]
    for value in values:
        argv += ["--data-options", value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and says in err, err
