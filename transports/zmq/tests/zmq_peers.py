"""Programs the zmq tests run in spawned child processes (via ``p2pkv.testing.child.Child``).

Each takes the child's end of the harness pipe first, reports its transport's address as
``("address", addr)``, and runs until the pipe says ``"stop"`` or closes. Every loop is
bounded by a deadline, so a lost parent never leaves a child spinning.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.contracts import ControlSettings
from p2pkv.errors import SendQueueFull
from p2pkv_zmq import ZmqControlTransport

_LIFETIME = 120.0  # seconds; a child never outlives this


def _told_to_stop(pipe: Connection) -> bool:
    try:
        return bool(pipe.poll(0)) and pipe.recv() == "stop"
    except (EOFError, OSError):
        return True


def streamer(
    pipe: Connection, target: str, count: int, tag: bytes, expect: int,
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
    Echo every frame received on any connection back on it."""
    t = ZmqControlTransport.create(ControlSettings("127.0.0.1", port, options=options))
    pipe.send(("address", t.local_address))
    conns: list[Any] = []
    if dial is not None:
        conns.append(t.connect(dial))
        conns[0].send(b"hello")
    deadline = time.monotonic() + _LIFETIME
    while not _told_to_stop(pipe) and time.monotonic() < deadline:
        conns.extend(t.poll(0.01))
        for conn in conns:
            for frame in conn.recv():
                if conn.alive:
                    conn.send(b"echo:" + frame)
    t.close()
