"""Programs run in spawned children by the ucx transport tests (importable by name there)."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import numpy as np

ZMQ_CONTROL = {"heartbeat_interval": 0.5, "heartbeat_timeout": 10.0, "heartbeat_ttl": 10.0}
"""Heartbeats no loaded machine misses: a tier takes a gap between its ticks longer than the
heartbeat timeout for a pause of its own and drops its sessions (a test ticking on two busy
cores has gaps over a second)."""


def data_node(
    conn: Connection, num_blocks: int, block_len: int, seed: int, options: dict[str, Any]
) -> None:
    """A child hosting one ``ucx`` transport over a region filled from ``seed``, like a
    serving process: it answers the parent's commands and calls ``progress()`` between them.

    Sends its descriptor first. Commands ``(name, *args)``: ``add_peer``, ``remove_peer``,
    ``read`` (``read_blocks``), ``poll`` (-> ``[done, failed]``), ``cancel``, ``region`` (a copy
    of the region's bytes), ``close``; each answers ``("ok", value)`` or ``("err", text)``.
    Exits when the pipe closes; closes the transport on the way out.
    """
    from p2pkv.contracts import DataSettings
    from p2pkv_ucx import UcxDataTransport

    region = np.random.default_rng(seed).integers(0, 256, num_blocks * block_len, dtype=np.uint8)
    t = UcxDataTransport.create(DataSettings(region.data, block_len, options))

    ops: dict[str, Any] = {
        "add_peer": t.add_peer,
        "remove_peer": t.remove_peer,
        "read": t.read_blocks,
        "poll": lambda peer: [list(ids) for ids in t.poll(peer)],
        "cancel": t.cancel,
        "region": region.tobytes,
        "close": t.close,
    }
    conn.send(t.descriptor())
    try:
        while True:
            if conn.poll(0.0005):
                try:
                    name, *args = conn.recv()
                except EOFError:
                    break
                try:
                    conn.send(("ok", ops[name](*args)))
                except Exception as exc:
                    conn.send(("err", f"{type(exc).__name__}: {exc}"))
            t.progress()
    finally:
        t.close()


def tier_region(num_blocks: int, block_len: int, seed: int) -> tuple[bytearray, np.ndarray]:
    """A region whose content both processes can recompute from ``seed``."""
    region = bytearray(num_blocks * block_len)
    blocks = np.frombuffer(region, np.uint8).reshape(num_blocks, block_len)
    blocks[:] = np.random.default_rng(seed).integers(0, 256, blocks.shape, dtype=np.uint8)
    return region, blocks


def make_tier(region: bytearray, block_len: int, data_options: dict[str, Any]) -> Any:
    """A P2PTier over ``zmq`` control and ``ucx`` data, built from a tier config."""
    import p2pkv_ucx.plugin as ucx_plugin
    import p2pkv_zmq.plugin as zmq_plugin
    from p2pkv.config import TierConfig
    from p2pkv.registry import Registry
    from p2pkv.tier import P2PTier

    registry = Registry.from_plugins([("zmq", zmq_plugin), ("ucx", ucx_plugin)])
    config = TierConfig.from_dict(
        {
            "control": "zmq",
            "data": "ucx",
            "host": "127.0.0.1",
            "port": 0,
            "control_options": ZMQ_CONTROL,
            "data_options": data_options,
        }
    )
    return P2PTier(config, memoryview(region), block_len, registry=registry)


def producer_tier(
    conn: Connection, num_blocks: int, block_len: int, seed: int, data_options: dict[str, Any]
) -> None:
    """A producer tier: stores blocks for the requests the parent names, reports results.

    Commands: ``("store", job_id, kv, keys, slots)``, ``("results",)`` -> {job_id: outcome},
    ``("exit",)``. Ticks the tier between commands.
    """
    from p2pkv.types import Job, RequestContext

    region, _ = tier_region(num_blocks, block_len, seed)
    tier = make_tier(region, block_len, data_options)
    conn.send(tier.local_address)
    results: dict[int, str] = {}
    try:
        while True:
            if conn.poll(0):
                cmd = conn.recv()
                if cmd[0] == "exit":
                    break
                if cmd[0] == "store":
                    _, job_id, kv, keys, slots = cmd
                    ctx = RequestContext(f"p-{kv}", {"remote_decoder": {"kv_request_id": kv}})
                    tier.on_new_request(ctx)
                    tier.submit_store(Job(job_id, keys, slots, False, ctx))
                    conn.send(None)
                elif cmd[0] == "results":
                    conn.send(dict(results))
            for r in tier.get_finished_jobs():
                results[r.job_id] = r.outcome.value
    finally:
        tier.shutdown()
