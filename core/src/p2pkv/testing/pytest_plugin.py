"""pytest plugin of the p2pkv conformance kit (entry point ``pytest11``: ``p2pkv``).

``pytest --p2pkv-transport NAME`` runs the conformance suites against the installed transport
``NAME`` with no test code at all: the plugin adds the kit's own test module
(:mod:`p2pkv.testing.by_name`) to the run. Without explicit paths only the kit runs; with
paths the kit runs alongside them. ``--p2pkv-kind`` limits the run to control or data (by
default every kind ``NAME`` is installed as), ``--p2pkv-options`` passes a JSON object as the
transport's options, ``--p2pkv-timeout`` bounds each awaited event, ``--p2pkv-machine-child``
runs the state machines in a child process (:mod:`p2pkv.testing.isolated`: a crash is reported
with its steps).

Importing the plugin registers the kit's hypothesis profile ``p2pkv`` (see
:mod:`p2pkv.testing.profiles`), so ``pytest --hypothesis-profile p2pkv`` selects it for every
hypothesis test of the run; the kit's machines use it by default anyway.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest

with contextlib.suppress(ImportError):  # hypothesis comes with p2pkv[testing]
    from p2pkv.testing import profiles  # noqa: F401 - registers the hypothesis profile "p2pkv"

BY_NAME_MODULE = Path(__file__).with_name("by_name.py")


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("p2pkv", "p2pkv transport conformance kit")
    group.addoption(
        "--p2pkv-transport",
        action="append",
        default=[],
        metavar="NAME",
        help="run the p2pkv conformance suites against the installed transport NAME (repeatable)",
    )
    group.addoption(
        "--p2pkv-kind",
        choices=("control", "data", "both"),
        default="both",
        help="which kind of transport --p2pkv-transport names (default: every kind it exists as)",
    )
    group.addoption(
        "--p2pkv-options",
        default="{}",
        metavar="JSON",
        help="transport options (control_options/data_options) as a JSON object",
    )
    group.addoption(
        "--p2pkv-machine-child",
        action="store_true",
        help="run the state machines in a child process: a transport that crashes is reported "
        "with the signal, its last steps and the seed that replays them",
    )
    group.addoption(
        "--p2pkv-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="bound on each awaited event, liveness included (default: the suites' 10 s)",
    )


def pytest_configure(config: pytest.Config) -> None:
    if not config.getoption("p2pkv_transport"):
        return
    try:
        options = json.loads(config.getoption("p2pkv_options"))
    except ValueError as exc:
        raise pytest.UsageError(f"--p2pkv-options is not valid JSON: {exc}") from None
    if not isinstance(options, dict):
        raise pytest.UsageError("--p2pkv-options must be a JSON object")
    module = str(BY_NAME_MODULE)
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        if module not in config.args:
            config.args.append(module)
    else:
        config.args[:] = [module]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Deselect the kit's tests of a kind no ``--p2pkv-transport`` name is (not skip them)."""
    if not config.getoption("p2pkv_transport"):
        return
    from p2pkv.testing.by_name import NO_TRANSPORT

    def unwanted(item: pytest.Item) -> bool:
        callspec = getattr(item, "callspec", None)
        return (
            Path(str(item.path)) == BY_NAME_MODULE
            and callspec is not None
            and callspec.params.get("p2pkv_transport_name") == NO_TRANSPORT
        )

    dropped = [item for item in items if unwanted(item)]
    if dropped:
        config.hook.pytest_deselected(items=dropped)
        items[:] = [item for item in items if not unwanted(item)]
