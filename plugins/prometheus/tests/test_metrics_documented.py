"""Every metric the plugins register is on the rendered observability page, with its type.

The page is rendered the way the docs site renders it: the mkdocs hooks (``docs/hooks``, so
the included README of ``p2pkv-prometheus`` is part of it) and then Markdown with tables.
Each metric table (header ``metric | type | ...``) gives documented name -> type; what the
plugins register must be there, and what is there must be registered (no stale names).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import pytest

prometheus_client = pytest.importorskip("prometheus_client")
markdown = pytest.importorskip("markdown")

from documented_metrics import PAGE  # noqa: E402
from documented_metrics import documented as documented_with  # noqa: E402


def documented() -> dict[str, str]:
    """Metric name -> documented type, from the metric tables of the rendered page."""
    return documented_with("")


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
    return {  # counters as /metrics shows them: with _total
        metrics.JOBS + "_total": "counter",
        metrics.JOB_SECONDS: "histogram",
        **{metrics.PREFIX + name + "_total": "counter" for name in metrics.COUNTERS},
        **{metrics.PREFIX + name: "gauge" for name in metrics.GAUGES},
    }


def proxy_metrics() -> dict[str, str]:
    metrics = pytest.importorskip("p2pkv_vllm.proxy.decision_metrics")
    return dict.fromkeys(metrics.METRICS, "counter")


@pytest.mark.parametrize(
    "registered",
    [prometheus_metrics, vllm_metrics, proxy_metrics],
    ids=["p2pkv-prometheus", "vllm-adapter", "proxy"],
)
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
    stale = sorted(n for n in documented() if n.startswith(tuple(families)) and n not in registered)
    assert not stale, f"documented but not registered: {stale}"
