"""Fixtures of the core tests.

* Fixture plugin distributions (``fixture_plugins/*``), installed with ``pip install
  --target`` into a temporary directory, never into ``.venv``. A test sees them by running
  Python in a subprocess with that directory on ``PYTHONPATH``.
* Tiers over the memory transports on a fake clock (:mod:`p2pkv.testing.harness`): the
  ``cluster`` fixture. Tests import the harness by name; the ``tier_harness`` fixture hands
  the module to the test files not converted yet.
* One session and its fakes (``session_rig.py``): the ``rig``, ``consumer`` and ``producer``
  fixtures.

Type-checked by mypy (root pyproject.toml).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest
from child_python import RunPython, run_python
from p2pkv.testing import harness
from session_rig import Rig

FIXTURE_PLUGINS = Path(__file__).parent / "fixture_plugins"
FIXTURE_DISTS = ("good", "dup", "broken", "oldapi", "typo", "shm")


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fixture plugin distributions, installed (not editable)."""
    target = tmp_path_factory.mktemp("fixture-site")
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--no-build-isolation",
        "--no-index",
        "--target",
        str(target),
        *(str(FIXTURE_PLUGINS / d) for d in FIXTURE_DISTS),
    ]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    return target


@pytest.fixture(name="run_python")
def run_python_fixture() -> RunPython:
    """:func:`run_python`, for tests (``--import-mode=importlib`` cannot import conftest)."""
    return run_python


@pytest.fixture(scope="session")
def tier_harness() -> ModuleType:
    """:mod:`p2pkv.testing.harness` as a module (import it by name in new tests)."""
    return harness


@pytest.fixture
def cluster() -> Iterator[harness.Cluster]:
    """Memory-transport tiers on one fake clock (:class:`p2pkv.testing.harness.Cluster`),
    shut down after the test."""
    made = harness.Cluster()
    yield made
    made.close()


@pytest.fixture
def rig() -> Iterator[Rig]:
    """One session under test (``session_rig.Rig``); its fake data plane saw no read
    a correct session never posts."""
    r = Rig()
    yield r
    assert r.data.violations == []


@pytest.fixture
def consumer(rig: Rig) -> Rig:
    """A ready session about to load."""
    rig.handshake()
    return rig


@pytest.fixture
def producer(rig: Rig) -> Rig:
    """A ready session whose local producer request ``r`` is running."""
    rig.handshake()
    rig.dir.producer_started("r")
    return rig
