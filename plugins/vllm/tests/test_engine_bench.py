"""The engine benchmark's quick form between real engines (``engine_bench.py --quick``; in CI
through ``nox -s engine`` on the newest release only: ``-m engine_bench_quick``), and across a
veth between two network namespaces (``--quick --netns``: ``-m engine_bench_netns``, as root,
not in CI: ``nox -s engine_bench_netns``).

Both tiers (p2pkv's and vLLM's built-in ``p2p``), two pulled lengths, one repetition: the
same code as the full benchmark (docs/benchmarks.md, "Between real engines"). Asserted,
behaviour only, never a time: no check of the run failed (every pull brought the whole
prefix as external tokens, ``B``'s greedy tokens equal the source's, local hits and
recomputes are what they claim), each tier made the pulls the run plans (the first pull,
then a warm-up, an idle and a busy-source pull per length and repetition), every p2pkv idle
pull's fetch has its phases (``engine_bench.INTERVALS``: it read, the read ended, its result
reached vLLM), and the fit and the p2pkv / built-in ratios came out as finite numbers.
Across the veth (one length, a shaped link): the same checks, every tier's KV crossed the
veth (its source end sent at least the bytes the pulls brought), raw NIXL READ and WRITE
moved verified bytes over the same link in the same run, the tiers were bound to the
namespace addresses, and the namespaces are gone afterwards; without root the run ends in
one line, exit status 2.
"""

from __future__ import annotations

import math
import os
import subprocess
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import pytest

pytestmark = [pytest.mark.timeout(600)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")

from engine_bench import (  # noqa: E402
    BUILTIN,
    RAW_PHASE,
    TIERS,
    WARM_TOKENS,
    Settings,
    main,
    render,
    run,
)
from p2pkv_tools.bench.netns import (  # noqa: E402
    PREFIX,
    NetnsUnavailable,
    check_tools,
    open_link,
    parse_rate,
)
from tiny_model import kv_bytes_per_token  # noqa: E402

COST_KEYS = (
    "prefillMicrosecondsPerToken",
    "transferMicrosecondsPerToken",
    "transferFixedMs",
    "sourceWaitMs",
)
PULLS_PER_REPETITION = 3
"""A warm-up pull after the pair resumes, the idle pull, the busy-source pull."""


def finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and math.isfinite(value)


@pytest.mark.engine_bench_quick
def test_the_quick_form_measures_both_tiers(
    tiny_models: Callable[[str], str], record_property: Any
) -> None:
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
    idle_marks = [m["idle"] for row in doc["tiers"]["p2pkv"]["lengths"] for m in row["p2pkv_marks"]]
    assert len(idle_marks) == len(settings.lengths) * settings.reps
    for marks in idle_marks:  # every pull's fetch by phase: it read, the read ended, reported
        assert {"fetch", "to_read", "read", "read_cpu", "to_end", "report"} <= set(marks), marks
        assert all(value >= 0 for value in marks.values()), marks
    builtin = doc["tiers"][BUILTIN]["cost_model"]
    for key, ratio in doc["ratios"].items():
        computable = builtin.get(key, 1.0) > 0  # first_pull_ms: not a costModel key
        assert finite(ratio) if computable else ratio is None, (key, ratio)


RATE = "2gbit"
"""The netns test's link is shaped (``--rate``'s path), far above what the pulls need."""


def namespaces() -> list[str]:
    """This process's link namespaces that exist now."""
    listed = subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True, timeout=20, check=True
    ).stdout
    return [
        line.split()[0]
        for line in listed.splitlines()
        if line.startswith(f"{PREFIX}{os.getpid()}-")
    ]


@pytest.mark.engine_bench_netns
def test_the_quick_form_across_a_veth(
    tiny_models: Callable[[str], str], record_property: Any
) -> None:
    try:
        check_tools(shaped=True)
    except NetnsUnavailable as exc:
        pytest.skip(str(exc))
    quick = Settings.quick_form()
    settings = replace(quick, lengths=quick.lengths[-1:])
    with open_link(parse_rate(RATE)) as link:
        doc = run(settings, tiny_models("llama-bench"), progress=print, link=link)
    assert namespaces() == []
    print(f"\n{render(doc)}")
    record_property("engine_bench_netns", doc["link"])
    checks, (n,) = doc["checks"], settings.lengths
    assert checks["failures"] == []
    assert checks["pulls"] == checks["full_pulls"] == dict.fromkeys(TIERS, 1 + 3)
    # the first pull, then a warm-up, an idle and a busy pull: n tokens each, the warm-up 64
    assert checks["pulled_tokens"] == dict.fromkeys(TIERS, 3 * n + WARM_TOKENS)
    described = doc["link"]
    assert (described["kind"], described["rate"]) == ("netns", RATE)
    for tier, tokens in checks["pulled_tokens"].items():
        kv = tokens * kv_bytes_per_token()
        assert described["kv_bytes_pulled"][tier] == kv
        assert described["carried_bytes"][tier] >= kv, (tier, described["carried_bytes"])
        assert doc["tiers"][tier]["entry"]["host"] == link.source.address
    assert doc["tiers"]["p2pkv"]["entry"]["control_options"]["insecure"] is True
    raws = described["raw_nixl"]["rows"]
    assert sorted(r["series"] for r in raws) == ["raw nixl", "raw nixl write"]
    for raw in raws:
        assert raw["error"] == "" and raw["verified"] and raw["bytes_verified"] > 0, raw
    assert described["carried_bytes"][RAW_PHASE] >= sum(r["bytes_moved"] for r in raws)


@pytest.mark.engine_bench_netns
def test_netns_without_root_ends_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert main(["--quick", "--netns"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert lines == [
        "engine_bench: --netns needs root and iproute2 (ip, tc): this process "
        "runs as uid 1000, not root"
    ]
