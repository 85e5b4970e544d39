"""The structure of the first-party code: no import cycle, every import from one
distribution into another allowed by the map in ``docs/dev/distributions.md``, and no class
above :data:`MAX_METHODS` methods.

The graph is built with ``ast`` from every module of every distribution the map lists: each
``import`` and ``from ... import`` statement counts, wherever it is (top level, inside a
function, under ``if TYPE_CHECKING:``), because a lazy or type-only import still ties the two
modules together. ``from a import b`` is an edge to module ``a.b`` when that module exists,
else to ``a``; ``import a.b.c`` is an edge to the longest first-party module prefix of
``a.b.c``. Importing a module also runs its parent packages' ``__init__``; those implicit
edges are not counted (every submodule would otherwise depend on its package).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import NamedTuple

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "dev" / "distributions.md"
CELL = re.compile(r"`([^`]+)`")


class Distribution(NamedTuple):
    """One row of the map: ``path`` is the import package's directory (repository-relative)."""

    name: str
    path: str
    package: str
    may_depend_on: frozenset[str]


def read_tables(text: str) -> dict[str, list[list[list[str]]]]:
    """The markdown tables of ``text`` by their first header cell (lower case): per row, per
    cell, the backquoted names in it."""
    tables: dict[str, list[list[list[str]]]] = {}
    rows: list[list[list[str]]] | None = None
    for line in text.splitlines():
        if not line.lstrip().startswith("|"):
            rows = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if rows is None:
            rows = tables.setdefault(cells[0].lower(), [])
        elif not set(cells[0]) <= set("-: "):
            rows.append([CELL.findall(c) for c in cells])
    return tables


def read_map(text: str) -> list[Distribution]:
    """The distribution table (header ``distribution | path | import package | may depend
    on``; the last cell holds zero or more names)."""
    return [
        Distribution(row[0][0], row[1][0], row[2][0], frozenset(row[3]))
        for row in read_tables(text).get("distribution", [])
    ]


def read_exceptions(text: str) -> set[tuple[str, str]]:
    """The known exceptions table (header ``module | imports | why``): (module, target)."""
    return {(row[0][0], row[1][0]) for row in read_tables(text).get("module", [])}


def module_files(dist: Distribution) -> dict[str, Path]:
    """Module name -> file, for every ``.py`` file of ``dist``'s import package."""
    top = ROOT / dist.path
    modules = {}
    for path in sorted(top.rglob("*.py")):
        parts = (dist.package, *path.relative_to(top).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return modules


def imported_names(tree: ast.AST, module: str, is_package: bool) -> Iterator[str]:
    """Every name an import statement of ``module`` asks for, absolute: ``a.b`` for ``import
    a.b``, ``a.x`` for ``from a import x`` (relative imports resolved). The caller maps a name
    to its longest module prefix: ``a.x`` is module ``a.x`` or attribute ``x`` of ``a``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")
                keep = len(package) - node.level + (1 if is_package else 0)
                base = ".".join([*package[:keep], *([base] if base else [])])
            yield from (f"{base}.{alias.name}" for alias in node.names)


def import_graph(dists: Sequence[Distribution]) -> tuple[dict[str, set[str]], dict[str, str]]:
    """Module -> the first-party modules it imports, and module -> its distribution."""
    files = {m: (d.name, p) for d in dists for m, p in module_files(d).items()}
    owner = {m: dist for m, (dist, _) in files.items()}
    graph: dict[str, set[str]] = {}
    for module, (_, path) in files.items():
        tree = ast.parse(path.read_text(), str(path))
        targets = set()
        for name in imported_names(tree, module, path.name == "__init__.py"):
            parts = name.split(".")
            found = next(
                (
                    ".".join(parts[:n])
                    for n in range(len(parts), 0, -1)
                    if ".".join(parts[:n]) in owner
                ),
                None,
            )
            if found is not None and found != module:
                targets.add(found)
        graph[module] = targets
    return graph, owner


def cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for succ in sorted(graph.get(node, ())):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def _graph() -> tuple[list[Distribution], dict[str, set[str]], dict[str, str]]:
    dists = read_map(MAP.read_text())
    graph, owner = import_graph(dists)
    return dists, graph, owner


def test_the_map_names_every_distribution_in_the_workspace() -> None:
    dists = read_map(MAP.read_text())
    assert dists, f"no distribution table found in {MAP}"
    names = {d.name for d in dists}
    for dist in dists:
        assert (ROOT / dist.path).is_dir(), f"{dist.name}: {dist.path} is not a directory"
        assert dist.may_depend_on <= names, f"{dist.name} may depend on unknown distributions"
    projects = [*ROOT.glob("*/pyproject.toml"), *ROOT.glob("*/*/pyproject.toml")]
    declared = {
        m.group(1) for p in projects if (m := re.search(r'^name = "([^"]+)"', p.read_text(), re.M))
    }
    assert declared == names, f"pyproject names {sorted(declared)} != the map's {sorted(names)}"


def test_no_import_cycle() -> None:
    _, graph, _ = _graph()
    assert len(graph) > 100, "the import graph is suspiciously small"
    found = cycles(graph)
    assert not found, "import cycles among modules:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_cross_distribution_imports_follow_the_map() -> None:
    dists, graph, owner = _graph()
    allowed = {d.name: d.may_depend_on for d in dists}
    crossing = {
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if owner[target] != owner[module] and owner[target] not in allowed[owner[module]]
    }
    known = read_exceptions(MAP.read_text())
    bad = sorted(
        f"{module} ({owner[module]}) imports {target} ({owner[target]})"
        for module, target in crossing - known
    )
    assert not bad, f"imports not allowed by {MAP.relative_to(ROOT)}:\n" + "\n".join(bad)
    stale = sorted(f"{module} -> {target}" for module, target in known - crossing)
    assert not stale, "known exceptions that no longer happen (remove them):\n" + "\n".join(stale)


def test_the_graph_sees_lazy_relative_and_type_only_imports() -> None:
    code = """
from typing import TYPE_CHECKING
from . import sibling
from .sub import thing
if TYPE_CHECKING:
    import p2pkv.tier
def f():
    from p2pkv_tools.bench import cli
"""
    names = set(imported_names(ast.parse(code), "p2pkv.session.env", False))
    assert {
        "p2pkv.session.sibling",
        "p2pkv.session.sub.thing",
        "p2pkv.tier",
        "p2pkv_tools.bench.cli",
    } <= names
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


MAX_METHODS = 30
"""Methods a class may define in its body (properties and static methods included). A class
past it holds more than one role: split it into role objects behind a facade."""
SUITE_PACKAGES = ("p2pkv.testing.suites",)
"""Conformance suites: pytest classes with one method per test, exempt from the limit."""
TEMPORARY_EXCEPTIONS: dict[str, str] = {
    # Classes still to split, each with why (the test fails when an entry is no longer
    # needed). None is left: issue 49's splits are all merged.
}


def class_sizes(dists: Sequence[Distribution]) -> dict[str, int]:
    """``module.Class`` -> the methods its body defines, for every class of every module
    (nested classes too), conformance suites left out."""
    sizes = {}
    for dist in dists:
        for module, path in module_files(dist).items():
            if module.startswith(SUITE_PACKAGES):
                continue
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef):
                    sizes[f"{module}.{node.name}"] = sum(
                        isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef)) for b in node.body
                    )
    return sizes


def test_no_class_holds_more_than_max_methods() -> None:
    sizes = class_sizes(read_map(MAP.read_text()))
    assert len(sizes) > 100, "suspiciously few classes found"
    big = sorted(
        f"{name}: {n} methods"
        for name, n in sizes.items()
        if n > MAX_METHODS and name not in TEMPORARY_EXCEPTIONS
    )
    assert not big, f"classes above {MAX_METHODS} methods (split them by role):\n" + "\n".join(big)
    stale = sorted(name for name in TEMPORARY_EXCEPTIONS if sizes.get(name, 0) <= MAX_METHODS)
    assert not stale, f"exceptions no longer needed (remove them): {stale}"
