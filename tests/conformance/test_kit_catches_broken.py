"""The kit catches every deliberately broken transport of ``broken.py``, and passes the correct
one it derives from.

One pytest subprocess runs, for every variant, the suite tests named for its defect (a JUnit
XML report gives each test's outcome); each variant must fail at least one of them, and the
correct transport must pass all of them (so a failure is the defect's, not the harness's). The
correct transports pass the whole suites in ``tests/example_plugin`` and
``test_socket_reference.py``. The socket variants run with their source in a child process as
well, so the late-landing rule is shown to catch bytes that land when a SIGSTOPped source
resumes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("p2pkv_loopback", reason="the example plugin (tests/example_plugin) is needed")

# The module fixture runs every broken variant through the suites in one pytest subprocess
# (bounded by its own 600 s timeout); the first test pays for it.
pytestmark = pytest.mark.timeout(660)

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
import broken  # noqa: E402

SUITE_RUN = textwrap.dedent(
    """
    import broken
    from p2pkv_loopback import LoopbackControlTransport, LoopbackDataTransport
    from p2pkv.testing.suites import ControlTransportSuite, DataTransportSuite
    from socket_transport import SocketDataTransport

    FAST = {"timeout": 0.2, "liveness_timeout": 0.2}  # loopback events are immediate

    def only(suite, tests):
        # test_x = None in a subclass removes an inherited test
        return {name: None for name in dir(suite) if name.startswith("test_") and name not in tests}

    def add(suite, variants, correct, prefix="", attrs=FAST):
        union = {t for _, tests in variants.values() for t in tests}
        name = "TestCorrect" + prefix + suite.__name__
        globals()[name] = type(name, (suite,), {"transport": correct, **only(suite, union)})
        for variant, (cls, tests) in variants.items():
            name = "Test" + variant
            body = {"transport": cls, **attrs, **only(suite, tests)}
            globals()[name] = type(name, (suite,), body)

    add(DataTransportSuite, broken.DATA_VARIANTS, LoopbackDataTransport)
    add(DataTransportSuite, broken.SOCKET_VARIANTS, SocketDataTransport, "Socket",
        {"timeout": 5.0})  # real sockets, peers in a child process too
    add(ControlTransportSuite, broken.CONTROL_VARIANTS, LoopbackControlTransport)
    """
)

Outcomes = dict[str, dict[str, str]]

_ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "UCX_NET_DEVICES", "VIRTUAL_ENV")
_last_run_output: list[str] = []


def run_suites(tmp: Path, source: str) -> Outcomes:
    """Run ``source`` as a test module in a pytest subprocess; class -> test -> outcome."""
    (tmp / "test_suite_run.py").write_text(source)
    report = tmp / "report.xml"
    # A clean environment: nothing earlier tests of this session set may reach the run.
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEPT}
    env["PYTHONPATH"] = str(HERE)
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "test_suite_run.py", "-q", "-p", "no:cacheprovider",
         "-o", "addopts=", "--tb=no", "--timeout=60", f"--junitxml={report}",
         "--rootdir", str(tmp)],
        cwd=tmp, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    assert report.exists(), f"the suite run produced no report:\n{proc.stdout}\n{proc.stderr}"
    _last_run_output[:] = [proc.stdout[-4000:], proc.stderr[-4000:]]
    outcomes: Outcomes = {}
    for case in ET.parse(report).iter("testcase"):
        cls = case.get("classname", "").rsplit(".", 1)[-1]
        name = case.get("name", "").split("[", 1)[0]
        if case.find("failure") is not None or case.find("error") is not None:
            outcome = "failed"
        elif case.find("skipped") is not None:
            outcome = "skipped"
        else:
            outcome = "passed"
        per_test = outcomes.setdefault(cls, {})
        if per_test.get(name) != "failed":
            per_test[name] = outcome
    return outcomes


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    return run_suites(tmp_path_factory.mktemp("broken"), SUITE_RUN)


@pytest.mark.parametrize(
    "cls", ["TestCorrectDataTransportSuite", "TestCorrectSocketDataTransportSuite",
            "TestCorrectControlTransportSuite"]
)
def test_the_correct_transport_passes(outcomes: Outcomes, cls: str) -> None:
    failed = [t for t, o in outcomes[cls].items() if o == "failed"]
    assert outcomes[cls] and not failed, f"{cls}: the correct loopback transport failed {failed}"


VARIANTS = {**broken.DATA_VARIANTS, **broken.SOCKET_VARIANTS, **broken.CONTROL_VARIANTS}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_kit_catches(outcomes: Outcomes, variant: str) -> None:
    _, expected = VARIANTS[variant]
    assert f"Test{variant}" in outcomes, (
        f"the suite run reported nothing for Test{variant}; its output ended with:\n"
        + "\n".join(_last_run_output)
    )
    results = outcomes[f"Test{variant}"]
    caught = [t for t in expected if results.get(t) == "failed"]
    assert caught, (
        f"{variant} ({VARIANTS[variant][0].__doc__.strip()}) was not caught by {expected}; "
        f"failed: {[t for t, o in results.items() if o == 'failed']}"
    )
