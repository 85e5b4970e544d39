"""The metric tables of docs/observability.md, rendered as the docs site renders the page (the
mkdocs hook, so the included README of ``p2pkv-prometheus`` is part of it), and the metric
families of a Prometheus text exposition, named as ``/metrics`` shows them."""

from __future__ import annotations

import importlib
from html.parser import HTMLParser
from pathlib import Path

import markdown
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "observability.md"
HOOKS = ("include_readme",)


class _Tables(HTMLParser):
    """Rows of every HTML table, cell texts stripped."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[list[list[str]]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag: str, attrs: object) -> None:
        if tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag: str) -> None:
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1][-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)


def documented(prefix: str) -> dict[str, str]:
    """Metric name -> documented type, for the names starting with ``prefix``, from every
    table of the rendered page whose header starts ``metric | type``."""
    text = PAGE.read_text()
    for name in HOOKS:
        text = importlib.import_module(name).on_page_markdown(text)
    parser = _Tables()
    parser.feed(markdown.markdown(text, extensions=["tables"]))
    found: dict[str, str] = {}
    for header, *rows in (t for t in parser.tables if t):
        if header[:2] == ["metric", "type"]:
            found.update({row[0]: row[1] for row in rows if row[0].startswith(prefix)})
    return found


def exposed(text: str, prefix: str) -> dict[str, str]:
    """Metric name -> type of the families in a Prometheus text exposition whose names start
    with ``prefix``, named as the exposition shows them (a counter with its ``_total``)."""
    return {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in text_string_to_metric_families(text)
        if family.name.startswith(prefix)
    }
