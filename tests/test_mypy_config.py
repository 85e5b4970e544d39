"""mypy sees the tests as pytest runs them (root pyproject.toml, ``[tool.mypy]``).

pytest imports helpers by bare name from its ``pythonpath``; mypy finds them through the
links in ``.mypy/``. A test directory without its link would leave its helpers unresolved
(``Any``, silently); a helper missing from the tests override would be checked leniently.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
MYPY = CONFIG["mypy"]


def _linked() -> dict[Path, str]:
    """The directories the ``.mypy/`` links on mypy's path point to, by link."""
    links = [entry for entry in MYPY["mypy_path"] if entry.startswith(".mypy/")]
    return {(ROOT / entry).resolve(): entry for entry in links}


def test_every_checked_helper_directory_is_linked() -> None:
    checked = [
        d
        for d in CONFIG["pytest"]["ini_options"]["pythonpath"]
        if any(d == f or d.startswith(f"{f}/") for f in MYPY["files"])
    ]
    missing = [d for d in checked if (ROOT / d).resolve() not in _linked()]
    assert not missing, f"add a link in .mypy/ and to mypy_path for: {missing}"


def test_every_helper_is_checked_strictly() -> None:
    strict = {
        name
        for override in MYPY["overrides"]
        if override.get("strict")
        for name in override["module"]
    }
    ignored = {
        name
        for override in MYPY["overrides"]
        if override.get("ignore_errors")
        for name in override["module"]
    }
    helpers = {
        path.stem
        for directory in _linked()
        for path in directory.glob("*.py")
        if not path.stem.startswith(("test_", "conftest"))
    }
    assert helpers - ignored <= strict, sorted(helpers - ignored - strict)
