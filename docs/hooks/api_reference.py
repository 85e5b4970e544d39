"""The API reference of docs/api.md (written into the page by ``reference_pages.py``).

It renders the ``p2pkv`` namespace and the public modules in :data:`MODULES`: each name of a
module's ``__all__`` with its signature and docstring. For a class it adds the public methods
and properties it defines or overrides. Docstrings are shown as written (preformatted). The
surface itself is pinned by ``core/tests/test_public_api.py``, not here."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import itertools
import typing
from collections.abc import Iterator
from typing import Any

MODULES = (
    "p2pkv",
    "p2pkv.hookspecs",
    "p2pkv.reference",
    "p2pkv.reference.delegating",
    "p2pkv.testing.suites",
    "p2pkv.testing.stateful",
    "p2pkv.testing.tier_machine",
    "p2pkv.testing.harness",
)
"""The namespace first, then the public modules a plugin author reads most."""


def _doc(obj: Any) -> str:
    text = inspect.getdoc(obj) or "(no docstring)"
    return f"```text\n{text}\n```"


def _signature(name: str, obj: Any) -> str:
    try:  # annotations are strings (postponed evaluation): shown without their quotes
        return f"{name}{inspect.signature(obj)}".replace("'", "")
    except (TypeError, ValueError):
        return name


def _members(cls: type) -> Iterator[tuple[str, Any]]:
    """Public methods and properties ``cls`` defines itself (not inherited unchanged)."""
    for name, value in vars(cls).items():
        member = value.__func__ if isinstance(value, (staticmethod, classmethod)) else value
        if not name.startswith("_") and (callable(member) or isinstance(member, property)):
            yield name, member


def _entry(module: str, name: str, obj: Any) -> str:
    if typing.get_origin(obj) is not None:  # a type alias: as written, not the origin's doc
        written = _assignments(_defining_module(module, name)).get(name, (repr(obj), None))[0]
        return _constant(module, name, f"{name} = {written}")
    if inspect.isclass(obj):
        parts = [
            f"### `{module}.{name}`",
            f"```python\nclass {_signature(name, obj)}\n```",
            _doc(obj),
        ]
        for member, value in _members(obj):
            target = value.fget if isinstance(value, property) else value
            shown = member if isinstance(value, property) else _signature(member, target)
            parts += [
                f"**`{shown}`**" + (" (property)" if isinstance(value, property) else ""),
                _doc(target),
            ]
        return "\n\n".join(parts)
    if callable(obj):
        return f"### `{module}.{name}`\n\n```python\n{_signature(name, obj)}\n```\n\n{_doc(obj)}"
    return _constant(module, name, _value(name, obj))


def _constant(module: str, name: str, shown: str) -> str:
    """A constant or alias, with the docstring written under its assignment, if any."""
    entry = f"### `{module}.{name}`\n\n```python\n{shown}\n```"
    doc = _assignments(_defining_module(module, name)).get(name, ("", None))[1]
    return entry if doc is None else f"{entry}\n\n```text\n{doc}\n```"


def _defining_module(module: str, name: str) -> str:
    """Where ``name`` is assigned: ``p2pkv`` re-exports names of internal modules."""
    mod = importlib.import_module(module)
    return str(getattr(mod, "_MODULE_OF", {}).get(name, module))


@functools.cache
def _assignments(module: str) -> dict[str, tuple[str, str | None]]:
    """Module-level ``NAME = value``: name -> (the value as written, the docstring under it)."""
    try:
        source = inspect.getsource(importlib.import_module(module))
    except (OSError, TypeError):
        return {}
    body = ast.parse(source).body
    found: dict[str, tuple[str, str | None]] = {}
    for node, after in itertools.pairwise([*body, ast.Pass()]):
        if not isinstance(node, (ast.AnnAssign, ast.Assign)):
            continue
        target: ast.expr = node.target if isinstance(node, ast.AnnAssign) else node.targets[0]
        value = node.value
        if not isinstance(target, ast.Name) or value is None:
            continue
        doc = None
        if isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant):
            doc = inspect.cleandoc(str(after.value.value))
        found[target.id] = (ast.get_source_segment(source, value) or "", doc)
    return found


def _value(name: str, obj: Any) -> str:
    """A constant as ``name = repr``; an object whose repr changes between runs (addresses
    in it) by its type only, so the page is the same at every generation."""
    if isinstance(obj, (bool, int, float, str, bytes, tuple, frozenset, type(None))):
        return f"{name} = {obj!r}"
    return f"{name}: {type(obj).__name__}"


def render() -> str:
    sections = []
    for module in MODULES:
        mod = importlib.import_module(module)
        sections.append(f"## `{module}`\n\n{_doc(mod)}")
        sections += [_entry(module, name, getattr(mod, name)) for name in mod.__all__]
    return "\n\n".join(sections)
