"""pytest plugin of the p2pkv conformance kit (entry point ``pytest11``: ``p2pkv``).

``pytest --p2pkv-transport NAME`` runs the conformance suites against the installed transport
``NAME`` with no test code at all (``--p2pkv-kind`` picks control or data when a name has both).
"""

from __future__ import annotations

import pytest

__all__ = ["pytest_addoption"]


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
