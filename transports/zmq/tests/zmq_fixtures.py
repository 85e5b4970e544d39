"""Types of the zmq tests' fixtures, and helpers for them, importable by name (a conftest
is not).

``conftest.py`` builds the fixtures; test functions annotate their parameters with these.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Protocol

from p2pkv_zmq import ZmqControlTransport


class MakeTransport(Protocol):
    """The ``make_transport`` fixture: a transport on loopback, closed after the test."""

    def __call__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = 1 << 20,
        dp_rank: int = 0,
        options: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> ZmqControlTransport: ...


def curve(keydir: Path, client: str) -> dict[str, Any]:
    """zmq options with CURVE keys from the ``keydir`` fixture, as ``client`` (alice is
    allowed, mallory is not)."""
    return {
        "server_secret_key": str(keydir / "server.key_secret"),
        "client_secret_key": str(keydir / f"{client}.key_secret"),
        "allowed_client_keys": [str(keydir / "allowed")],
    }


@contextmanager
def refusing_port() -> Iterator[int]:
    """A port that refuses on every loopback address (bound, not listening) while open."""
    with socket.socket() as sock:
        sock.bind(("0.0.0.0", 0))
        yield sock.getsockname()[1]
