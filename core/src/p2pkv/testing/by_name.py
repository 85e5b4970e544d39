"""The conformance suites over installed transports named on the command line.

Collected only through ``pytest --p2pkv-transport NAME`` (see :mod:`p2pkv.testing.pytest_plugin`);
a name that is not installed fails with the registry's explanation (what is installed, which
distribution provides it). Each kind runs its suite and its state machine (with the kit's
hypothesis settings unless ``--hypothesis-profile`` names another; in a child process with
``--p2pkv-machine-child``); a kind with no transport among the names (``--p2pkv-kind``, or a
name installed as one kind only) is deselected.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest
from hypothesis.stateful import run_state_machine_as_test

from p2pkv.contracts import TransportKind
from p2pkv.registry import default_registry
from p2pkv.testing.isolated import run_machine_in_child
from p2pkv.testing.stateful import ControlTransportMachine, DataTransportMachine
from p2pkv.testing.suites import ControlTransportSuite, DataTransportSuite, installed_transport

NO_TRANSPORT = ""
"""The parameter of a kind no name is installed as: the plugin deselects its tests."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "p2pkv_transport_name" not in metafunc.fixturenames or metafunc.cls is None:
        return
    config = metafunc.config
    kind: TransportKind = metafunc.cls.kind
    wanted = config.getoption("p2pkv_kind")
    registry = default_registry()
    names = []
    for name in config.getoption("p2pkv_transport"):
        installed = {k for k in ("control", "data") if name in registry.entries(k)}
        kinds = installed or {"control", "data"}  # not installed: fail with the registry's hint
        if wanted in (kind, "both") and kind in kinds:
            names.append(name)
    metafunc.parametrize(
        "p2pkv_transport_name",
        names or [NO_TRANSPORT],
        scope="class",
        ids=None if names else ["none"],
    )


class _ByName:
    kind: TransportKind

    @pytest.fixture
    def transport_class(self, p2pkv_transport_name: str) -> type[Any]:
        return installed_transport(self.kind, p2pkv_transport_name, missing="fail")

    @pytest.fixture
    def transport_options(self, pytestconfig: pytest.Config) -> Mapping[str, Any]:
        options: dict[str, Any] = json.loads(pytestconfig.getoption("p2pkv_options"))
        return options

    @pytest.fixture(autouse=True)
    def _timeouts(self, pytestconfig: pytest.Config, monkeypatch: pytest.MonkeyPatch) -> None:
        timeout = pytestconfig.getoption("p2pkv_timeout")
        if timeout is not None:
            monkeypatch.setattr(self, "timeout", timeout)
            monkeypatch.setattr(self, "liveness_timeout", timeout, raising=False)


class TestControlTransport(_ByName, ControlTransportSuite):
    pass


class TestDataTransport(_ByName, DataTransportSuite):
    pass


class _MachineByName(_ByName):
    machine: type[Any]
    timeout: float = 10.0
    liveness_timeout: float = 10.0

    def test_state_machine(
        self,
        transport_class: type[Any],
        transport_options: Mapping[str, Any],
        pytestconfig: pytest.Config,
    ) -> None:
        attrs = {
            "transport": transport_class,
            "options": dict(transport_options),
            "timeout": self.timeout,
            "liveness_timeout": self.liveness_timeout,
        }
        machine = type(f"{transport_class.__name__}Machine", (self.machine,), attrs)
        if pytestconfig.getoption("p2pkv_machine_child"):
            run_machine_in_child(machine)
        else:
            run_state_machine_as_test(machine)


class TestControlMachine(_MachineByName):
    kind = "control"
    machine = ControlTransportMachine


class TestDataMachine(_MachineByName):
    kind = "data"
    machine = DataTransportMachine
