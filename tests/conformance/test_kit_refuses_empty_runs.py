"""A new author cannot get a green run that tested (nearly) nothing: a capability set, a
suite knob or a transport name that would make the data suite skip its tests fails them
instead, saying what to declare."""

from __future__ import annotations

import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("p2pkv_loopback", reason="the example plugin (tests/example_plugin) is needed")
from suite_runs import run_suites

SUITE_RUN = textwrap.dedent(
    """
    import broken
    from p2pkv.testing.suites import DataTransportSuite
    from p2pkv_loopback import LoopbackDataTransport

    class TestClaimsNoDram(DataTransportSuite):  # memory_kinds={"SHM"}: its /dev/shm memory
        transport = broken.ClaimsNoDram

    class TestNoWayToBuildAPeer(DataTransportSuite):  # not cross_process either
        transport = LoopbackDataTransport
        same_process_pairs = False

    class TestMisspeltName(DataTransportSuite):
        transport_name = "lopback"
    """
)


@pytest.mark.parametrize(
    ("cls", "says"),
    [
        ("TestClaimsNoDram", "memory_kinds must include 'DRAM'"),
        (
            "TestNoWayToBuildAPeer",
            "claim cross_process (peers then run in a child process) or allow same-process pairs",
        ),
        ("TestMisspeltName", "did you mean 'loopback'"),
    ],
)
def test_a_run_that_would_skip_the_pair_tests_fails_naming_the_fix(
    tmp_path: Path, cls: str, says: str
) -> None:
    outcomes, _ = run_suites(tmp_path, SUITE_RUN, timeout=300)
    results = list(outcomes[cls].values())
    assert results.count("failed") > results.count("passed") + results.count("skipped"), outcomes[
        cls
    ]
    messages = {
        problem.get("message", "")
        for case in ET.parse(tmp_path / "report.xml").iter("testcase")
        if case.get("classname", "").endswith(cls)
        for problem in [*case.iter("failure"), *case.iter("error")]
    }
    assert any(says in m for m in messages), messages
