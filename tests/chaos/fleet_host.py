"""A fleet host: one spawned process running several real tiers (zmq control), driven over a
pipe, for the fleet-scale chaos tests (issue 48: the startup storm, a DP pod as a failure
domain, floods of client-named peers).

Data moves through ``/dev/shm``: each tier's region is a file there, and a peer's region is
mapped by the name its descriptor carries (:class:`ShmDataTransport`, the reference memory
transport with regions shared between processes). That keeps 64 tiers within this machine's
memory; the control plane, whose behaviour these tests examine, is the real zmq transport.
A block's bytes are a function of its key (:func:`content`), so a consumer checks every
block it loaded against the key, in its own process.

Pipe protocol (harness traffic only). The host first sends ``("bound", [address, ...])``:
its control transports are bound, no tier exists yet. Parent -> host: ``("start", config
overrides)`` builds the tiers (the storm's instant); ``("load", tier, job, kv, peer, keys,
slots)`` and ``("store", tier, job, kv, keys, slots)`` are PD halves; ``("finish", tier, kv,
role)``; ``("flood", tier, spec)`` starts a flood of requests naming bogus peers
(:class:`Flood`); ``("stats",)``; ``("stop",)``. Host -> parent: ``("results", tier,
[(job, outcome, detail, bad_blocks), ...])`` as jobs end, ``("stats", t, [stats, ...])``,
``("flood", t, tier, counters)`` when a flood ends, ``("stopped",)``.
"""

from __future__ import annotations

import contextlib
import hashlib
import mmap
import os
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgpack
import numpy as np
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, DataSettings
from p2pkv.reference import data as memory_data
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.registry import default_registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, RequestContext

__all__ = ["SHM_PREFIX", "Flood", "HostSpec", "ShmDataTransport", "content", "host_main"]

SHM_PREFIX = "p2pkv-fleet-"
_LIFETIME = 900.0  # a host never outlives this, whatever happens to its parent
_IDLE_WAIT = 0.002


def content(key: bytes, block_len: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """The bytes of the block stored under ``key`` (``block_len``: a multiple of 64)."""
    digest = hashlib.blake2b(key, digest_size=64).digest()
    return np.frombuffer(digest * (block_len // 64), np.uint8)


class ShmRegion:
    """A region in a ``/dev/shm`` file, unlinked by :meth:`close`."""

    def __init__(self, num_blocks: int, block_len: int) -> None:
        self.name = f"{SHM_PREFIX}{uuid.uuid4().hex}"
        fd = os.open(f"/dev/shm/{self.name}", os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, num_blocks * block_len)
            self.map = mmap.mmap(fd, num_blocks * block_len)
        finally:
            os.close(fd)
        self.blocks = np.frombuffer(self.map, np.uint8).reshape(num_blocks, block_len)

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/{self.name}")


class ShmDataTransport(MemoryDataTransport):
    """The memory data transport across processes: a peer's region is mapped from the
    ``/dev/shm`` file its descriptor names, then read like a region of this process."""

    def __init__(self, settings: DataSettings, shm_name: str) -> None:
        super().__init__(settings)
        self._shm_name = shm_name
        self._mapped: dict[str, mmap.mmap] = {}

    def descriptor(self) -> bytes:
        desc = msgpack.unpackb(super().descriptor(), raw=False)
        packed: bytes = msgpack.packb({**desc, "shm": self._shm_name})
        return packed

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Any:
        desc = msgpack.unpackb(descriptor, raw=False)
        region, name = desc.get("region"), desc.get("shm")
        if isinstance(region, str) and isinstance(name, str) and name.startswith(SHM_PREFIX):
            with memory_data._REGIONS_LOCK:
                known = region in memory_data._REGIONS
            if not known and os.path.exists(f"/dev/shm/{name}"):
                self._map(region, name, desc["num_blocks"], desc["block_len"])
        return super()._attach_peer(peer_id, descriptor)

    def _map(self, region: str, name: str, num_blocks: int, block_len: int) -> None:
        fd = os.open(f"/dev/shm/{name}", os.O_RDONLY)
        try:
            mapped = mmap.mmap(fd, num_blocks * block_len, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self._mapped[region] = mapped
        view = np.frombuffer(mapped, np.uint8).reshape(num_blocks, block_len)
        with memory_data._REGIONS_LOCK:
            memory_data._REGIONS[region] = view


@dataclass(frozen=True)
class Flood:
    """Requests naming ``count`` distinct bogus peers (``127.a.b.c:port``), ``per_tick`` of
    them between two ticks; every ``load_every``-th also submits a load."""

    port: int
    count: int
    per_tick: int = 8
    load_every: int = 10


@dataclass(frozen=True)
class HostSpec:
    """``tiers`` tiers, each bound on ``host`` (one address per tier when a list) and
    ``ports[i]`` (0: ephemeral); ``config`` is the tier config every tier starts from."""

    tiers: int
    config: Mapping[str, Any]
    num_blocks: int = 64
    block_len: int = 4096
    host: str | Sequence[str] = "127.0.0.1"
    ports: Sequence[int] = ()


class _Tier:
    """One tier of the host and what it has in flight."""

    def __init__(self, spec: HostSpec, i: int) -> None:
        host = spec.host if isinstance(spec.host, str) else spec.host[i]
        port = spec.ports[i] if spec.ports else 0
        self.base = {**spec.config, "host": host, "port": port}
        config = TierConfig.from_dict(self.base)
        self.region = ShmRegion(spec.num_blocks, spec.block_len)
        settings = DataSettings(memoryview(self.region.map), spec.block_len)
        self.data = ShmDataTransport(settings, self.region.name)
        self.control = (
            default_registry()
            .transport("control", "zmq")
            .create(
                ControlSettings(
                    host,
                    port,
                    max_frame_bytes=config.limits.max_frame_bytes,
                    options=config.control_options,
                    handshake_timeout=config.timeouts.handshake,
                )
            )
        )
        self.block_len = spec.block_len
        self.tier: P2PTier | None = None
        self.loads: dict[int, tuple[list[bytes], list[int]]] = {}
        self.flood: _Flooding | None = None

    def start(self, overrides: Mapping[str, Any]) -> None:
        config = TierConfig.from_dict({**self.base, **overrides})
        self.tier = P2PTier(
            config,
            memoryview(self.region.map),
            self.block_len,
            control=self.control,
            data=self.data,
        )

    def load(self, job: int, kv: str, peer: str, keys: list[bytes], slots: list[int]) -> None:
        assert self.tier is not None
        host, _, port = peer.rpartition(":")
        ctx = RequestContext(
            f"c-{kv}",
            {
                "remote_prefiller": {
                    "kv_request_id": kv,
                    "remote_host": host,
                    "remote_port": int(port),
                }
            },
        )
        self.loads[job] = (keys, slots)
        self.tier.on_new_request(ctx)
        self.tier.submit_load(Job(job, keys, slots, True, ctx))

    def store(self, job: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        assert self.tier is not None
        for key, slot in zip(keys, slots, strict=True):
            self.region.blocks[slot] = content(key, self.block_len)
        ctx = RequestContext(f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}})
        self.tier.on_new_request(ctx)
        self.tier.submit_store(Job(job, keys, slots, False, ctx))

    def finish(self, kv: str, peer: str | None) -> None:
        """End request ``kv``: its consumer half (``peer``: its producer), else its
        producer half."""
        assert self.tier is not None
        if peer is None:
            params: dict[str, Any] = {"remote_decoder": {"kv_request_id": kv}}
        else:
            host, _, port = peer.rpartition(":")
            params = {
                "remote_prefiller": {
                    "kv_request_id": kv,
                    "remote_host": host,
                    "remote_port": int(port),
                }
            }
        self.tier.on_request_finished(RequestContext(f"f-{kv}", params))

    def results(self) -> list[tuple[int, str, str, int]]:
        """The jobs that ended since the last call; loads done are checked block by block."""
        assert self.tier is not None
        out = []
        for r in self.tier.get_finished_jobs():
            bad = 0
            load = self.loads.pop(r.job_id, None)
            if load is not None and r.success:
                keys, slots = load
                blocks = self.region.blocks
                bad = sum(
                    1
                    for k, s in zip(keys, slots, strict=True)
                    if not np.array_equal(blocks[s], content(k, self.block_len))
                )
            out.append((r.job_id, r.outcome.value, r.detail, bad))
        return out

    def close(self) -> None:
        if self.tier is not None:
            self.tier.shutdown()
        else:
            self.control.close()
            self.data.close()
        self.region.close()


class _Flooding:
    """A :class:`Flood` under way on one tier."""

    def __init__(self, spec: Flood) -> None:
        self.spec = spec
        self.sent = 0
        self.loads: set[int] = set()
        self.outcomes: dict[str, int] = {}
        self.began = time.monotonic()

    def step(self, tier: P2PTier) -> None:
        """The next ``per_tick`` bogus requests."""
        spec = self.spec
        for _ in range(min(spec.per_tick, spec.count - self.sent)):
            i = self.sent
            self.sent += 1
            host = f"127.{1 + i // 62500}.{i // 250 % 250}.{2 + i % 250}"
            kv = f"bogus-{i}"
            ctx = RequestContext(
                kv,
                {
                    "remote_prefiller": {
                        "kv_request_id": kv,
                        "remote_host": host,
                        "remote_port": spec.port,
                    }
                },
            )
            tier.on_new_request(ctx)
            tier.lookup(b"k", ctx)
            if i % spec.load_every == 0:
                job = 10_000_000 + i
                self.loads.add(job)
                tier.submit_load(Job(job, [b"k"], [0], True, ctx))
            tier.on_request_finished(ctx)

    def record(self, results: list[tuple[int, str, str, int]]) -> list[tuple[int, str, str, int]]:
        """Count the flood's own results; hand back the others."""
        rest = []
        for result in results:
            if result[0] in self.loads:
                self.loads.discard(result[0])
                self.outcomes[result[1]] = self.outcomes.get(result[1], 0) + 1
            else:
                rest.append(result)
        return rest

    @property
    def done(self) -> bool:
        return self.sent >= self.spec.count and not self.loads


def host_main(conn: Connection, spec: HostSpec) -> None:
    """The host process: bind, report, then serve commands while ticking every tier."""
    tiers = [_Tier(spec, i) for i in range(spec.tiers)]
    try:
        conn.send(("bound", [t.control.local_address for t in tiers]))
        _serve(conn, tiers)
    finally:
        for t in tiers:
            t.close()
        with contextlib.suppress(OSError):
            conn.send(("stopped",))


def _serve(conn: Connection, tiers: list[_Tier]) -> None:
    deadline = time.monotonic() + _LIFETIME
    while time.monotonic() < deadline:
        busy = False
        while conn.poll(0):
            try:
                cmd = conn.recv()
            except EOFError:
                return
            if cmd[0] == "stop":
                return
            _command(conn, tiers, cmd)
            busy = True
        for i, t in enumerate(tiers):
            if t.tier is None:
                continue
            if t.flood is not None:
                t.flood.step(t.tier)
            results = t.results()
            if t.flood is not None:
                results = t.flood.record(results)
                if t.flood.done:
                    conn.send(("flood", time.monotonic(), i, dict(t.flood.outcomes)))
                    t.flood = None
            if results:
                conn.send(("results", i, results))
                busy = True
        if not busy:
            conn.poll(_IDLE_WAIT)


def _command(conn: Connection, tiers: list[_Tier], cmd: tuple[Any, ...]) -> None:
    kind = cmd[0]
    if kind == "start":
        for t in tiers:
            t.start(cmd[1])
    elif kind == "load":
        tiers[cmd[1]].load(*cmd[2:])
    elif kind == "store":
        tiers[cmd[1]].store(*cmd[2:])
    elif kind == "finish":
        tiers[cmd[1]].finish(*cmd[2:])
    elif kind == "flood":
        tiers[cmd[1]].flood = _Flooding(cmd[2])
    elif kind == "stats":
        conn.send(
            (
                "stats",
                time.monotonic(),
                [t.tier.stats() if t.tier is not None else {} for t in tiers],
            )
        )
    else:
        raise ValueError(f"unknown command {cmd!r}")
