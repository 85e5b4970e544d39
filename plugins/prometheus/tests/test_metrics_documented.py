"""Every metric the plugins register is on the rendered observability page, with its type.

The page is rendered the way the docs site renders it: the mkdocs hooks (``docs/hooks``, so
the included README of ``p2pkv-prometheus`` is part of it) and then Markdown with tables.
Each metric table (header ``metric | type | ...``) gives documented name -> type; what the
plugins register must be there, and what is there must be registered (no stale names).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from types import ModuleType

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
markdown = pytest.importorskip("markdown")

ROOT = Path(__file__).resolve().parents[3]
PAGE = ROOT / "docs" / "observability.md"
HOOKS = ("include_readme", "config_reference")


def _hook(name: str) -> ModuleType:
    """A mkdocs hook of docs/hooks (on ``sys.path``: pytest's ``pythonpath``)."""
    return importlib.import_module(name)


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


def documented() -> dict[str, str]:
    """Metric name -> documented type, from the metric tables of the rendered page."""
    text = PAGE.read_text()
    for name in HOOKS:
        text = _hook(name).on_page_markdown(text)
    parser = _Tables()
    parser.feed(markdown.markdown(text, extensions=["tables"]))
    found: dict[str, str] = {}
    for header, *rows in (t for t in parser.tables if t):
        if header[:2] == ["metric", "type"]:
            found.update({row[0]: row[1] for row in rows})
    return found


def prometheus_metrics() -> dict[str, str]:
    from p2pkv_prometheus import Metrics

    registry = prometheus_client.CollectorRegistry()
    Metrics(registry)
    return {
        family.name + ("_total" if family.type == "counter" else ""): family.type
        for family in registry.collect()
    }


def vllm_metrics() -> dict[str, str]:
    metrics = pytest.importorskip("p2pkv_vllm.metrics")
    return {
        metrics.JOBS: "counter",
        metrics.JOB_SECONDS: "histogram",
        **{metrics.PREFIX + name: "counter" for name in metrics.COUNTERS},
        **{metrics.PREFIX + name: "gauge" for name in metrics.GAUGES},
    }


def proxy_metrics() -> dict[str, str]:
    metrics = pytest.importorskip("p2pkv_vllm.proxy.decision_metrics")
    return dict.fromkeys(metrics.METRICS, "counter")


@pytest.mark.parametrize("registered", [prometheus_metrics, vllm_metrics, proxy_metrics],
                         ids=["p2pkv-prometheus", "vllm-adapter", "proxy"])
def test_every_registered_metric_is_documented_with_its_type(
    registered: Callable[[], dict[str, str]],
) -> None:
    expected = registered()
    docs = documented()
    missing = sorted(set(expected) - set(docs))
    assert not missing, f"not on {PAGE.name}: {missing}"
    wrong = {name: (docs[name], kind) for name, kind in expected.items() if docs[name] != kind}
    assert not wrong, f"documented type differs (docs, registered): {wrong}"


def test_no_stale_metric_names_are_documented() -> None:
    registered = prometheus_metrics()
    families = ["p2pkv_"]
    if importlib.util.find_spec("p2pkv_vllm") is not None:
        registered |= vllm_metrics() | proxy_metrics()
        families.append("vllm:kv_offload_p2pkv_")
    stale = sorted(n for n in documented()
                   if n.startswith(tuple(families)) and n not in registered)
    assert not stale, f"documented but not registered: {stale}"
