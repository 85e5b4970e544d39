"""A child Python interpreter for the core tests (the ``run_python`` fixture's function).

Importable by name (``core/tests`` is on pytest's ``pythonpath``): the tests annotate the
fixture with :class:`RunPython`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Protocol


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


class RunPython(Protocol):
    """:func:`run_python`: ``python *args`` with ``site`` on PYTHONPATH and ``env`` set."""

    def __call__(
        self, *args: str, site: Path | None = None, timeout: float = 60, **env: str
    ) -> subprocess.CompletedProcess[str]: ...
