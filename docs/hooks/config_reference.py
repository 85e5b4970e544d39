"""The configuration reference of docs/configuration.md: tables generated from TierConfig
(written into the page by ``reference_pages.py``).

The tables come from the dataclasses in ``p2pkv.config`` (field names, defaults, and the
docstring under each field), so the reference cannot drift from the code. The top-level table
lists exactly the keys ``TierConfig.from_dict`` accepts (``p2pkv.options.option_keys``): a
field that is not a key (``dp_rank``, which the engine passes) stays out.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
from typing import Any

from p2pkv import config
from p2pkv.options import option_key


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
        key = option_key(f)
        rows.append(f"| `{prefix}{key}` | `{_default(f)}` | {docs.get(f.name, '')} |")
    return "\n".join(rows)


def _top_table() -> str:
    docs = _field_docs(config.TierConfig)
    rows = list(_HEADER)
    for f in dataclasses.fields(config.TierConfig):
        key = option_key(f)
        if key is not None:
            rows.append(f"| `{key}` | `{_default(f)}` | {docs.get(f.name, '')} |")
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
        "",
        "### `flow`",
        _table(config.Flow, "flow."),
        "",
        "### `peers`",
        _table(config.Peers, "peers."),
    ]
    return "\n".join(parts)
