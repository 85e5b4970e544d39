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

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType

import pytest
from p2pkv.testing import harness
from session_rig import Rig

FIXTURE_PLUGINS = Path(__file__).parent / "fixture_plugins"
FIXTURE_DISTS = ("good", "dup", "broken", "oldapi", "typo", "shm")


@pytest.fixture(scope="session")
def fixture_site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory holding the fixture plugin distributions, installed (not editable)."""
    target = tmp_path_factory.mktemp("fixture-site")
    cmd = [
        sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
        "--no-deps", "--no-build-isolation", "--no-index", "--target", str(target),
        *(str(FIXTURE_PLUGINS / d) for d in FIXTURE_DISTS),
    ]
    subprocess.run(cmd, check=True, timeout=120, capture_output=True)
    return target


def python_env(site: Path | None = None, **extra: str) -> dict[str, str]:
    """The environment for a child interpreter: ``site`` on PYTHONPATH, P2PKV_* cleared."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("P2PKV_")}
    env.pop("PYTHONPATH", None)
    if site is not None:
        env["PYTHONPATH"] = str(site)
    env.update(extra)
    return env


def run_python(
    *args: str, site: Path | None = None, timeout: float = 60, **env: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *args],
        env=python_env(site, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


@pytest.fixture(name="run_python")
def run_python_fixture() -> Callable[..., subprocess.CompletedProcess[str]]:
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
