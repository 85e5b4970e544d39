"""An idle source among many peers (``nox -s engine_fleet``: not in CI, 17 engines).

One ``vllm serve`` source ``A`` (its engine core runs as vLLM runs it, in its own process)
serves ``PROMPTS`` long prompts, then has no request of its own. ``PEERS`` offline engines
(``llm_host``) each pull the first prompt's prefix from ``A``, one after another, with a
hand-made ``remote_kv_source`` (a new peer's dial, handshake, probe and fetch), then, in
later rounds, the other prompts' (a probe and a fetch over the open session). Every pull
must get the prefix's full blocks as external hits. Reported (not asserted: measurements),
in docs/vllm.md "Idle sources":

- how long ``A`` took to answer, as each peer's tier saw it (``Engine.pull_marks``): from
  the request's first lookup to its first HIT (a fresh peer: dial, handshake and probe; a
  connected one: the probe) and from its load's submit to its result (the fetch), p50, p99
  and max per kind; and each pull's whole time as the peer's client sees it;
- ``A``'s CPU over ``GAP`` idle seconds before any peer connected and again with all
  ``PEERS`` sessions open, per thread of its process tree (p2pkv's watcher is
  ``p2pkv-idle``), and, over the first window, that of the same ``vllm serve`` with vLLM's
  offloading connector and no secondary tier, which served the same prompts (vLLM's own
  idle cost).
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(1800)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine_fleet)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine_fleet)")

from engine_kit import (  # noqa: E402
    P2PKV_TIER,
    Engine,
    free_port,
    full_blocks,
    kv_transfer_config,
    prompt,
    running,
)
from latency import summary  # noqa: E402
from llm_host import BLOCK_SIZE  # noqa: E402
from test_engine_prefix import (  # noqa: E402
    STORED,
    complete,
    remove_regions,
    server,
    server_env,
    wait_all_ready,
    wait_stored,
)
from test_engine_recipe import CPU_SERVER, counter, started  # noqa: E402

PEERS = int(os.environ.get("P2PKV_FLEET_PEERS", "16"))
"""Peers that pull from the idle source (``P2PKV_FLEET_PEERS``)."""
GAP = 20.0
"""Seconds the source's idle CPU is measured over (the scenario, not a settling delay)."""
BETWEEN = 0.5
"""Seconds the source stays idle between two peers' pulls."""
PROMPTS = int(os.environ.get("P2PKV_FLEET_PROMPTS", "4"))
"""Prompts the source serves (``P2PKV_FLEET_PROMPTS``); each round of pulls takes the prefix
of one (the first round from fresh peers)."""


@pytest.fixture(scope="module")
def source(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """``A`` (one ``vllm serve`` with the p2pkv tier), its pid, and the URL and pid of the
    same server with vLLM's offloading connector and no secondary tier (what p2pkv adds is
    the difference); regions removed afterwards."""
    a, base, env = server("a"), server("base"), server_env()
    tmp = tmp_path_factory.mktemp("fleet")
    offloading_only = kv_transfer_config(base.engine_id(), [])
    base_args = [
        *CPU_SERVER.format(python=sys.executable, model=tiny_model).split(),
        "--port",
        str(base.http),
        "--host",
        "127.0.0.1",
        "--kv-transfer-config",
        json.dumps(offloading_only),
    ]
    try:
        with (
            started(a.args(tiny_model), tmp / "a.log", env) as proc,
            started(base_args, tmp / "base.log", env) as base_proc,
        ):
            wait_all_ready(
                {"a": f"{a.url}/health", "base": f"{base.url}/health"},
                [proc, base_proc],
                [tmp / "a.log", tmp / "base.log"],
            )
            yield a, proc.pid, base.url, base_proc.pid
    finally:
        remove_regions(a, base)


def thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds (user + system) per thread name over ``pid``'s process tree."""
    import psutil

    ticks = os.sysconf("SC_CLK_TCK")
    per_name: dict[str, float] = {}
    for proc in (psutil.Process(pid), *psutil.Process(pid).children(recursive=True)):
        for task in glob.glob(f"/proc/{proc.pid}/task/*"):
            with contextlib.suppress(OSError, IndexError):
                with open(f"{task}/stat") as stat:
                    fields = stat.read().rpartition(")")[2].split()
                with open(f"{task}/comm") as comm:
                    name = comm.read().strip()
                used = (int(fields[11]) + int(fields[12])) / ticks  # utime, stime
                per_name[name] = per_name.get(name, 0.0) + used
    return per_name


def idle_cpu(*pids: int) -> list[dict[str, float]]:
    """The fraction of a core each pid's process tree used over the same ``GAP`` idle
    seconds, per thread name (``total``: all of them), busiest first."""
    before, began = [thread_cpu(pid) for pid in pids], time.monotonic()
    threading.Event().wait(GAP)
    spent = time.monotonic() - began
    shares = []
    for pid, was in zip(pids, before, strict=True):
        used = {name: (now - was.get(name, 0.0)) / spent for name, now in thread_cpu(pid).items()}
        busy = {
            name: round(share, 4)
            for name, share in sorted(used.items(), key=lambda item: -item[1])
            if share >= 0.0005
        }
        shares.append({"total": round(sum(used.values()), 4), **busy})
    return shares


def pull_round(
    peers: list[Engine], port: int, tokens: list[int], name: str
) -> list[dict[str, float]]:
    """Each peer pulls ``tokens``' prefix from the source, one after another, the source idle
    ``BETWEEN`` seconds before each; per pull, seconds from its first lookup to its first
    HIT (``answer``), from its load's submit to its result (``fetch``) and of the whole
    request (``pull``)."""
    held = full_blocks(tokens) * BLOCK_SIZE
    took = []
    for i, peer in enumerate(peers):
        threading.Event().wait(BETWEEN)  # A idle before each pull
        req_id = f"{name}-{i}"
        params = {
            "remote_kv_source": {
                "kv_request_id": req_id,
                "remote_host": "127.0.0.1",
                "remote_port": port,
            }
        }
        sent = time.monotonic()
        _, cached = peer.generate(req_id, tokens, 1, params)
        whole = time.monotonic() - sent
        assert cached == held, f"{name}, peer {i}: {cached} of {held} tokens from the source"
        marks = peer.pull_marks(req_id)
        took.append(
            {
                "answer": marks["hit"] - marks["lookup"],
                "fetch": marks["loaded"] - marks["load"],
                "pull": whole,
            }
        )
    return took


def test_an_idle_source_answers_many_peers(
    source: Any, tiny_model: str, record_property: Any
) -> None:
    a, pid, base_url, base_pid = source
    prompts = [prompt(90 + i, 460) for i in range(PROMPTS)]
    for tokens in prompts:
        stored = counter(a.metrics(), STORED)
        complete(a.url, tiny_model, tokens, 1)
        complete(base_url, tiny_model, tokens, 1)
        wait_stored(a, stored)
    cpu_alone, cpu_vllm = idle_cpu(pid, base_pid)
    peers = [
        Engine(f"peer{i}", tiny_model, {**P2PKV_TIER, "port": free_port()}) for i in range(PEERS)
    ]
    with running(*peers):
        fresh = pull_round(peers, a.p2p, prompts[0], "fresh")
        connected = [
            pull
            for i, tokens in enumerate(prompts[1:], 1)
            for pull in pull_round(peers, a.p2p, tokens, f"connected{i}")
        ]
        (cpu_with_peers,) = idle_cpu(pid)
    result = {
        "peers": PEERS,
        "fresh_peer": {kind: summary([p[kind] for p in fresh]) for kind in fresh[0]},
        "connected_peer": {kind: summary([p[kind] for p in connected]) for kind in connected[0]},
        "same_server_without_p2pkv_idle_cpu": cpu_vllm,
        "source_idle_cpu_no_peer": cpu_alone,
        f"source_idle_cpu_{PEERS}_peers": cpu_with_peers,
    }
    record_property("idle_fleet", result)
    print(f"\nidle source, {PEERS} peers: {result}")
