"""The data state machine 20 runs in a row with hypothesis' default settings (100 examples,
random, shrinking on; only the per-example deadline off), over the data transports named in
``P2PKV_REPEAT_TRANSPORTS`` (comma-separated; default ``memory,loopback``).

Not collected by a plain ``pytest`` run (the name does not start with ``test_``): run it with
``nox -s kit_repeat -- nixl,ucx``. It is the check that the machine's draws never depend on
timing (no ``Flaky*`` error from hypothesis, whatever the transport's speed).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test
from p2pkv.testing.stateful import DataTransportMachine
from p2pkv.testing.suites import installed_transport

NAMES = os.environ.get("P2PKV_REPEAT_TRANSPORTS", "memory,loopback").split(",")
ATTRS: dict[str, dict[str, Any]] = {
    "memory": {"timeout": 2.0},
    "loopback": {"timeout": 2.0},
    "nixl": {"options": {"drain_timeout": 1.0}},
    "ucx": {"options": {"drain_timeout": 1.0}},
}


@pytest.mark.parametrize("run", range(20))
@pytest.mark.parametrize("name", NAMES)
def test_data_machine(name: str, run: int) -> None:
    machine: Any = type(
        f"{name}DataMachine",
        (DataTransportMachine,),
        {"transport": installed_transport("data", name), **ATTRS.get(name, {})},
    )
    run_state_machine_as_test(
        machine, settings=settings(settings.get_profile("default"), deadline=None)
    )
