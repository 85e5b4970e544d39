"""The kit over its own cross-process, two-sided reference transport (``socket_transport``):
the suites' child-process modes (peers in another process, SIGSTOPped and SIGKILLed), and the
data machine over a transport whose timing is the kernel's, not the machine's."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing.stateful import DataTransportMachine
from p2pkv.testing.suites import DataTransportSuite
from socket_transport import SocketDataTransport


class TestSocketReference(DataTransportSuite):
    transport = SocketDataTransport
    timeout = 5.0


@pytest.mark.hypothesis
def test_data_machine_over_sockets() -> None:
    """Reads complete when the kernel delivers: the machine must not let that timing reach
    hypothesis (it would raise ``FlakyStrategyDefinition``)."""
    machine: Any = type(
        "SocketDataMachine",
        (DataTransportMachine,),
        {"transport": SocketDataTransport, "timeout": 5.0},
    )
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=15,
            stateful_step_count=30,
            deadline=None,
            derandomize=True,
            phases=[p for p in Phase if p is not Phase.shrink],
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
