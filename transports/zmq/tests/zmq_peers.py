"""Programs the zmq tests run in spawned child processes (via ``p2pkv.testing.child.Child``).

Each takes the child's end of the harness pipe first, reports its transport's address as
``("address", addr)``, and runs until the pipe says ``"stop"`` or closes. Every loop is
bounded by a deadline, so a lost parent never leaves a child spinning.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.contracts import ControlSettings
from p2pkv.errors import SendQueueFull
from p2pkv_zmq import ZmqControlTransport

FAST = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "heartbeat_ttl": 1.0}
"""Short heartbeats so silence shows within about a second. Only for tests of liveness: a
process starved of CPU for longer than the timeout (a loaded CI box) looks dead too."""

_LIFETIME = 120.0  # seconds; a child never outlives this


def _told_to_stop(pipe: Connection) -> bool:
    try:
        return bool(pipe.poll(0)) and pipe.recv() == "stop"
    except (EOFError, OSError):
        return True


def _serve_requests(pipe: Connection, t: Any) -> bool:
    """Answer every pending ``"resources"`` request with ``("resources", open descriptors,
    resident bytes, t.stats())`` of this process; True once told to stop (or orphaned)."""
    while True:
        try:
            if not pipe.poll(0):
                return False
            command = pipe.recv()
        except (EOFError, OSError):
            return True
        if command != "resources":
            return bool(command == "stop")
        pipe.send(("resources", len(os.listdir("/proc/self/fd")), _resident_bytes(), t.stats()))


def _resident_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def streamer(
    pipe: Connection,
    target: str,
    count: int,
    tag: bytes,
    expect: int,
    options: Mapping[str, Any],
) -> None:
    """Dial ``target`` and send ``tag:0 .. tag:count-1`` while receiving ``expect`` frames on
    the same connection; report ``("done", sent, in_order, received)``, then keep serving."""
    t = ZmqControlTransport.create(ControlSettings("127.0.0.1", 0, options=options))
    pipe.send(("address", t.local_address))
    conn = t.connect(target)
    deadline = time.monotonic() + _LIFETIME
    sent = 0
    received: list[bytes] = []
    while (sent < count or len(received) < expect) and time.monotonic() < deadline:
        while sent < count:
            try:
                conn.send(b"%s:%d" % (tag, sent))
            except SendQueueFull:
                break
            sent += 1
        t.poll(0.001)
        received.extend(conn.recv())
    want = [b"P:%d" % i for i in range(expect)]
    pipe.send(("done", sent, received == want, len(received)))
    while not _told_to_stop(pipe) and time.monotonic() < deadline:
        t.poll(0.01)
    t.close()


def sitter(pipe: Connection, port: int, dial: str | None, options: Mapping[str, Any]) -> None:
    """Listen on ``port`` (0: ephemeral); if ``dial``, connect there and send ``hello``.
    Echo every frame received on any connection back on it; answer ``"resources"``."""
    t = ZmqControlTransport.create(ControlSettings("127.0.0.1", port, options=options))
    pipe.send(("address", t.local_address))
    conns: list[Any] = []
    if dial is not None:
        conns.append(t.connect(dial))
        conns[0].send(b"hello")
    deadline = time.monotonic() + _LIFETIME
    while not _serve_requests(pipe, t) and time.monotonic() < deadline:
        conns.extend(t.poll(0.01))
        for conn in conns:
            for frame in conn.recv():
                if conn.alive:
                    conn.send(b"echo:" + frame)
    t.close()


def producer_tier(
    pipe: Connection,
    data: str,
    num_blocks: int,
    block_len: int,
    seed: int,
    control_options: Mapping[str, Any] | None = None,
) -> None:
    """A producer ``P2PTier`` over ``zmq`` control (with ``control_options``) and ``data``:
    its region holds ``default_rng(seed)`` bytes; ``("store", job_id, kv, keys, slots)``
    offers blocks, ``("finish", kv)`` ends a request. Reports ``("result", job_id,
    outcome)``."""
    import numpy as np
    from p2pkv.config import TierConfig
    from p2pkv.tier import P2PTier
    from p2pkv.types import Job, RequestContext

    region = np.random.default_rng(seed).integers(0, 256, num_blocks * block_len, np.uint8)
    config = TierConfig.from_dict(
        {
            "control": "zmq",
            "data": data,
            "host": "127.0.0.1",
            "port": 0,
            "control_options": dict(control_options or {}),
        }
    )
    tier = P2PTier(config, region.data, block_len)
    pipe.send(("address", tier.local_address))
    contexts: dict[str, RequestContext] = {}
    deadline = time.monotonic() + _LIFETIME
    try:
        while time.monotonic() < deadline:
            tier.tick(0.001)
            for r in tier.get_finished_jobs():
                pipe.send(("result", r.job_id, r.outcome.value))
            if not pipe.poll(0):
                continue
            try:
                command = pipe.recv()
            except EOFError:
                return
            if command == "stop":
                return
            if command[0] == "store":
                _, job_id, kv, keys, slots = command
                ctx = contexts[kv] = RequestContext(kv, {"remote_decoder": {"kv_request_id": kv}})
                tier.on_new_request(ctx)
                tier.submit_store(Job(job_id, keys, slots, False, ctx))
            else:
                tier.on_request_finished(contexts.pop(command[1]))
    finally:
        tier.shutdown()


def busy_listener(pipe: Connection, options: Mapping[str, Any], busy: float) -> None:
    """Listen; on ``"busy"`` leave the transport unpolled for ``busy`` seconds (the application
    is busy elsewhere; libzmq's I/O thread and its timers run on), then poll until told to stop,
    reporting ``("served", dropped_messages)`` whenever that counter grows."""
    t = ZmqControlTransport.create(ControlSettings("127.0.0.1", 0, options=options))
    pipe.send(("address", t.local_address))
    deadline = time.monotonic() + _LIFETIME
    if not pipe.poll(_LIFETIME) or pipe.recv() != "busy":
        return
    pipe.poll(busy)  # nothing is sent meanwhile: a bounded stretch with the hub unpolled
    reported = 0
    while not _told_to_stop(pipe) and time.monotonic() < deadline:
        t.poll(0.01)
        dropped = t.stats()["dropped_messages"]
        if dropped > reported:
            reported = dropped
            pipe.send(("served", dropped))
    t.close()
