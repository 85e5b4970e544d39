"""The no-code route: ``pytest --p2pkv-transport NAME`` runs the suites over an installed
transport found through its entry point (here the example plugin's ``loopback``), and a name
that is not installed fails with the registry's hint."""

from __future__ import annotations

import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("p2pkv_loopback", reason="the example plugin (tests/example_plugin) is needed")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> tuple[subprocess.CompletedProcess[str], Path]:
    tmp = tmp_path_factory.mktemp("by_name")
    report = tmp / "report.xml"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=short",
            "--p2pkv-transport",
            "loopback",
            "--p2pkv-transport",
            "lopback",
            "-k",
            "loopback or (lopback and shape)",  # the misspelt name: one test is enough
            f"--junitxml={report}",
            "--rootdir",
            str(tmp),
        ],
        cwd=tmp,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert report.exists(), f"no report:\n{proc.stdout}\n{proc.stderr}"
    return proc, report


def cases(report: Path, name: str) -> dict[str, ET.Element]:
    return {
        f"{c.get('classname', '').rsplit('.', 1)[-1]}::{c.get('name')}": c
        for c in ET.parse(report).iter("testcase")
        if f"[{name}" in (c.get("name") or "")
    }


def failed_case(case: ET.Element) -> bool:
    return case.find("failure") is not None or case.find("error") is not None


def test_an_installed_transport_passes_by_name(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    _, report = run
    found = cases(report, "loopback")
    kinds = {key.split("::")[0] for key in found}
    assert kinds == {
        "TestControlTransport",
        "TestDataTransport",
        "TestControlMachine",
        "TestDataMachine",
    }, "both kinds should run, suite and state machine"
    failed = [k for k, c in found.items() if failed_case(c)]
    assert not failed, failed
    passed = [k for k, c in found.items() if c.find("skipped") is None]
    assert len(passed) > 40


def test_an_unknown_name_fails_with_the_registry_hint(
    run: tuple[subprocess.CompletedProcess[str], Path],
) -> None:
    proc, report = run
    found = cases(report, "lopback")
    assert found and all(failed_case(c) for c in found.values())  # one per kind
    assert "did you mean 'loopback'" in proc.stdout
    assert proc.returncode != 0


def test_a_kind_not_asked_for_is_deselected(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--co",
            "--p2pkv-transport",
            "loopback",
            "--p2pkv-kind",
            "data",
            "--rootdir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout
    assert "TestDataTransport" in proc.stdout and "TestDataMachine" in proc.stdout
    assert "Control" not in proc.stdout.replace("deselected", ""), proc.stdout
    assert "deselected" in proc.stdout and "skipped" not in proc.stdout


def test_the_machines_run_in_a_child_on_request(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "--tb=short",
            "--p2pkv-transport",
            "loopback",
            "--p2pkv-machine-child",
            "-k",
            "Machine",
            "--rootdir",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0 and "2 passed" in proc.stdout, proc.stdout + proc.stderr
