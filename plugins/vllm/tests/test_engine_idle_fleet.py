"""An idle source among many peers (``nox -s engine_fleet``: not in CI, 17 engines).

One ``vllm serve`` source ``A`` (its engine core runs as vLLM runs it, in its own process)
serves two long prompts, then has no request of its own. ``PEERS`` offline engines
(``llm_host``) each pull the first prompt's prefix from ``A``, one after another, with a
hand-made ``remote_kv_source`` (a new peer's dial, handshake, probe and fetch), then, in a
second round, the second prompt's (a probe and a fetch over the open session). Every pull
must get the prefix's full blocks as external hits. Reported (not asserted: measurements),
in docs/vllm.md "Idle sources":

- each pull's time as the peer sees it (its request, ``max_tokens`` 1: the source's answers
  plus the peer's own prefill of the prompt's last tokens), p50 and max, per round;
- ``A``'s CPU (its process tree) over ``GAP`` idle seconds before any peer connected, and
  again with all ``PEERS`` sessions open; and, over the first window, the CPU of the same
  ``vllm serve`` without a connector (vLLM's own idle cost).
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(1800)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine_fleet)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine_fleet)")

from engine_kit import P2PKV_TIER, Engine, free_port, full_blocks, prompt, running  # noqa: E402
from llm_host import BLOCK_SIZE  # noqa: E402
from test_engine_prefix import (  # noqa: E402
    STORED,
    complete,
    counter,
    cpu_seconds,
    remove_regions,
    server,
    server_env,
    wait_all_ready,
    wait_stored,
)
from test_engine_recipe import CPU_SERVER, started  # noqa: E402

PEERS = int(os.environ.get("P2PKV_FLEET_PEERS", "16"))
"""Peers that pull from the idle source (``P2PKV_FLEET_PEERS``)."""
GAP = 20.0
"""Seconds the source's idle CPU is measured over (the scenario, not a settling delay)."""
BETWEEN = 0.5
"""Seconds the source stays idle between two peers' pulls."""


@pytest.fixture(scope="module")
def source(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``A`` (one ``vllm serve`` with the p2pkv tier) and the pid of the same server without
    a connector; regions removed afterwards."""
    a, base_port, env = server("a"), free_port(), server_env()
    tmp = tmp_path_factory.mktemp("fleet")
    base_args = [*CPU_SERVER.format(python=sys.executable, model=tiny_model).split(),
                 "--port", str(base_port), "--host", "127.0.0.1"]
    try:
        with started(a.args(tiny_model), tmp / "a.log", env) as proc, \
                started(base_args, tmp / "base.log", env) as base:
            wait_all_ready({"a": f"{a.url}/health",
                            "base": f"http://127.0.0.1:{base_port}/health"},
                           [proc, base], [tmp / "a.log", tmp / "base.log"])
            yield a, proc.pid, base.pid
    finally:
        remove_regions(a)


def idle_cpu(*pids: int) -> list[float]:
    """The fraction of a core each pid's process tree used over the same ``GAP`` idle
    seconds."""
    before, began = [cpu_seconds(pid) for pid in pids], time.monotonic()
    threading.Event().wait(GAP)
    spent = time.monotonic() - began
    return [(cpu_seconds(pid) - b) / spent for pid, b in zip(pids, before, strict=True)]


def pull_round(peers: list[Engine], port: int, tokens: list[int], name: str) -> list[float]:
    """Each peer pulls ``tokens``' prefix from the source, one after another, the source idle
    ``BETWEEN`` seconds before each; the pulls' times (s)."""
    held = full_blocks(tokens) * BLOCK_SIZE
    took = []
    for i, peer in enumerate(peers):
        threading.Event().wait(BETWEEN)  # A idle before each pull
        params = {"remote_kv_source": {"kv_request_id": f"{name}-{i}",
                                       "remote_host": "127.0.0.1", "remote_port": port}}
        sent = time.monotonic()
        _, cached = peer.generate(f"{name}-{i}", tokens, 1, params)
        took.append(time.monotonic() - sent)
        assert cached == held, f"{name}, peer {i}: {cached} of {held} tokens from the source"
    return took


def summary(took: list[float]) -> dict[str, Any]:
    return {"p50_ms": round(statistics.median(took) * 1000, 1),
            "max_ms": round(max(took) * 1000, 1), "ms": [round(t * 1000, 1) for t in took]}


def test_an_idle_source_answers_many_peers(source: Any, tiny_model: str,
                                           record_property: Any) -> None:
    a, pid, base_pid = source
    first, second = prompt(90, 460), prompt(91, 460)
    for tokens in (first, second):
        stored = counter(a.metrics(), STORED)
        complete(a.url, tiny_model, tokens, 1)
        wait_stored(a, stored)
    cpu_alone, cpu_vllm = idle_cpu(pid, base_pid)
    peers = [Engine(f"peer{i}", tiny_model, {**P2PKV_TIER, "port": free_port()})
             for i in range(PEERS)]
    with running(*peers):
        fresh = pull_round(peers, a.p2p, first, "fresh")
        connected = pull_round(peers, a.p2p, second, "connected")
        (cpu_with_peers,) = idle_cpu(pid)
    result = {"peers": PEERS, "fresh_peer_pull": summary(fresh),
              "connected_peer_pull": summary(connected),
              "vllm_serve_idle_cpu_without_connector": round(cpu_vllm, 4),
              "source_idle_cpu_no_peer": round(cpu_alone, 4),
              f"source_idle_cpu_{PEERS}_peers": round(cpu_with_peers, 4)}
    record_property("idle_fleet", result)
    print(f"\nidle source, {PEERS} peers: {result}")
