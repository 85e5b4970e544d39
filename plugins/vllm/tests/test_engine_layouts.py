"""The models and KV layouts people serve, between real engines (``nox -s engine_layouts``).

Each shape is a tiny model of the real architecture (``tiny_model.py``: random weights, built
here) or a KV-cache setting, served by a reference engine (no connector) and a p2pkv
prefiller and decoder, which run ``test_engine_pd``'s tests: PD in both arrival orders and a
prefix pull from a source busy with its own request. Tokens must equal the reference's and
vLLM's counters must show the prompt's full blocks loaded from the tier (prompts of 200
tokens, longer than the hybrid models' 64-token window):

- ``fp8-kv``: the Llama-shaped model with ``--kv-cache-dtype fp8`` (1 byte per value);
- ``gemma3``: a sliding-window layer and a full-attention layer (two KV-cache groups);
- ``gpt-oss``: gpt-oss's alternating sliding and full layers, mixture of experts;
- ``mla``: DeepSeek-V2's multi-head latent attention (one latent per token and layer).

And two mismatches of the same block length and other bytes are refused at the handshake,
the decoder recomputing at once (these two also run in ``nox -s engine`` on the newest release,
in CI): a KV dtype
mismatch (``fp8`` against ``fp8_e5m2``) and a TP 1 prefiller with a TP 2 decoder without
``canonical_layout`` (which, before p2pkv kept the parallel sizes in its fingerprint, loaded
and decoded wrong tokens). TP 1 with TP 2 under ``canonical_layout: true`` is not run: the
test-only CPU offloading spec (``cpu_offload_spec``) has no canonical copy, and vLLM's own
worker for it needs CUDA.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.layouts, pytest.mark.timeout(1800)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine_layouts)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine_layouts)")

from engine_kit import (  # noqa: E402
    EXTERNAL_TOKENS,
    P2PKV_TIER,
    Engine,
    delta,
    free_port,
    full_blocks,
    pd_params,
    prompt,
    running,
)
from llm_host import BLOCK_SIZE  # noqa: E402
from test_engine_pd import (  # noqa: E402, F401 - the tests run again on each shape's pair
    MAX_TOKENS,
    SOURCE_TOKENS,
    STORED,
    Pair,
    Reference,
    reference,
    test_decoder_first,
    test_prefiller_first,
)

SHAPES: dict[str, tuple[str, dict[str, Any]]] = {
    "fp8-kv": ("llama", {"kv_cache_dtype": "fp8"}),
    "gemma3": ("gemma3", {}),
    "gpt-oss": ("gpt-oss", {}),
    "mla": ("deepseek", {}),
}
"""Shape -> (the tiny model's architecture, engine arguments)."""
CPU_CANNOT = {
    ("mla", "0.27.1"): "vLLM 0.27.1's CPU platform: NotImplementedError: MLA is not "
    "supported on CPU. (0.32 runs it)",
    ("gpt-oss", "0.27.1"): "vLLM 0.27.1's CPU attention (cpu_attention_with_kv_cache) on "
    "gpt-oss's sinks: RuntimeError: expected scalar type BFloat16 but "
    "found Float (0.32 runs it)",
}
"""(shape, vLLM release) -> why the CPU backend of that release cannot serve the shape at
all, with or without a connector (measured)."""
SHARED_SEED = 11
"""The prefix pull's prompt: with random weights, next-token distributions are nearly flat,
and an exact computation in another order (a loaded prefix, then the rest) can flip a greedy
choice between two tokens whose log-probabilities differ by 1e-4 (measured: MLA's CPU path,
``prompt(5)``). This prompt's greedy decode has no such near tie in any shape's reference
(smallest top-2 log-probability gap 0.009)."""


@pytest.fixture(scope="module", params=list(SHAPES))
def shape(
    request: pytest.FixtureRequest, tiny_models: Callable[[str], str]
) -> tuple[str, dict[str, Any]]:
    """(the model directory, engine arguments) of one shape."""
    import vllm

    cannot = CPU_CANNOT.get((request.param, vllm.__version__.partition("+")[0]))
    if cannot is not None:
        pytest.skip(cannot)
    arch, args = SHAPES[request.param]
    return tiny_models(arch), args


@pytest.fixture(scope="module")
def ref(shape: tuple[str, dict[str, Any]]) -> Iterator[Engine]:
    """The shape's reference engine, without a connector."""
    model, args = shape
    with running(Engine("ref", model, None, engine_args=args)) as (engine,):
        yield engine


@pytest.fixture(scope="module")
def pair(shape: tuple[str, dict[str, Any]]) -> Iterator[Pair]:
    """A p2pkv prefiller and decoder serving the shape."""
    model, args = shape
    with running(
        *(
            Engine(name, model, {**P2PKV_TIER, "port": free_port()}, engine_args=args)
            for name in ("pre", "dec")
        )
    ) as (pre, dec):
        yield pre, dec


def test_a_busy_source_shares_its_prefix(
    reference: Reference,  # noqa: F811
    pair: Pair,
) -> None:
    """``remote_kv_source`` from a source decoding a request of its own; then every chunk
    the consumer's CPU tier holds (the pulls of every test of the shape) is byte for byte a
    chunk of its source's: the bytes are checked apart from the tokens."""
    source, consumer = pair
    tokens = prompt(SHARED_SEED)
    expected = reference(tokens)
    before = source.metrics(), consumer.metrics()
    source.submit("own-request", tokens, SOURCE_TOKENS)
    source.wait_metric(STORED, before[0].get(STORED, 0) + 1)
    params = {
        "remote_kv_source": {
            "kv_request_id": "kv-shared",
            "remote_host": "127.0.0.1",
            "remote_port": source.port,
        }
    }
    out, cached = consumer.generate("reuse", tokens, MAX_TOKENS, params)
    assert out == expected
    assert cached == full_blocks(tokens) * BLOCK_SIZE
    assert delta(consumer.metrics(), before[1], EXTERNAL_TOKENS) == cached
    assert len(source.result("own-request")[0]) == SOURCE_TOKENS
    pulled = consumer.stored_chunks()
    assert pulled and pulled <= source.stored_chunks()


def _cpu_runs_fp8_kv() -> bool:
    """vLLM's CPU attention (0.32) runs an fp8 KV cache only on x86 with AVX-512 or AMX."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512f" in flags or "amx_tile" in flags


@pytest.mark.refusal  # in CI too: a refusal that must not regress into a silent load
@pytest.mark.skipif(
    not _cpu_runs_fp8_kv(),
    reason="this CPU has neither AVX-512 nor AMX: vLLM's CPU engine refuses an fp8 KV cache "
    "(NotImplementedError), so the two fp8 engines cannot start",
)
def test_a_kv_dtype_mismatch_is_refused_at_the_handshake(tiny_model: str) -> None:
    """fp8 (e4m3) and fp8_e5m2 blocks have the same length and other bytes: the peers'
    run-config fingerprints differ, the handshake refuses naming what can differ, the decoder
    recomputes; each engine logged its run config at start, so the two can be compared."""
    tier = {**P2PKV_TIER, "timeouts": {"handshake": 10, "load": 60}}
    with running(
        Engine(
            "pre", tiny_model, {**tier, "port": free_port()}, engine_args={"kv_cache_dtype": "fp8"}
        ),
        Engine(
            "dec",
            tiny_model,
            {**tier, "port": free_port()},
            engine_args={"kv_cache_dtype": "fp8_e5m2"},
        ),
    ) as (pre, dec):
        tokens = prompt(31)
        prefill, decode = pd_params("kv-mismatch", pre)
        before = dec.metrics()
        pre.generate("pre-mismatch", tokens, 1, prefill)
        out, cached = dec.generate("dec-mismatch", tokens, MAX_TOKENS, decode)
        assert cached == 0 and len(out) == MAX_TOKENS
        assert delta(dec.metrics(), before, EXTERNAL_TOKENS) == 0
        lines = pre.p2pkv_log() + dec.p2pkv_log()
        assert any("config fingerprint" in line and "KV cache dtype" in line for line in lines), (
            lines
        )
        for engine, dtype in ((pre, "fp8"), (dec, "fp8_e5m2")):  # what each runs, logged
            assert any(
                "run config" in line and f"dtype={dtype}," in line for line in engine.p2pkv_log()
            ), engine.p2pkv_log()


TP2 = {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
"""Engine arguments of a TP 2 engine (two worker processes)."""


@pytest.mark.refusal  # in CI too: a refusal that must not regress into a silent load
def test_tp1_and_tp2_without_the_canonical_layout_are_refused(tiny_model: str) -> None:
    """A TP 1 prefiller and a TP 2 decoder without ``canonical_layout``: the same chunk
    length, other byte order (trusting vLLM's "parallelism-agnostic" direct layout, the
    decoder loaded them and decoded wrong tokens). Their run-config fingerprints differ
    (``tp_size``), the handshake refuses at once, the decoder recomputes: its tokens equal
    the prefiller's own for the prompt."""
    with running(
        Engine("pre", tiny_model, {**P2PKV_TIER, "port": free_port()}),
        Engine("dec", tiny_model, {**P2PKV_TIER, "port": free_port()}, engine_args=TP2),
    ) as (pre, dec):
        tokens = prompt(32)
        prefill, decode = pd_params("kv-tp", pre)
        before = dec.metrics()
        pre.generate("pre-tp", tokens, 1, prefill)
        out, cached = dec.generate("dec-tp", tokens, MAX_TOKENS, decode)
        assert cached == 0
        assert out == pre.generate("pre-own", tokens, MAX_TOKENS)[0]
        assert delta(dec.metrics(), before, EXTERNAL_TOKENS) == 0
        lines = pre.p2pkv_log() + dec.p2pkv_log()
        assert any("config fingerprint" in line for line in lines), lines
        assert any("run config" in line and "tp_size=2" in line for line in dec.p2pkv_log())
