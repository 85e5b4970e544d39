"""mkdocs hook: replace ``<!-- config-reference -->`` with tables generated from TierConfig.

The tables come from the dataclasses in ``p2pkv.config`` (field names, defaults, and the
docstring under each field), so the reference cannot drift from the code. The top-level table
lists exactly the keys ``TierConfig.from_dict`` accepts (``config._TOP_KEYS``): a field that is
not a key (``dp_rank``, which the engine passes) stays out, and a key that is not a field
(``type``) is described in ``_NOT_FIELDS``; a key with neither fails the docs build.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from typing import Any

from p2pkv import config

MARKER = "<!-- config-reference -->"
_KEY_NAMES = {"base_port": "port"}
_NOT_FIELDS = {
    "type": ("none", "The tier's type name, read by the engine (vLLM: `\"P2PKVTier\"`, with "
             "`module_path`); p2pkv only checks that it is a string."),
}


def _field_docs(cls: type) -> dict[str, str]:
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs: dict[str, str] = {}
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def _default(f: dataclasses.Field[Any]) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        return "{}" if isinstance(value, dict) else "see below"
    return "required"


_HEADER = ["| key | default | meaning |", "|---|---|---|"]


def _table(cls: type, prefix: str) -> str:
    docs = _field_docs(cls)
    rows = list(_HEADER)
    for f in dataclasses.fields(cls):
        key = _KEY_NAMES.get(f.name, f.name)
        rows.append(f"| `{prefix}{key}` | `{_default(f)}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)


def _top_table() -> str:
    docs = _field_docs(config.TierConfig)
    by_key = {_KEY_NAMES.get(f.name, f.name): f for f in dataclasses.fields(config.TierConfig)}
    rows = list(_HEADER)
    for key in config._TOP_KEYS:
        f = by_key.get(key)
        default, meaning = (f"`{_default(f)}`", docs.get(f.name, "")) if f else _NOT_FIELDS[key]
        rows.append(f"| `{key}` | {default} | {meaning} |")
    return "\n".join(rows)


def render() -> str:
    parts = [
        "### Top-level keys",
        _top_table(),
        "",
        "### `timeouts` (seconds)",
        _table(config.Timeouts, "timeouts."),
        "",
        "### `limits`",
        _table(config.Limits, "limits."),
    ]
    return "\n".join(parts)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if MARKER in markdown:
        return markdown.replace(MARKER, render())
    return markdown
