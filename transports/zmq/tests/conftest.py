"""Fixtures of the zmq transport tests: transports on loopback that are always closed.

``zmq_peers`` (the programs child processes run) is importable by name in spawned children:
this directory is on ``sys.path`` (pytest's ``pythonpath``, root pyproject.toml), which
``multiprocessing`` hands to its children.
"""

from __future__ import annotations

import socket
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from p2pkv.cli import main as p2pkv_main
from p2pkv.contracts import ControlSettings
from p2pkv_zmq import ZmqControlTransport
from zmq_fixtures import MakeTransport, refusing_port
from zmq_tiers import Peer


@pytest.fixture
def make_transport() -> Iterator[MakeTransport]:
    """``make_transport(host="127.0.0.1", port=0, max_frame_bytes=..., **options)``; the
    transport's default options unless given (``options=zmq_peers.FAST`` for quick liveness)."""
    made: list[ZmqControlTransport] = []

    def make(
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = 1 << 20,
        dp_rank: int = 0,
        options: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> ZmqControlTransport:
        opts = {**(options or {}), **kw}
        t = ZmqControlTransport.create(
            ControlSettings(
                host, port, max_frame_bytes=max_frame_bytes, options=opts, dp_rank=dp_rank
            )
        )
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.fixture
def refused_address() -> Iterator[str]:
    """A loopback port that refuses connections: bound (so nobody else takes it during the
    test), never listening."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
def pair() -> Iterator[tuple[Peer, Peer]]:
    """A producer and a consumer tier (:class:`zmq_tiers.Peer`), shut down afterwards."""
    producer, consumer = Peer(1), Peer(2)
    yield producer, consumer
    consumer.tier.shutdown()
    producer.tier.shutdown()


@pytest.fixture
def refusing() -> Iterator[int]:
    """A port that refuses on every loopback address (bound, not listening)."""
    with refusing_port() as port:
        yield port


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    """Key pairs written by ``p2pkv keys``: server, alice (allowed), mallory (not allowed)."""
    for name in ("server", "alice", "mallory"):
        assert p2pkv_main(["keys", "--dir", str(tmp_path), "--name", name]) == 0
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    (allowed / "alice.key").write_bytes((tmp_path / "alice.key").read_bytes())
    return tmp_path
