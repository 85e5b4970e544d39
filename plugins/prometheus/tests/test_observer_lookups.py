"""The pull's observers look each labelled child up once, and still count into it.

``transfer_finished`` and ``job_finished`` run once per pull on the driver thread. A
``labels()`` lookup costs a few microseconds, so the plugin keeps the children it found.
This counts the lookups (work, never time) and checks what the registry then exposes.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest

prometheus_client = pytest.importorskip("prometheus_client")

from p2pkv_prometheus import plugin  # noqa: E402
from p2pkv_prometheus.metrics import Metrics  # noqa: E402
from prometheus_client import CollectorRegistry  # noqa: E402

Counted = tuple[CollectorRegistry, Counter[str]]


@pytest.fixture
def counted(monkeypatch: pytest.MonkeyPatch) -> Iterator[Counted]:
    """Fresh metrics in their own registry, made the plugin's; ``labels()`` calls counted."""
    registry = CollectorRegistry()
    metrics = Metrics(registry)
    lookups: Counter[str] = Counter()
    for name in ("jobs", "job_seconds", "transfers"):
        family = getattr(metrics, name)
        monkeypatch.setattr(family, "labels", _counting(family.labels, name, lookups))
    monkeypatch.setattr(plugin, "_metrics", metrics)
    yield registry, lookups


def _counting(labels: Callable[..., Any], name: str, lookups: Counter[str]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        lookups[name] += 1
        return labels(*args, **kwargs)

    return call


def _pull(outcome: str = "done", success: bool = True) -> None:
    plugin.p2pkv_transfer_finished(
        peer="p:1", transfer_id=1, success=success, nbytes=65536, seconds=0.001
    )
    plugin.p2pkv_job_finished(
        job_id=1, is_load=True, outcome=outcome, kv_request_id="r", peer="p:1", seconds=0.002
    )


def test_one_lookup_per_label_set(counted: Counted) -> None:
    _, lookups = counted
    for _ in range(200):
        _pull()
    assert lookups == {"jobs": 1, "job_seconds": 1, "transfers": 1}
    _pull("transfer_failed", success=False)  # a new (kind, outcome): one more lookup each
    assert lookups == {"jobs": 2, "job_seconds": 2, "transfers": 2}
    for _ in range(50):
        _pull("transfer_failed", success=False)
    assert lookups == {"jobs": 2, "job_seconds": 2, "transfers": 2}


def test_kept_children_count_into_the_registry(counted: Counted) -> None:
    registry, _ = counted
    for _ in range(3):
        _pull()
    _pull("transfer_failed", success=False)
    plugin.p2pkv_job_finished(
        job_id=2, is_load=False, outcome="done", kv_request_id="r", peer="p:1", seconds=0.5
    )
    value = registry.get_sample_value
    assert value("p2pkv_jobs_total", {"kind": "load", "outcome": "done"}) == 3
    assert value("p2pkv_jobs_total", {"kind": "load", "outcome": "transfer_failed"}) == 1
    assert value("p2pkv_jobs_total", {"kind": "store", "outcome": "done"}) == 1
    assert value("p2pkv_transfers_total", {"result": "ok"}) == 3
    assert value("p2pkv_transfers_total", {"result": "failed"}) == 1
    assert value("p2pkv_job_duration_seconds_count", {"kind": "load"}) == 4
    assert value("p2pkv_job_duration_seconds_count", {"kind": "store"}) == 1
    assert value("p2pkv_bytes_read_total") == 3 * 65536
