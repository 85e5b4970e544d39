"""The kit's state machines over every published transport and the example plugin's.

Same-process peers only; heavier transports get fewer examples (``deep`` multiplies all).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing.stateful import ControlTransportMachine, DataTransportMachine
from p2pkv.testing.suites import installed_transport

SCALE = 10 if os.environ.get("HYPOTHESIS_PROFILE") == "deep" else 1


def _settings(examples: int, steps: int = 25) -> settings:
    """ci: derandomized, no shrinking (a failing run stays short; its example is printed
    unshrunk). deep: 10x the examples, random, shrunk."""
    phases = list(Phase) if SCALE > 1 else [p for p in Phase if p is not Phase.shrink]
    return settings(
        max_examples=examples * SCALE,
        stateful_step_count=steps,
        deadline=None,
        suppress_health_check=[HealthCheck.too_slow],
        derandomize=SCALE == 1,
        phases=phases,
    )


IN_PROCESS = {"timeout": 2.0, "liveness_timeout": 2.0}  # short: a failure shrinks quickly
DATA: dict[str, tuple[dict[str, Any], int]] = {
    "loopback": ({"options": {}, **IN_PROCESS}, 25),
    "memory": ({"options": {}, **IN_PROCESS}, 25),
    # 3-block slices. No kill_peer here: in `nox -s kit_repeat -- nixl` (which keeps it), one
    # run in seven had NIXL's UCX backend creation hang for 120 s in the example after one
    # that killed a peer; until that is understood CI does not risk it.
    "nixl": ({"options": {"drain_timeout": 1.0, "slice_bytes": 192}, "kill_peer": None}, 4),
    "ucx": ({"options": {"drain_timeout": 1.0, "slice_bytes": 192}}, 4),
}
CONTROL: dict[str, tuple[dict[str, Any], int]] = {
    "loopback": ({"options": {}, **IN_PROCESS}, 25),
    "memory": ({"options": {}, **IN_PROCESS}, 25),
    "zmq": (
        {"options": {"heartbeat_interval": 0.5, "heartbeat_timeout": 3.0, "heartbeat_ttl": 3.0}},
        6,
    ),
}


@pytest.mark.hypothesis
@pytest.mark.parametrize("name", sorted(DATA))
def test_data_machine(name: str) -> None:
    attrs, examples = DATA[name]
    machine: Any = type(
        f"{name}DataMachine",
        (DataTransportMachine,),
        {"transport": installed_transport("data", name), **attrs},
    )
    run_state_machine_as_test(machine, settings=_settings(examples))


@pytest.mark.hypothesis
@pytest.mark.parametrize("name", sorted(CONTROL))
def test_control_machine(name: str) -> None:
    attrs, examples = CONTROL[name]
    machine: Any = type(
        f"{name}ControlMachine",
        (ControlTransportMachine,),
        {"transport": installed_transport("control", name), **attrs},
    )
    run_state_machine_as_test(machine, settings=_settings(examples))
