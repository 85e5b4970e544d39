"""Every command and Python snippet in the docs is exercised, so the docs cannot rot.

- ``python`` blocks run in a fresh interpreter (the dev venv) from the repository root.
- ``bash`` blocks: every ``p2pkv ...`` command (with or without ``.venv/bin/``) must parse
  with the real CLI parser, plugins included; every ``bash scripts/...`` must name a script
  that exists. A block preceded by ``<!-- docs-test: run -->`` is run for real, from the
  repository root, with this interpreter's ``bin`` first on ``PATH`` (``pytest``, ``p2pkv``).
- A block preceded by ``<!-- docs-test: skip REASON -->`` is skipped, and the reason shows in
  the test report. Blocks inside a generated reference (``<!-- NAME: generated ... -->``) are
  signatures and help texts: left alone (a test checks that they match the code). Blocks in
  other languages (``text``, ``mermaid``, ``json``, ...) are data.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC_FILES = sorted([ROOT / "README.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/*/README.md")])
FENCE = re.compile(r"^```(\w+)[^\n]*\n(.*?)^```", re.S | re.M)
DIRECTIVE = re.compile(r"<!--\s*docs-test:\s*(run|skip)\s*(.*?)-->\s*$")
GENERATED = re.compile(r"<!-- ([a-z-]+): generated .*?<!-- \1: end -->", re.S)
"""A block of a reference page generated from the code (docs/hooks/reference_pages.py): its
fences are signatures and help texts, not commands to run."""


@dataclass(frozen=True)
class Block:
    path: Path
    line: int
    lang: str
    code: str
    directive: str
    reason: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def _blocks() -> list[Block]:
    out = []
    for path in DOC_FILES:
        text = path.read_text()
        generated = [g.span() for g in GENERATED.finditer(text)]
        for m in FENCE.finditer(text):
            lang = m.group(1).lower()
            if lang not in ("python", "bash", "console", "sh", "shell"):
                continue
            if any(start <= m.start() < end for start, end in generated):
                continue
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").splitlines()
            d = DIRECTIVE.search(before[-1]) if before else None
            out.append(
                Block(
                    path,
                    line,
                    lang,
                    m.group(2),
                    d.group(1) if d else "",
                    d.group(2).strip() if d else "",
                )
            )
    return out


BLOCKS = _blocks()


def _commands(code: str) -> list[list[str]]:
    """Shell commands of a block: continuation lines joined, quotes may span lines; each
    command of a pipeline or list on its own, without its redirections."""
    cmds: list[list[str]] = []
    pending = ""
    for raw in code.replace("\\\n", " ").splitlines():
        pending = f"{pending}\n{raw}" if pending else raw.removeprefix("$ ")
        try:
            shlex.split(pending, comments=True)
        except ValueError:  # a quote still open: the command goes on on the next line
            continue
        line, pending = pending, ""
        for part in re.split(r"\s*(?:&&|\|\||;|\|)\s*", line):
            argv = _without_redirections(shlex.split(part, comments=True))
            if argv:
                cmds.append(argv)
    assert not pending, f"unterminated quote in: {pending[:80]!r}"
    return cmds


def _without_redirections(argv: list[str]) -> list[str]:
    """``argv`` without shell redirections (``> file``, ``2>&1``, ``< file``)."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
        elif re.fullmatch(r"\d?[<>]{1,2}", arg):
            skip = True
        elif not re.fullmatch(r"\d?[<>]{1,2}\S+", arg):
            out.append(arg)
    return out


def _check_cli(argv: list[str]) -> None:
    from p2pkv.cli import build_parser
    from p2pkv.registry import default_registry

    parser = build_parser(default_registry())
    try:
        parser.parse_args(argv)
    except SystemExit as exc:  # argparse reports bad flags by exiting
        raise AssertionError(f"`p2pkv {' '.join(argv)}` does not parse (exit {exc.code})") from None


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_doc_block(block: Block) -> None:
    if block.directive == "skip":
        assert block.reason, f"{block.id}: a skip needs a reason"
        pytest.skip(block.reason)
    if block.lang == "python":
        proc = subprocess.run(
            [sys.executable, "-c", block.code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout}\n{proc.stderr}"
        return
    if block.directive == "run":
        path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
        proc = subprocess.run(
            ["bash", "-euo", "pipefail", "-c", block.code],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=300,
            env={**os.environ, "PATH": path},
        )
        assert proc.returncode == 0, f"{block.id} failed:\n{proc.stdout}\n{proc.stderr}"
        return
    for argv in _commands(block.code):
        prog = Path(argv[0]).name
        if prog == "p2pkv":
            _check_cli(argv[1:])
        elif prog == "bash" and len(argv) > 1 and argv[1].startswith("scripts/"):
            assert (ROOT / argv[1]).is_file(), f"{block.id}: {argv[1]} does not exist"


def test_the_cli_reference_has_every_command() -> None:
    """docs/cli.md's generated reference (docs/hooks/cli_reference.py) has a section with the
    ``--help`` text of the CLI and of each of its commands."""
    import cli_reference
    from p2pkv.cli import build_parser
    from p2pkv.registry import default_registry

    text = cli_reference.render()
    parser = build_parser(default_registry())
    (commands,) = [a for a in parser._actions if a.dest == "command"]
    assert commands.choices is not None
    for name in ["", *(f" {c}" for c in commands.choices)]:
        assert f"### `p2pkv{name}`\n\n```text\nusage: p2pkv{name}" in text, name


def test_the_api_reference_documents_every_public_name() -> None:
    """docs/api.md's generated reference (docs/hooks/api_reference.py) has an entry with a
    docstring for every name of each documented module's ``__all__``."""
    import importlib

    import api_reference

    text = api_reference.render()
    for module in api_reference.MODULES:
        for name in importlib.import_module(module).__all__:
            assert f"### `{module}.{name}`" in text, (module, name)


def test_the_committed_reference_pages_match_the_code() -> None:
    """docs/cli.md, configuration.md and api.md hold what the code generates now
    (regenerate them with ``python docs/hooks/reference_pages.py``)."""
    import reference_pages

    assert reference_pages.main(["--check"]) == 0, [
        str(path.relative_to(ROOT)) for path in reference_pages.stale()
    ]


# -- claims about what CI runs, checked against noxfile.py, .ci/run and the pyprojects ----------


def _noxfile() -> tuple[set[str], dict[str, object]]:
    """The session names of ``noxfile.py`` and its literal module constants."""
    import ast

    tree = ast.parse((ROOT / "noxfile.py").read_text())
    sessions, constants = set(), {}
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and any(
            "session" in ast.unparse(d) for d in node.decorator_list
        ):
            sessions.add(node.name)
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
            if isinstance(target, ast.Name):
                try:
                    constants[target.id] = ast.literal_eval(node.value)
                except ValueError:
                    pass
    return sessions, constants


def _ci_sessions() -> set[str]:
    return set(re.findall(r"nox -s (\w+)", (ROOT / ".ci" / "run").read_text()))


CI_RUNS_DIRECTLY = {"tests", "lint", "types"}
"""Sessions whose work ``.ci/run`` does with the tools themselves (scripts/test.sh, ruff,
mypy), not through nox."""


def test_the_readme_lists_exactly_the_sessions_ci_does_not_run() -> None:
    sessions, _ = _noxfile()
    text = " ".join((ROOT / "README.md").read_text().split())
    m = re.search(r"Sessions CI does not run[^:]*:(.*?)\.(?:\s|$)", text)
    assert m, "README.md: no 'Sessions CI does not run ...:' list"
    listed = set(re.findall(r"`(\w+)`", m.group(1)))
    ci = _ci_sessions()
    assert ci <= sessions, f".ci/run names sessions noxfile.py lacks: {ci - sessions}"
    assert listed == sessions - ci - CI_RUNS_DIRECTLY


def test_every_nox_session_the_docs_name_exists() -> None:
    sessions, _ = _noxfile()
    for path in DOC_FILES:
        text = " ".join(path.read_text().split())
        for name in re.findall(r"nox -s (\w+)", text):
            assert name in sessions, f"{path.relative_to(ROOT)}: `nox -s {name}` is no session"


def _distributions() -> dict[str, dict[str, object]]:
    import tomllib

    found = {}
    for path in [*ROOT.glob("*/pyproject.toml"), *ROOT.glob("*/*/pyproject.toml")]:
        project = tomllib.loads(path.read_text()).get("project")
        if project:
            found[project["name"]] = project
    return found


def test_every_install_extra_the_docs_name_exists() -> None:
    dists = _distributions()
    sources = [
        *DOC_FILES,
        ROOT / "scripts" / "requirements-dev.txt",
        *ROOT.glob("*/src/**/*.py"),
        *ROOT.glob("*/*/src/**/*.py"),
    ]
    for path in sources:
        for dist, extras in re.findall(r"\b(p2pkv[a-z-]*)\[([a-z0-9,_-]+)\]", path.read_text()):
            if dist not in dists:
                continue  # a placeholder such as p2pkv[extra]
            declared = dists[dist].get("optional-dependencies", {})
            assert isinstance(declared, dict)
            for extra in set(extras.split(",")) - {"extra"}:  # "extra": a placeholder
                assert extra in declared, (
                    f"{path.relative_to(ROOT)}: {dist}[{extra}] is no extra of {dist}"
                )


def test_the_supported_vllm_releases_are_the_ones_nox_and_ci_run() -> None:
    import p2pkv_vllm

    _, nox = _noxfile()
    api = {*nox["VLLM_RELEASES"], nox["VLLM_VERSION"]}  # type: ignore[misc]
    engines = {*nox["ENGINE_RELEASES"], *nox["ENGINE_OTHER_RELEASES"]}  # type: ignore[misc]
    assert set(p2pkv_vllm.SUPPORTED_VLLM) == api
    assert engines <= api
    source = (ROOT / "plugins" / "vllm" / "src" / "p2pkv_vllm" / "__init__.py").read_text()
    said = " ".join(source.split("SUPPORTED_VLLM = ", 1)[1].split('"""')[1].split())
    for release in nox["ENGINE_RELEASES"]:  # type: ignore[attr-defined]
        assert release in said, f"SUPPORTED_VLLM's docstring omits CI's engine {release}"


def test_the_python_claimed_is_the_python_ci_runs() -> None:
    """Every pyproject requires the Python CI runs (the dev venv's, the nox sessions'),
    and the docs claim the same; mypy and ruff target it."""
    import tomllib

    ran = f"{sys.version_info.major}.{sys.version_info.minor}"
    nox_pythons = set(re.findall(r'python="([0-9.]+)"', (ROOT / "noxfile.py").read_text()))
    assert nox_pythons == {ran}, f"nox sessions run {nox_pythons}, the dev venv {ran}"
    for name, project in _distributions().items():
        assert project.get("requires-python") == f">={ran}", name
    root = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]
    assert root["mypy"]["python_version"] == ran
    assert root["ruff"]["target-version"] == "py" + ran.replace(".", "")
    for path in [ROOT / "README.md", ROOT / "docs" / "index.md"]:
        claims = set(re.findall(r"Python >= ([0-9.]+)", path.read_text()))
        assert claims == {ran}, f"{path.relative_to(ROOT)} claims Python >= {claims}"


AUTHOR_PATH = [ROOT / "README.md", ROOT / "docs" / "index.md", ROOT / "docs" / "plugin-authors.md"]
"""The pages a plugin author reads first; with the example plugin, they use public names only."""
PUBLIC_PACKAGES = ("p2pkv.testing", "p2pkv.reference", "p2pkv.hookspecs")
LOGGERS = {"p2pkv.call_guard"}
"""Internal modules named as loggers (what an operator greps), not as imports."""


def _is_public(dotted: str) -> bool:
    """``p2pkv`` itself, a name it exports, or anything in a public package."""
    import p2pkv

    parts = dotted.split(".")
    if parts[0] != "p2pkv":
        return True  # another package: the author's own, numpy, ...
    if len(parts) == 1 or parts[1] in p2pkv.__all__:
        return True
    return any(dotted == pkg or dotted.startswith(pkg + ".") for pkg in PUBLIC_PACKAGES)


def _imported(code: str) -> list[str]:
    import ast

    names = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
    return names


def test_the_plugin_authors_path_uses_public_names_only() -> None:
    """The author's pages and the example plugin import only what ``p2pkv`` exports (or the
    public packages), and name no internal module, so nothing they copy breaks on a move."""
    internal = []
    for block in BLOCKS:
        if block.path in AUTHOR_PATH and block.lang == "python":
            internal += [f"{block.id}: {m}" for m in _imported(block.code) if not _is_public(m)]
    for path in AUTHOR_PATH[2:]:
        for name in re.findall(r"`(p2pkv(?:\.\w+)+)", path.read_text()):
            if not _is_public(name) and name not in LOGGERS:
                internal.append(f"{path.relative_to(ROOT)}: `{name}`")
    for path in sorted((ROOT / "tests" / "example_plugin" / "src").rglob("*.py")):
        internal += [
            f"{path.relative_to(ROOT)}: {m}"
            for m in _imported(path.read_text())
            if not _is_public(m)
        ]
    assert not internal, (
        "internal names on the plugin author's path (export them, or use "
        "p2pkv's):\n" + "\n".join(internal)
    )
