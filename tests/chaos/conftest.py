"""The chaos suite (issue 10): real processes, real network cuts, hostile peers, leaks.

Every test here is marked ``chaos``. They run through ``nox -s chaos`` (``pytest -m chaos
tests/chaos``), which CI calls; a plain ``pytest`` run deselects them (they take minutes,
kill processes and need root for namespaces), unless the mark expression names ``chaos`` or a
path inside ``tests/chaos`` is given.

The ``chaos_*`` modules of this directory are importable by name, in the test process and in
the spawned node processes (pytest's ``pythonpath``, root pyproject.toml).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos_netlab import NetLab, NetLabUnavailable, netlab_problem

_HERE = Path(__file__).parent


def _selected(config: pytest.Config) -> bool:
    if "chaos" in (config.option.markexpr or ""):
        return True
    return any(str(_HERE) in str(Path(a.split("::")[0]).resolve()) for a in config.args)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [i for i in items if _HERE in Path(str(i.path)).parents]
    for item in ours:
        item.add_marker(pytest.mark.chaos)
    if ours and not _selected(config):
        keep = [i for i in items if _HERE not in Path(str(i.path)).parents]
        config.hook.pytest_deselected(items=ours)
        items[:] = keep


@pytest.fixture(params=["nixl", "ucx"])
def data(request: pytest.FixtureRequest) -> str:
    """The cross-process data transport under test: each of nixl and ucx, skipped (saying
    why) when it is not installed or its library is missing."""
    from p2pkv.errors import ConfigError
    from p2pkv.registry import default_registry

    name: str = request.param
    try:
        problem = default_registry().transport("data", name).availability()
    except ConfigError as exc:
        pytest.skip(str(exc))
    if problem is not None:
        pytest.skip(str(problem))
    return name


@pytest.fixture
def netlab() -> Iterator[NetLab]:
    """Two namespaced hosts joined by a veth pair; removed afterwards, even on failure."""
    problem = netlab_problem()
    if problem is not None:
        pytest.skip(f"network namespaces unavailable: {problem}")
    try:
        lab = NetLab.create()
    except NetLabUnavailable as exc:
        pytest.skip(f"network namespaces unavailable: {exc}")
    try:
        yield lab
    finally:
        lab.remove()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from chaos_cluster import MEASUREMENTS

    if MEASUREMENTS:
        terminalreporter.section("chaos measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)


@pytest.fixture(params=["default", "tcp"])
def lane(request: pytest.FixtureRequest, data: str) -> dict[str, str]:
    """Environment of every node: the data transport's default lane, or (nixl only) UCX over
    tcp, nixl's staged lane (what every cross-host pair without ``cma`` uses)."""
    if request.param == "tcp" and data != "nixl":
        pytest.skip("UCX_TLS=tcp is a nixl lane variant (ucx's lane does not depend on it)")
    return {"UCX_TLS": "tcp"} if request.param == "tcp" else {}
