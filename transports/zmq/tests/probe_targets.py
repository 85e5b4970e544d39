"""What ``p2pkv probe`` is pointed at in the tests, each in a spawned child process.

Each program takes the child's end of the harness pipe first, reports ``("address", addr)``
and serves until the pipe says ``"stop"`` or closes (bounded by ``_LIFETIME``).
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Mapping
from multiprocessing.connection import Connection
from typing import Any

_LIFETIME = 120.0


class _Lines(logging.Handler):
    """Every record above DEBUG, as text."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def _command(pipe: Connection) -> Any:
    """The next harness command if one is waiting (``"stop"`` when the pipe closed)."""
    try:
        return pipe.recv() if pipe.poll(0) else None
    except (EOFError, OSError):
        return "stop"


def tier(pipe: Connection, environ: Mapping[str, str], keys: Mapping[str, Any]) -> None:
    """A ``P2PTier`` (zmq control, memory data) on 127.0.0.1 with ``environ`` set and the
    tier config ``keys``. Answers ``"log"`` with the lines logged above DEBUG since start
    and ``"sessions"`` with its open sessions. ``"stall"`` stops its ticks (libzmq's own
    thread runs on, as in a tier whose driver is still starting or stuck) until the next
    command; both are answered ``("ok",)``."""
    os.environ.update(environ)
    from p2pkv.config import TierConfig
    from p2pkv.tier import P2PTier

    lines = _Lines()
    logging.getLogger().addHandler(lines)
    logging.getLogger().setLevel(logging.DEBUG)
    config = TierConfig.from_dict(
        {"control": "zmq", "data": "memory", "host": "127.0.0.1", "port": 0, **keys}
    )
    tier = P2PTier(config, memoryview(bytearray(4096 * 4)), 4096)
    pipe.send(("address", tier.local_address))
    deadline = time.monotonic() + _LIFETIME
    try:
        while time.monotonic() < deadline:
            tier.tick(0.005)
            command = _command(pipe)
            if command == "stop":
                return
            if command == "log":
                pipe.send(("log", list(lines.lines)))
            elif command == "sessions":
                pipe.send(("sessions", int(tier.stats()["sessions"])))
            elif command == "stall":
                pipe.send(("ok",))
                pipe.poll(_LIFETIME)
                pipe.send(("ok",))
                pipe.recv()
    finally:
        tier.shutdown()


def zmq_socket(pipe: Connection, kind: str) -> None:
    """A bare zmq socket of type ``kind`` (``PULL``, ``ROUTER``...) without security, bound
    on 127.0.0.1, never read: a zmq program that is not a tier."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(getattr(zmq, kind))
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    pipe.send(("address", f"127.0.0.1:{port}"))
    pipe.poll(_LIFETIME)
    ctx.destroy(linger=0)


def silent_server(pipe: Connection) -> None:
    """A TCP server that accepts connections and never sends a byte."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    pipe.send(("address", f"127.0.0.1:{server.getsockname()[1]}"))
    held = []
    deadline = time.monotonic() + _LIFETIME
    while time.monotonic() < deadline and _command(pipe) != "stop":
        try:
            held.append(server.accept()[0])
        except TimeoutError:
            continue
    for conn in held:
        conn.close()
    server.close()


def talking_server(pipe: Connection, banner: bytes) -> None:
    """A TCP server that greets every connection with ``banner`` (an SSH- or HTTP-like
    server: something that is not zmq)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.05)
    pipe.send(("address", f"127.0.0.1:{server.getsockname()[1]}"))
    deadline = time.monotonic() + _LIFETIME
    while time.monotonic() < deadline and _command(pipe) != "stop":
        try:
            conn = server.accept()[0]
        except TimeoutError:
            continue
        with conn:
            conn.sendall(banner)
    server.close()
