"""Running the conformance suites over deliberately broken transports, as an author would:
in a pytest subprocess of its own (a fresh interpreter, nothing of this session in its
environment), each test's outcome read from its JUnit report.

The generated test module builds its classes with :func:`add_suites`: for each broken
variant ``RUNS`` classes (``Test<Variant>Run<k>``), each running only the suite tests named
for its defect, and one class running all of those tests over the correct transport the
variants derive from (so a failure is the defect's, not the harness's).
"""

from __future__ import annotations

import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

__all__ = ["CRASHES", "RUNS", "Outcomes", "add_suites", "caught_runs", "run_suites"]

RUNS = int(os.environ.get("P2PKV_SABOTAGE_RUNS", "3"))
"""Runs of each variant, each of which must catch it: three in the README's test command (CI's
time budget), more with ``P2PKV_SABOTAGE_RUNS`` (five caught every variant in five when the
variants were written)."""

Outcomes = dict[str, dict[str, str]]
"""Test class -> test name (without parameters) -> passed, failed, crashed or skipped."""

CRASHES = ("AttributeError", "NameError", "ImportError", "ModuleNotFoundError")
"""Errors of a variant's own code (a broken variant written against an old transport), never
a catch: the kit did not find the defect, the variant broke before it could show it."""

_ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "UCX_NET_DEVICES", "VIRTUAL_ENV")


def _only(suite: type, tests: set[str]) -> dict[str, None]:
    """Class attributes removing every inherited test of ``suite`` but ``tests``."""
    return {name: None for name in dir(suite) if name.startswith("test_") and name not in tests}


def add_suites(
    namespace: MutableMapping[str, Any],
    suite: type,
    variants: Mapping[str, tuple[type, tuple[str, ...]]],
    correct: type,
    *,
    name: str,
    attrs: Mapping[str, Any],
) -> None:
    """Add the test classes of ``variants`` (name -> (class, the tests that must catch it))
    to ``namespace``, with ``attrs`` (timeouts), and ``Test<name>`` over ``correct``."""
    union = {t for _, tests in variants.values() for t in tests}
    classes: dict[str, tuple[type, Mapping[str, Any], set[str]]] = {
        f"Test{name}": (correct, {}, union)
    }
    for variant, (cls, expected) in variants.items():
        for run in range(1, RUNS + 1):
            classes[f"Test{variant}Run{run}"] = (cls, attrs, set(expected))
    for test, (transport, knobs, tests) in classes.items():
        assert test not in namespace, f"two variants are named {test[4:]}: rename one"
        namespace[test] = type(
            test, (suite,), {"transport": transport, **knobs, **_only(suite, tests)}
        )


def run_suites(tmp: Path, source: str, timeout: float) -> tuple[Outcomes, str]:
    """Run ``source`` as a test module in a pytest subprocess (bounded by ``timeout``).
    Returns the outcomes and the tail of the run's output."""
    (tmp / "test_suite_run.py").write_text(source)
    report = tmp / "report.xml"
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEPT}
    env["PYTHONPATH"] = str(Path(__file__).parent)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "test_suite_run.py",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--tb=no",
            "--timeout=60",
            f"--junitxml={report}",
            "--rootdir",
            str(tmp),
        ],
        cwd=tmp,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    tail = f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    assert report.exists(), f"the suite run produced no report:\n{tail}"
    outcomes: Outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        test = case.get("name", "").split("[", 1)[0]
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        if failure is not None:
            crashed = failure.get("message", "").startswith(CRASHES)
            outcome = "crashed" if crashed else "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        per_test = outcomes.setdefault(cls, {})
        if per_test.get(test) not in ("failed", "crashed"):
            per_test[test] = outcome
    return outcomes, tail


def caught_runs(outcomes: Outcomes, variant: str, expected: tuple[str, ...]) -> list[int]:
    """The runs of ``variant`` in which at least one of the ``expected`` tests failed."""
    return [
        run
        for run in range(1, RUNS + 1)
        if any(outcomes.get(f"Test{variant}Run{run}", {}).get(t) == "failed" for t in expected)
    ]
