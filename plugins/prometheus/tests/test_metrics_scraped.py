"""The ``/metrics`` of a running tier, scraped over HTTP, against docs/observability.md.

A process runs two tiers that exchange PD requests, with p2pkv-prometheus loaded through its
entry point (as in an engine), and serves its default registry over HTTP. Every ``p2pkv_*``
family it exposes must be in the page's metric tables with the same type, named as exposed
(a counter with ``_total``), and every documented ``p2pkv_*`` metric must be exposed. The
vLLM adapter's side is checked against a real engine's registry in
plugins/vllm/tests/test_engine_metrics_documented.py.
"""

from __future__ import annotations

import urllib.request

import pytest

pytest.importorskip("prometheus_client")
pytest.importorskip("markdown")
pytest.importorskip("zmq", reason="needs pyzmq (p2pkv-zmq)")

import scraped_tier
from documented_metrics import documented, exposed
from p2pkv.testing.child import Child

T = 60.0


def test_every_exposed_metric_is_documented_as_exposed() -> None:
    with Child(scraped_tier.serve, 3) as child:
        kind, port, outcomes = child.recv(T, "the tier's metrics port")
        assert kind == "port" and outcomes == ["done"] * 6, outcomes
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=T) as reply:
            text = reply.read().decode()
        child.send("stop")
    scraped = {
        name: kind
        for name, kind in exposed(text, "p2pkv_").items()
        if not name.endswith("_created")
    }
    assert "p2pkv_jobs_total" in scraped and "p2pkv_bytes_read_total" in scraped, scraped
    tier_metrics = {
        name: kind
        for name, kind in documented("p2pkv_").items()
        if not name.startswith("p2pkv_proxy_")
    }  # p2pkv proxy's, not a tier's
    assert scraped == tier_metrics
