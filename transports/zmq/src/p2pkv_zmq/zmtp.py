"""What answers at a TCP address, told from its first bytes: ZMTP's greeting, read by hand.

``p2pkv probe`` uses this to name what it found when a zmq dial did not reach a p2pkv tier.
A ZMTP 3 peer sends a 64-byte greeting whose *mechanism* field says its security mode
(``NULL``: none, ``CURVE``) before any handshake; with ``NULL`` the handshake that follows is
plain text, and the peer's ``READY`` command names its socket type (vLLM's built-in P2P tier
listens with a ``ROUTER``, p2pkv's with a ``PULL``). :func:`greet` reads that much as a
``PUSH`` would and hangs up; it never sends a message. Against a ``NULL`` listener it
completes the handshake, so the listener sees a client that came and left, not a failure.

Threading: any thread; every call is bounded by its ``timeout``. Importing this module never
imports zmq.
"""

from __future__ import annotations

import socket
import struct
import time
from dataclasses import dataclass

__all__ = ["Greeting", "greet"]

_SIGNATURE = b"\xff\x00\x00\x00\x00\x00\x00\x00\x01\x7f"
"""A ZMTP 3 signature (the padding's last byte is not checked by peers)."""
_GREETING_BYTES = 64
_COMMAND = 0x04
_LONG = 0x02
_MAX_COMMAND = 4096


@dataclass(frozen=True)
class Greeting:
    """What :func:`greet` found at an address: exactly one of the cases below is set."""

    refused: bool = False
    """Nothing accepts TCP connections there (connection refused)."""
    unreachable: str = ""
    """The TCP connection could not be made for another reason (timeout, no route)."""
    silent: bool = False
    """It accepted TCP but sent no greeting within the timeout."""
    not_zmq: bytes | None = None
    """It sent bytes that are not a ZMTP 3 greeting (the first of them), or hung up."""
    mechanism: str = ""
    """The ZMTP security mechanism it offers (``NULL``, ``CURVE``, ``PLAIN``)."""
    socket_type: str = ""
    """With ``NULL``: the socket type its ``READY`` names (``PULL``, ``ROUTER``...)."""


def greet(host: str, port: int, timeout: float) -> Greeting:
    """Connect to ``host:port``, read its greeting (and with ``NULL`` its socket type), hang
    up. Never raises for what the peer does; ``timeout`` bounds the whole call."""
    deadline = time.monotonic() + timeout
    try:
        sock = socket.create_connection((host, port), timeout=timeout)
    except ConnectionRefusedError:
        return Greeting(refused=True)
    except OSError as exc:  # TimeoutError included
        why = exc.strerror or f"TCP connect timed out after {timeout:g} s"
        return Greeting(unreachable=why)
    with sock:
        try:
            return _converse(sock, deadline)
        except TimeoutError:
            return Greeting(silent=True)
        except _HungUp as exc:
            return Greeting(not_zmq=exc.seen)
        except OSError:
            return Greeting(not_zmq=b"")


class _HungUp(Exception):
    def __init__(self, seen: bytes) -> None:
        super().__init__("hung up")
        self.seen = seen


def _converse(sock: socket.socket, deadline: float) -> Greeting:
    sock.sendall(_SIGNATURE + b"\x03")  # signature and major version: the peer answers
    first = _read(sock, 10, deadline)
    if first[0] != 0xFF or first[9] & 1 != 1:
        return Greeting(not_zmq=first)
    rest = _read(sock, _GREETING_BYTES - 10, deadline)
    if rest[0] < 3:
        return Greeting(not_zmq=first + rest[:2])
    mechanism = rest[2:22].rstrip(b"\0").decode("ascii", "replace")
    if mechanism != "NULL":
        return Greeting(mechanism=mechanism)
    sock.sendall(b"\x00" + b"NULL".ljust(20, b"\0") + b"\0" * 32)  # minor, mechanism, filler
    sock.sendall(_command(b"READY", {b"Socket-Type": b"PUSH"}))
    ready = _read_command(sock, deadline)
    return Greeting(mechanism="NULL", socket_type=_socket_type(ready))


def _command(name: bytes, properties: dict[bytes, bytes]) -> bytes:
    body = (
        bytes([len(name)])
        + name
        + b"".join(
            bytes([len(k)]) + k + struct.pack(">I", len(v)) + v for k, v in properties.items()
        )
    )
    return bytes([_COMMAND, len(body)]) + body


def _read_command(sock: socket.socket, deadline: float) -> bytes:
    flags = _read(sock, 1, deadline)[0]
    if flags & _LONG:
        size = struct.unpack(">Q", _read(sock, 8, deadline))[0]
    else:
        size = _read(sock, 1, deadline)[0]
    if not flags & _COMMAND or size > _MAX_COMMAND:
        return b""
    return _read(sock, size, deadline)


def _socket_type(command: bytes) -> str:
    """The ``Socket-Type`` property of a ``READY`` command body ("" if it has none)."""
    if not command or command[1 : 1 + command[0]] != b"READY":
        return ""
    at = 1 + command[0]
    while at < len(command):
        name_len = command[at]
        name = command[at + 1 : at + 1 + name_len]
        at += 1 + name_len
        (value_len,) = struct.unpack(">I", command[at : at + 4].rjust(4, b"\0"))
        value = command[at + 4 : at + 4 + value_len]
        at += 4 + value_len
        if name.lower() == b"socket-type":
            return value.decode("ascii", "replace")
    return ""


def _read(sock: socket.socket, n: int, deadline: float) -> bytes:
    data = b""
    while len(data) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise _HungUp(data)
        data += chunk
    return data
