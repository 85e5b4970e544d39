"""The UCX lane probe, the READ throughput harness and the raw WRITE baseline (behaviour
only: timings are not asserted)."""

from __future__ import annotations

import numpy as np
import pytest
from p2pkv.contracts import DataSettings
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport
from p2pkv_nixl.baseline import RawNixl, RawNixlWrite, measure, run_memcpy
from p2pkv_nixl.ucx import proto_tables, ucx_lanes

SAMPLE = """\
[1795947060.750159] [vm:9694 :0]   +--------+-------------+-----------------------------------+
[1795947060.750159] [vm:9694 :0]   | A self cfg#0                                             |
[1795947060.750159] [vm:9694 :0]   | remote memory write by ucp_put* from host memory to host |
[1795947060.750159] [vm:9694 :0]   +--------+-------------+-----------------------------------+
[1795947060.750159] [vm:9694 :0]   | Range  | Description |              Config               |
[1795947060.750159] [vm:9694 :0]   +--------+-------------+-----------------------------------+
[1795947060.750159] [vm:9694 :0]   | 0..inf | zero-copy   | self/memory                       |
[1795947060.750159] [vm:9694 :0]   +--------+-------------+-----------------------------------+
some unrelated line | with a pipe
[1795947062.637840] [vm:9719 :0]   | A intra-node cfg#1                                       |
[1795947062.637840] [vm:9719 :0]   | remote memory write by ucp_put* from host memory to host |
[1795947062.637840] [vm:9719 :0]   | Range  | Description |              Config               |
[1795947062.637840] [vm:9719 :0]   | 0..inf | zero-copy   | cma/memory                        |
[1795947062.639939] [vm:9719 :0]   | A intra-node cfg#1                              |
[1795947062.639939] [vm:9719 :0]   | active message by ucp_am_send* from host memory |
[1795947062.639939] [vm:9719 :0]   +------------+--------------------+---------------+
[1795947062.639939] [vm:9719 :0]   |   Range    |    Description     |    Config     |
[1795947062.639939] [vm:9719 :0]   +------------+--------------------+---------------+
[1795947062.639939] [vm:9719 :0]   |          0 | short              | tcp/lo        |
[1795947062.639939] [vm:9719 :0]   | 16516..inf | multi-frag copy-in | tcp/lo        |
"""


def test_proto_tables() -> None:
    tables = proto_tables(SAMPLE)
    assert [t["scope"] for t in tables] == ["intra-node", "intra-node"]  # self left out
    put = tables[0]
    assert put["operation"].startswith("remote memory write")
    assert put["rows"] == [{"range": "0..inf", "protocol": "zero-copy", "lane": "cma/memory"}]
    assert [r["lane"] for r in tables[1]["rows"]] == ["tcp/lo", "tcp/lo"]


def test_ucx_lanes_probe_reports_the_read_lane() -> None:
    report = ucx_lanes()
    assert report["ok"], report["error"]
    assert report["get"], report
    assert report["lane"] == "direct"  # a same-host peer over default UCX: read by cma
    assert report["env"]["UCX_RCACHE_MAX_UNRELEASED"]
    assert report["env"]["UCX_NET_DEVICES"] == "lo"


def test_ucx_lanes_over_tcp_report_staged_reads(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "tcp")
    report = ucx_lanes()
    assert report["ok"], report["error"]
    assert all("tcp" in lane for lane in report["get"]), report["get"]
    assert report["lane"] == "staged"


def test_ucx_lanes_reports_a_failing_setup(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UCX_TLS", "cma")  # no active-message transport: agent creation fails
    report = ucx_lanes()
    assert not report["ok"]
    assert "UCX_TLS" in report["error"]


def test_measure_raw_and_transport_side_by_side_with_verified_bytes() -> None:
    cpu: dict[str, list[float]] = {}
    times = measure({"raw": RawNixl, "p2pkv": NixlDataTransport}, 4096, 32, 3, 1, cpu=cpu)
    assert set(times) == set(cpu) == {"raw", "p2pkv"}
    assert all(len(v) == 3 and min(v) > 0 for v in times.values())
    assert all(len(v) == 3 for v in cpu.values())
    assert len(run_memcpy(4096, 32, 2, 1)) == 2


def test_raw_write_lands_what_the_reader_asked_for_in_its_slots() -> None:
    """``raw nixl write`` (RawNixl's ``write`` variant): the reader's ``read_blocks`` asks,
    the source's ``progress`` WRITEs into the reader's slots, the reader's ``poll`` reports
    it done once the WRITE's notification arrived, with every byte in place."""
    assert RawNixl.variants == {"write": RawNixlWrite}
    block, blocks = 4096, 32
    source = np.random.default_rng(3).integers(0, 256, (blocks, block), dtype=np.uint8)
    dest = np.zeros_like(source)
    writer = RawNixlWrite.create(DataSettings(source.data.cast("B"), block))
    reader = RawNixlWrite.create(DataSettings(dest.data.cast("B"), block))
    try:
        reader.add_peer("source", writer.descriptor())
        writer.add_peer("reader", reader.descriptor())
        local, remote = [5, 3, 9, 10, 11, 31], [0, 1, 2, 3, 30, 7]
        ids = [reader.read_blocks("source", local, remote), reader.read_blocks("source", [0], [0])]
        done: list[int] = []

        def reported() -> bool:
            writer.progress()
            result = reader.poll("source")
            assert not result.failed and writer.poll("reader") == ([], [])
            done.extend(result.done)
            return len(done) == len(ids)

        wait_until(reported, timeout=15.0, what="both requests to be reported")
        assert sorted(done) == sorted(ids)
        np.testing.assert_array_equal(dest[local], source[remote])
        np.testing.assert_array_equal(dest[0], source[0])
        assert reader.poll("source") == ([], [])  # each reported once
    finally:
        reader.close()
        writer.close()
