"""The kit catches every deliberately broken transport (``broken.py``, ``sabotage.py``) in
every one of ``RUNS`` runs (three; ``P2PKV_SABOTAGE_RUNS``), and passes the correct
transports they derive from.

One pytest subprocess (``suite_runs``) runs, for each variant ``RUNS`` times, the suite tests
named for its defect; each run must fail at least one of them, and the correct transport must
pass all of them. The correct transports pass the whole suites in ``tests/example_plugin``
and ``test_socket_reference.py``. The socket variants run with their source in a child
process as well, so the late-landing rule is shown to catch bytes that land when a
SIGSTOPped source resumes. How long a catch takes is never asserted (a test that passes on a
quiet machine and fails on a busy one is a bug); the run is bounded by its subprocess timeout.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

pytest.importorskip("p2pkv_loopback", reason="the example plugin (tests/example_plugin) is needed")
import broken
import sabotage
from suite_runs import CRASHES, RUNS, Outcomes, caught_runs, run_suites

# The module fixture runs every variant through the suites in one pytest subprocess (bounded
# by its own timeout); the first test pays for it.
RUN_TIMEOUT = 900.0
pytestmark = pytest.mark.timeout(RUN_TIMEOUT + 60)

HERE = Path(__file__).parent

SUITE_RUN = textwrap.dedent(
    """
    import broken, sabotage
    from p2pkv_loopback import LoopbackControlTransport, LoopbackDataTransport
    from p2pkv.testing.suites import ControlTransportSuite, DataTransportSuite
    from socket_transport import SocketDataTransport
    from suite_runs import add_suites

    FAST = {"timeout": 0.2, "liveness_timeout": 0.2}  # loopback events are immediate
    SOCKETS = {"timeout": 2.0}  # real sockets, peers in a child process too

    add_suites(globals(), DataTransportSuite, broken.DATA_VARIANTS, LoopbackDataTransport,
               name="CorrectLoopbackData", attrs=FAST)
    add_suites(globals(), DataTransportSuite, {**broken.SOCKET_VARIANTS, **sabotage.SABOTAGE},
               SocketDataTransport, name="CorrectSocketData", attrs=SOCKETS)
    add_suites(globals(), ControlTransportSuite, broken.CONTROL_VARIANTS,
               LoopbackControlTransport, name="CorrectLoopbackControl", attrs=FAST)
    """
)

VARIANTS = {
    **broken.DATA_VARIANTS,
    **broken.SOCKET_VARIANTS,
    **sabotage.SABOTAGE,
    **broken.CONTROL_VARIANTS,
}
_tail: list[str] = []


@pytest.fixture(scope="module")
def outcomes(tmp_path_factory: pytest.TempPathFactory) -> Outcomes:
    found, tail = run_suites(tmp_path_factory.mktemp("broken"), SUITE_RUN, RUN_TIMEOUT)
    _tail[:] = [tail]
    return found


@pytest.mark.parametrize(
    "cls", ["TestCorrectLoopbackData", "TestCorrectSocketData", "TestCorrectLoopbackControl"]
)
def test_the_correct_transport_passes(outcomes: Outcomes, cls: str) -> None:
    failed = [t for t, o in outcomes[cls].items() if o == "failed"]
    assert outcomes[cls] and not failed, f"{cls}: the correct transport failed {failed}"


def test_no_variant_crashes_in_its_own_code(outcomes: Outcomes) -> None:
    """A variant that raises ``AttributeError`` (written against an old transport) would
    fail its tests without showing its defect: such a failure is no catch."""
    crashed = sorted(
        f"{cls}.{test}"
        for cls, tests in outcomes.items()
        for test, outcome in tests.items()
        if outcome == "crashed"
    )
    assert not crashed, f"variants crashed in their own code ({', '.join(CRASHES)}): {crashed}"


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_the_kit_catches_every_run(outcomes: Outcomes, variant: str) -> None:
    cls, expected = VARIANTS[variant]
    assert f"Test{variant}Run1" in outcomes, (
        f"the suite run reported nothing for {variant}; its output ended with:\n{_tail[0]}"
    )
    caught = caught_runs(outcomes, variant, expected)
    assert len(caught) == RUNS, (
        f"{variant} ({(cls.__doc__ or '').strip()}) was caught by {expected} in runs "
        f"{caught} of 1..{RUNS}; failed in run 1: "
        f"{[t for t, o in outcomes[f'Test{variant}Run1'].items() if o == 'failed']}"
    )
