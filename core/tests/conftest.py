"""Fixtures of the core tests: fixture plugin distributions installed into a temporary target.

The fixture plugins are real distributions (``fixture_plugins/*``) installed with
``pip install --target`` into a temporary directory, never into ``.venv``; a test sees them by
running Python in a subprocess with that directory on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

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
def run_python_fixture() -> object:
    """:func:`run_python`, for tests (``--import-mode=importlib`` cannot import conftest)."""
    return run_python


@pytest.fixture(scope="session")
def tier_harness() -> Any:
    """``tier_harness.py`` (memory-transport tiers, fake clock) as a module."""
    import tier_harness

    return tier_harness


@pytest.fixture
def cluster(tier_harness: Any) -> Any:
    """A ``tier_harness.Cluster``: memory-transport tiers on one fake clock, shut down after."""
    made = tier_harness.Cluster()
    yield made
    made.close()
