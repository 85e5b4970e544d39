"""Build every distribution's wheel and import each one alone (``nox -s wheels``, in CI).

For each distribution of docs/dev/distributions.md: a fresh virtual environment (uv) gets
its wheel, the wheels of the workspace distributions it declares, and its declared
third-party dependencies from the index, nothing else. There the check imports its package,
loads each of its entry points (groups ``p2pkv``, ``vllm.general_plugins``,
``console_scripts``) and builds p2pkv's plugin registry, which must record no failure. So a
distribution that imports something it does not declare, or a plugin that only loads next
to a sibling, fails here, whatever the development venv happens to hold.

Usage: ``python scripts/check_wheels.py [WORK_DIR]`` with ``uv`` on PATH (scripts/install.sh
installs it); exit status 1 naming each distribution that failed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "dev" / "distributions.md"
ROW = re.compile(r"^\| `([\w-]+)` \| `([\w/]+)` \| `(\w+)` \|")
CHECK = """
import importlib, importlib.metadata as md, sys
dist, package = sys.argv[1], sys.argv[2]
importlib.import_module(package)
groups = ("p2pkv", "vllm.general_plugins", "console_scripts")
for ep in md.distribution(dist).entry_points:
    if ep.group in groups:
        ep.load()
from p2pkv.registry import default_registry
failures = default_registry().failures
assert not failures, failures
print(f"{dist}: {package} imports alone, entry points load, the registry has no failure")
"""


def distributions() -> list[tuple[str, Path, str]]:
    """(name, source directory, import package) of every row of the distribution map."""
    rows = [ROW.match(line) for line in MAP.read_text().splitlines()]
    return [(m[1], ROOT / m[2].split("/src/")[0], m[3]) for m in rows if m]


def build(source: Path, out: Path) -> Path:
    """The wheel of the distribution at ``source`` (hatchling from the running Python)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-w",
            str(out),
            str(source),
        ],
        check=True,
    )
    name = tomllib.loads((source / "pyproject.toml").read_text())["project"]["name"]
    (wheel,) = out.glob(f"{name.replace('-', '_')}-*.whl")
    return wheel


def workspace_requirements(source: Path, wheels: dict[str, Path]) -> list[Path]:
    """The wheels of the workspace distributions ``source`` declares as dependencies."""
    declared = tomllib.loads((source / "pyproject.toml").read_text())["project"]["dependencies"]
    names = {re.split(r"[<>=!~\[; ]", req, maxsplit=1)[0] for req in declared}
    return [wheels[n] for n in sorted(names) if n in wheels]


def check_alone(name: str, package: str, wheels: dict[str, Path], source: Path, work: Path) -> bool:
    """Install ``name`` alone into a fresh venv and run :data:`CHECK` there."""
    env = work / f"env-{name}"
    python = env / "bin" / "python"
    subprocess.run(["uv", "venv", "-q", "--python", sys.executable, str(env)], check=True)
    install = [str(w) for w in (wheels[name], *workspace_requirements(source, wheels))]
    subprocess.run(["uv", "pip", "install", "-q", "--python", str(python), *install], check=True)
    done = subprocess.run(
        [str(python), "-c", CHECK, name, package],
        check=False,
        capture_output=True,
        text=True,
        cwd=work,
    )
    print(done.stdout.strip() or f"{name}: FAILED\n{done.stderr.strip()}")
    return done.returncode == 0


def main(argv: list[str]) -> int:
    with tempfile.TemporaryDirectory(prefix="p2pkv-wheels-") as tmp:
        work = Path(argv[0]) if argv else Path(tmp)
        dists = distributions()
        wheels = {name: build(source, work / "wheels") for name, source, _ in dists}
        failed = [
            name
            for name, source, package in dists
            if not check_alone(name, package, wheels, source, work)
        ]
    if failed:
        print(f"not importable alone with their declared dependencies: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
