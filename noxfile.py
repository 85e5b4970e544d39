"""Developer sessions. Run ``bash scripts/install.sh`` once; sessions reuse ``.venv``.

Every session runs the tools of the shared ``.venv`` (``venv_backend="none"``) instead of
building its own environment, so a session starts in a second. Add a session with
``@venv_session`` and ``run(session, "<tool>", ...)``; it inherits that setup.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import nox

ROOT = Path(__file__).parent
VENV_BIN = ROOT / ".venv" / "bin"

nox.options.sessions = ["tests", "lint", "types"]
nox.options.default_venv_backend = "none"


def venv_session(func: Callable[[nox.Session], None]) -> Any:
    """A nox session that uses the shared ``.venv`` (no environment of its own)."""
    return nox.session(venv_backend="none", name=func.__name__)(func)


def run(session: nox.Session, tool: str, *args: str, **env: str) -> None:
    """Run ``.venv/bin/<tool>`` with ``args``; extra ``env`` is added to the environment."""
    exe = VENV_BIN / tool
    if not exe.exists():
        session.error(f"{exe} is missing: run `bash scripts/install.sh` first")
    session.run(str(exe), *args, env={"UCX_NET_DEVICES": "lo", **env}, external=True)


def pytest(session: nox.Session, *args: str, **env: str) -> None:
    run(session, "python", "-m", "pytest", *args, *session.posargs, **env)


@venv_session
def tests(session: nox.Session) -> None:
    """The whole test suite (what `bash scripts/test.sh` runs, without reinstalling)."""
    pytest(session)


@venv_session
def lint(session: nox.Session) -> None:
    """ruff over the whole tree."""
    run(session, "ruff", "check", ".", *session.posargs)


@venv_session
def types(session: nox.Session) -> None:
    """mypy as configured in the root pyproject.toml (strict on core)."""
    run(session, "mypy", *session.posargs)


@venv_session
def deep(session: nox.Session) -> None:
    """Every hypothesis test (``-m hypothesis``) with the ``deep`` profile (20x the examples)."""
    pytest(session, "-m", "hypothesis", HYPOTHESIS_PROFILE="deep")
