"""pytest plugin of the p2pkv conformance kit (entry point ``pytest11``: ``p2pkv``).

``pytest --p2pkv-transport NAME`` runs the conformance suites against the installed transport
``NAME`` with no test code at all: the plugin adds the kit's own test module
(:mod:`p2pkv.testing.by_name`) to the run. Without explicit paths only the kit runs; with
paths the kit runs alongside them. ``--p2pkv-kind`` limits the run to control or data (by
default every kind ``NAME`` is installed as), ``--p2pkv-options`` passes a JSON object as the
transport's options, ``--p2pkv-timeout`` bounds each awaited event.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

__all__ = ["pytest_addoption", "pytest_configure"]

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
