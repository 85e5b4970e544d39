"""The API reference of docs/api.md (written into the page by ``reference_pages.py``).

It renders the ``p2pkv`` namespace and the public modules in :data:`MODULES`: each name of a
module's ``__all__`` with its signature and docstring. For a class it adds the public methods
and properties it defines or overrides. Docstrings are shown as written (preformatted). The
surface itself is pinned by ``core/tests/test_public_api.py``, not here."""

from __future__ import annotations

import importlib
import inspect
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
    if inspect.isclass(obj):
        parts = [f"### `{module}.{name}`", f"```python\nclass {_signature(name, obj)}\n```",
                 _doc(obj)]
        for member, value in _members(obj):
            target = value.fget if isinstance(value, property) else value
            shown = member if isinstance(value, property) else _signature(member, target)
            parts += [f"**`{shown}`**" + (" (property)" if isinstance(value, property) else ""),
                      _doc(target)]
        return "\n\n".join(parts)
    if callable(obj):
        return f"### `{module}.{name}`\n\n```python\n{_signature(name, obj)}\n```\n\n{_doc(obj)}"
    return f"### `{module}.{name}`\n\n```python\n{_value(name, obj)}\n```"


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

