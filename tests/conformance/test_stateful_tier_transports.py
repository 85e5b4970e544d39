"""The kit's tier state machine over the real transport pairs (the memory pair, with injected
faults, runs in ``core/tests/test_stateful_tier.py``)."""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing.suites import installed_transport
from p2pkv.testing.tier_machine import TierMachine

DEEP = os.environ.get("HYPOTHESIS_PROFILE") == "deep"
PAIRS = {("zmq", "nixl"): 3, ("zmq", "ucx"): 3, ("zmq", "memory"): 5}


@pytest.mark.hypothesis
@pytest.mark.parametrize(("control", "data"), sorted(PAIRS), ids=lambda name: name)
def test_tiers_keep_their_promises(control: str, data: str) -> None:
    options: dict[str, Any] = {"drain_timeout": 1.0} if data in ("nixl", "ucx") else {}
    machine: Any = type(
        f"{control}{data}Tiers",
        (TierMachine,),
        {
            "control_transport": installed_transport("control", control),
            "data_transport": installed_transport("data", data),
            "data_options": options,
        },
    )
    examples = PAIRS[(control, data)] * (10 if DEEP else 1)
    phases = list(Phase) if DEEP else [p for p in Phase if p is not Phase.shrink]
    run_state_machine_as_test(
        machine,
        settings=settings(
            max_examples=examples,
            stateful_step_count=40,
            deadline=None,
            derandomize=not DEEP,
            phases=phases,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
        ),
    )
