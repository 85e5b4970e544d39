"""The engine benchmark's quick form between real engines (``engine_bench.py --quick``; in CI
through ``nox -s engine`` on the newest release only: ``-m engine_bench_quick``).

Both tiers (p2pkv's and vLLM's built-in ``p2p``), two pulled lengths, one repetition: the
same code as the full benchmark (docs/benchmarks.md, "Between real engines"). Asserted,
behaviour only, never a time: no check of the run failed (every pull brought the whole
prefix as external tokens, ``B``'s greedy tokens equal the source's, local hits and
recomputes are what they claim), each tier made the pulls the run plans (the first pull,
then a warm-up, an idle and a busy-source pull per length and repetition), and the fit and
the p2pkv / built-in ratios came out as finite numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest

pytestmark = [pytest.mark.engine_bench_quick, pytest.mark.timeout(600)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")

from engine_bench import BUILTIN, TIERS, Settings, render, run  # noqa: E402

COST_KEYS = ("prefillMicrosecondsPerToken", "transferMicrosecondsPerToken", "transferFixedMs",
             "sourceWaitMs")
PULLS_PER_REPETITION = 3
"""A warm-up pull after the pair resumes, the idle pull, the busy-source pull."""


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


def test_the_quick_form_measures_both_tiers(tiny_models: Callable[[str], str],
                                            record_property: Any) -> None:
    settings = Settings.quick_form()
    doc = run(settings, tiny_models("llama-bench"), progress=print)
    print(f"\n{render(doc)}")
    record_property("engine_bench_quick", {t: v["cost_model"] for t, v in doc["tiers"].items()})
    checks = doc["checks"]
    assert checks["failures"] == []
    planned = 1 + len(settings.lengths) * settings.reps * PULLS_PER_REPETITION
    assert checks["pulls"] == checks["full_pulls"] == dict.fromkeys(TIERS, planned)
    for tier, result in doc["tiers"].items():
        model = result["cost_model"]
        assert all(finite(model[key]) for key in COST_KEYS), (tier, model)
        assert all(finite(value) for value in model["fit"].values()), (tier, model)
        assert finite(result["first_pull"]["ttft_ms"])
        assert {row["tokens"] for row in result["lengths"]} == set(settings.lengths)
    builtin = doc["tiers"][BUILTIN]["cost_model"]
    for key, ratio in doc["ratios"].items():
        computable = builtin.get(key, 1.0) > 0  # first_pull_ms: not a costModel key
        assert finite(ratio) if computable else ratio is None, (key, ratio)
