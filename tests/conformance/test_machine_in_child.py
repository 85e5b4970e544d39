"""A machine run in a child process (``p2pkv.testing.isolated``): a pass passes, a failure is
the child's failure, and a transport that segfaults is reported with the signal, the steps
that led to the crash (logged before each call) and the seed that replays them. The step log
works in-process too (``P2PKV_MACHINE_STEPS``)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing import steps
from p2pkv.testing.isolated import run_machine_in_child
from p2pkv.testing.stateful import DataTransportMachine

pytest.importorskip("p2pkv_loopback", reason="the example plugin (tests/example_plugin) is needed")
import broken
from p2pkv_loopback import LoopbackDataTransport

FEW = settings(max_examples=5, stateful_step_count=25, deadline=None, phases=[Phase.generate])


def machine(transport: type) -> Any:
    return type(
        f"{transport.__name__}Machine",
        (DataTransportMachine,),
        {"transport": transport, "timeout": 2.0},
    )


def test_a_passing_machine_passes_in_its_child() -> None:
    run_machine_in_child(machine(LoopbackDataTransport), settings=FEW, seed=1)


def test_a_failing_machine_reports_the_childs_failure() -> None:
    with pytest.raises(AssertionError, match=r"(?s)failed in its child.*seed=7.*reported done"):
        run_machine_in_child(machine(broken.EarlyDone), settings=FEW, seed=7)


def crash_report() -> str:
    with pytest.raises(AssertionError) as info:
        run_machine_in_child(machine(broken.CrashesOnThirdRead), settings=FEW, seed=3)
    return str(info.value)


def test_a_crash_is_reported_with_its_steps_and_seed() -> None:
    report = crash_report()
    assert "died of SIGSEGV" in report, report
    shown = report.split("logged before it ran:\n", 1)[1].splitlines()
    assert re.fullmatch(r"example \d+: state = CrashesOnThirdReadMachine\(\)", shown[0]), report
    reads = [line for line in shown if re.search(r"step \d+: read\(", line)]
    assert len(reads) == 3, report  # the third read crashed: it is logged, nothing after it
    assert "step" not in "".join(shown[shown.index(reads[-1]) + 1 :]), report
    assert "replay: run_machine_in_child(CrashesOnThirdReadMachine, seed=3)" in report
    assert crash_report() == report, "the same seed must replay the same steps"


def test_the_step_log_records_each_step_before_it_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    log = tmp_path / "steps.log"
    monkeypatch.setenv(steps.ENV, str(log))
    run_state_machine_as_test(
        machine(LoopbackDataTransport), settings=settings(FEW, max_examples=2)
    )
    lines = log.read_text().splitlines()
    assert lines[0] == "example 1: state = LoopbackDataTransportMachine()"
    assert any(line.startswith("example 2: ") for line in lines)
    assert any("step 1: " in line for line in lines) and "  step " in lines[-1]
    assert lines[-1].endswith("teardown()")
