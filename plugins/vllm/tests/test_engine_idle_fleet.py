"""An idle source among many peers (``nox -s engine_fleet``: not in CI, 17 engines).

One ``vllm serve`` source ``A`` (its engine core runs as vLLM runs it, in its own process)
serves a long prompt, then has no request of its own. ``PEERS`` offline engines
(``llm_host``) each pull that prefix from ``A`` once, one after another, with a hand-made
``remote_kv_source``: every pull is a new peer's dial, handshake, probe and fetch served by an
idle source. Every pull must get the prefix's full blocks as external hits. Reported (not
asserted: measurements), in docs/vllm.md "Idle sources":

- each pull's time as the peer sees it (its request, ``max_tokens`` 1: the source's answers
  plus the peer's own prefill of the prompt's last tokens), p50 and max;
- ``A``'s CPU (its process tree) over ``GAP`` idle seconds before any peer connected, and
  again with all ``PEERS`` sessions open.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(1800)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine_fleet)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine_fleet)")

from engine_kit import P2PKV_TIER, Engine, free_port, full_blocks, prompt, running  # noqa: E402
from llm_host import BLOCK_SIZE, ENGINE_ENV  # noqa: E402
from test_engine_prefix import (  # noqa: E402
    STORED,
    complete,
    counter,
    cpu_seconds,
    server,
    wait_all_ready,
    wait_stored,
)
from test_engine_recipe import started  # noqa: E402

PEERS = int(os.environ.get("P2PKV_FLEET_PEERS", "16"))
"""Peers that pull from the idle source (``P2PKV_FLEET_PEERS``)."""
GAP = 20.0
"""Seconds the source's idle CPU is measured over (the scenario, not a settling delay)."""
BETWEEN = 0.5
"""Seconds the source stays idle between two peers' pulls."""


@pytest.fixture(scope="module")
def source(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``A``: one ``vllm serve`` with the p2pkv tier; its regions removed afterwards."""
    a = server("a")
    env = {**os.environ, **ENGINE_ENV, "PYTHONPATH": str(Path(__file__).parent),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # the engine core runs as vLLM runs it
    log = tmp_path_factory.mktemp("fleet") / "a.log"
    try:
        with started(a.args(tiny_model), log, env) as proc:
            wait_all_ready({"a": f"{a.url}/health"}, [proc], [log])
            yield a, proc.pid
    finally:
        for path in Path("/dev/shm").glob(f"vllm_offload_{a.engine_id()}*"):
            with contextlib.suppress(FileNotFoundError):
                path.unlink()


def idle_cpu(pid: int) -> float:
    """The fraction of a core ``pid``'s process tree used over ``GAP`` idle seconds."""
    before, began = cpu_seconds(pid), time.monotonic()
    threading.Event().wait(GAP)
    return (cpu_seconds(pid) - before) / (time.monotonic() - began)


def test_an_idle_source_answers_many_fresh_peers(source: Any, tiny_model: str,
                                                  record_property: Any) -> None:
    a, pid = source
    tokens = prompt(90, 460)
    stored = counter(a.metrics(), STORED)
    complete(a.url, tiny_model, tokens, 1)
    wait_stored(a, stored)
    cpu_alone = idle_cpu(pid)
    held = full_blocks(tokens) * BLOCK_SIZE
    peers = [Engine(f"peer{i}", tiny_model, {**P2PKV_TIER, "port": free_port()})
             for i in range(PEERS)]
    pulls = []
    with running(*peers):
        for i, peer in enumerate(peers):
            threading.Event().wait(BETWEEN)  # A idle before each new peer's pull
            params = {"remote_kv_source": {"kv_request_id": f"fleet-{i}",
                                           "remote_host": "127.0.0.1", "remote_port": a.p2p}}
            sent = time.monotonic()
            _, cached = peer.generate(f"pull-{i}", tokens, 1, params)
            pulls.append(time.monotonic() - sent)
            assert cached == held, f"peer {i}: {cached} of {held} tokens from the source"
        cpu_with_peers = idle_cpu(pid)
    result = {"peers": PEERS, "pull_ms_p50": round(statistics.median(pulls) * 1000, 1),
              "pull_ms_max": round(max(pulls) * 1000, 1),
              "pull_ms": [round(p * 1000, 1) for p in pulls],
              "source_cpu_idle_alone": round(cpu_alone, 4),
              f"source_cpu_idle_{PEERS}_peers": round(cpu_with_peers, 4)}
    record_property("idle_fleet", result)
    print(f"\nidle source, {PEERS} fresh peers: {result}")
