"""``p2pkv doctor``: names the transports, explains the missing ones, checks ports and lanes."""

from __future__ import annotations

import json
import socket

import p2pkv_tools.doctor as doctor
import pytest
from p2pkv.cli import main
from p2pkv.hookspecs import CheckResult, DoctorCheck, hookimpl
from p2pkv.registry import Registry, default_registry
from p2pkv_tools.doctor import (
    _probe_child,
    check_ports,
    nixl_install_note,
    parse_proto_info,
    plugin_checks,
    summarize_lanes,
)

# Two boxes as UCX_PROTO_INFO=y prints them (timestamps and padding as UCX writes them).
PROTO_INFO = """\
[1795947197.677002] [vm:11792:0]   +--------+-------------+------------+
[1795947197.677002] [vm:11792:0]   | A self cfg#0                        |
[1795947197.677002] [vm:11792:0]   | remote memory write by ucp_put* from host memory to host |
[1795947197.677002] [vm:11792:0]   +--------+-------------+------------+
[1795947197.677002] [vm:11792:0]   | Range  | Description | Config     |
[1795947197.677002] [vm:11792:0]   +--------+-------------+------------+
[1795947197.677002] [vm:11792:0]   | 0..inf | zero-copy   | self/memory |
[1795947197.677002] [vm:11792:0]   +--------+-------------+------------+
[1795947197.681946] [vm:11792:0]   +--------+-------------+------------+
[1795947197.681946] [vm:11792:0]   | A intra-node cfg#1                  |
[1795947197.681946] [vm:11792:0]   | remote memory write by ucp_put* from host memory to host |
[1795947197.681946] [vm:11792:0]   +--------+-------------+------------+
[1795947197.681946] [vm:11792:0]   | Range  | Description | Config     |
[1795947197.681946] [vm:11792:0]   +--------+-------------+------------+
[1795947197.681946] [vm:11792:0]   | 0..inf | zero-copy   | cma/memory |
[1795947197.681946] [vm:11792:0]   +--------+-------------+------------+
[1795947197.684501] [vm:11792:0]   | A intra-node cfg#1                  |
[1795947197.684501] [vm:11792:0]   | active message by ucp_am_send* from host memory |
[1795947197.684501] [vm:11792:0]   +-----------+--------------------+-----+
[1795947197.684501] [vm:11792:0]   |   Range   |    Description     | Config |
[1795947197.684501] [vm:11792:0]   |   0..8184 | short              | tcp/lo |
[1795947197.684501] [vm:11792:0]   | 8185..inf | multi-frag copy-in | tcp/lo |
"""


def test_parse_proto_info_keeps_peer_endpoints() -> None:
    rows = parse_proto_info(PROTO_INFO)
    assert [(r.endpoint, r.size_range, r.lanes) for r in rows] == [
        ("A intra-node cfg#1", "0..inf", "cma/memory"),
        ("A intra-node cfg#1", "0..8184", "tcp/lo"),
        ("A intra-node cfg#1", "8185..inf", "tcp/lo"),
    ]
    summary = summarize_lanes(rows)
    assert summary[0] == {
        "operation": "RMA write (data)",
        "size_range": "0..inf",
        "protocol": "zero-copy",
        "lanes": "cma/memory",
    }
    assert summary[1]["operation"].startswith("active messages")
    assert summary[1]["protocol"] == "short, multi-frag copy-in"


# The one-line title layout of UCX 1.21 (ucxx), with a variant table that is left out.
PROTO_INFO_121 = """\
[1] [vm:1:0] +----------------------+--------------------------+
[1] [vm:1:0] | ctx_0 intra-node cfg#0 | tagged message by ucp_tag_send* |
[1] [vm:1:0] +----------------------+------------------+--------+
[1] [vm:1:0] |                    0 | eager short      | tcp/lo |
[1] [vm:1:0] |           16353..inf | rendezvous fragmented | tcp/lo |
[1] [vm:1:0] +----------------------+------------------+--------+
[1] [vm:1:0] | ctx_0 intra-node cfg#0 | tagged message by ucp_tag_send*(multi) |
[1] [vm:1:0] |              0..8184 | eager short      | tcp/lo |
"""


def test_parse_proto_info_one_line_titles() -> None:
    rows = parse_proto_info(PROTO_INFO_121)
    assert len(rows) == 3
    summary = summarize_lanes(rows)
    assert [(r["operation"], r["size_range"], r["lanes"]) for r in summary] == [
        ("tagged send (data)", "0", "tcp/lo"),
        ("tagged send (data)", "16353..inf", "tcp/lo"),
    ]


def test_lane_probe_reads_one_block_and_checks_its_bytes(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    if "memory" not in default_registry().entries("data"):
        pytest.skip("the memory data transport is not installed")
    _probe_child("memory")  # the probe body, in this process, over the in-process transport
    assert capsys.readouterr().out.strip() == "PROBE-OK"

    def lands_nothing(src: object, dst: object, timeout: float) -> None:
        """A read reported done whose bytes never landed."""

    monkeypatch.setattr(doctor, "_probe_read", lands_nothing)
    _probe_child("memory")
    assert "bytes differ" in capsys.readouterr().out


def test_port_in_use_is_reported() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        (result,) = check_ports("127.0.0.1", [port])
        assert not result["free"]
        assert "in use" in result["detail"]
    (result,) = check_ports("127.0.0.1", [0])
    assert result["free"]


def test_nixl_note_explains_the_install() -> None:
    assert "NIXL" in nixl_install_note()


def test_doctor_json_names_the_transports(capsys: pytest.CaptureFixture[str]) -> None:
    # an ephemeral port, so a tier running elsewhere on this host does not fail the test
    assert main(["doctor", "--json", "--config", '{"port": 0}']) == 0
    report = json.loads(capsys.readouterr().out)
    names = {(t["kind"], t["name"]) for t in report["plugins"]["transports"]}
    for kind in ("control", "data"):
        assert set(default_registry().entries(kind)) == {n for k, n in names if k == kind}
    missing = {t["name"] for t in report["plugins"]["not_installed"]}
    assert all(t["install"].startswith("pip install") for t in report["plugins"]["not_installed"])
    assert names or missing
    for name, probe in report["ucx_lanes"].items():
        # every installed UCX-based data transport got probed, and UCX said which lanes
        assert probe["ok"], (name, probe["error"])
        assert any("data" in row["operation"] for row in probe["lanes"]), name
    assert report["ports"][0]["free"]


def test_doctor_text_output(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-probe", "--config", '{"port": 0}']) == 0
    out = capsys.readouterr().out
    assert "p2pkv transports" in out
    assert "NIXL" in out


def test_doctor_refuses_a_bad_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["doctor", "--no-probe", "--config", '{"bogus": 1}']) == 2
    assert "bogus" in capsys.readouterr().err


class Checks:
    P2PKV_PLUGIN_API = 1

    @hookimpl
    def p2pkv_doctor_checks(self) -> list[object]:
        return [
            DoctorCheck("fine", lambda: CheckResult(True)),
            "not a check",
            DoctorCheck("wrong result", lambda: "ok"),  # type: ignore[arg-type,return-value]
        ]


class RaisingChecks:
    P2PKV_PLUGIN_API = 1

    @hookimpl
    def p2pkv_doctor_checks(self) -> list[DoctorCheck]:
        raise ImportError("no module named 'gone'")


def test_plugin_checks_report_every_plugins_failures_as_rows() -> None:
    registry = Registry.from_plugins(
        [("raising", RaisingChecks()), ("checks", Checks())], environ={}
    )
    rows = {(r["plugin"], r["check"]): (r["ok"], r["detail"]) for r in plugin_checks(registry)}
    assert rows == {
        ("raising", "p2pkv_doctor_checks"): (
            False,
            "the hook raised ImportError: no module named 'gone'",
        ),
        ("checks", "fine"): (True, ""),
        ("checks", "'not a check'"): (False, "'not a check' is not a p2pkv.hookspecs.DoctorCheck"),
        ("checks", "wrong result"): (False, "the check returned 'ok', not a CheckResult"),
    }
