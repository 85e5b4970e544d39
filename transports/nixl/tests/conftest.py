"""Fixtures for the nixl transport tests: real NIXL on CPU, peers in spawned children.

``UCX_NET_DEVICES=lo`` is set here (children inherit it) so UCX never stripes over external
interfaces. Children are ``p2pkv.testing.peers.PeerHost`` processes: they call ``progress()``
on their transports continuously between harness requests, like a live serving process.
The tests' own transport (``make_local``) is the consumer: it reads from the children's
regions (wire 2.0: the consumer posts every transfer into its region).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import pytest
from nixl_fixtures import Local, MakeLocal, MakePollLog, MakeRecorder, Recorder, WaitFor
from p2pkv.testing.peers import PeerHost
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport

os.environ.setdefault("UCX_NET_DEVICES", "lo")

TIMEOUT = 15.0
"""Seconds any single expected event may take on a busy 2-core machine."""


@pytest.fixture
def record() -> Iterator[MakeRecorder]:
    """``record(transport)`` wraps its agent in a :class:`Recorder` (unwrapped afterwards)."""
    wrapped: list[tuple[NixlDataTransport, Recorder]] = []

    def wrap(transport: NixlDataTransport) -> Recorder:
        recorder = Recorder(transport.state.agent)
        transport.state.agent = recorder
        wrapped.append((transport, recorder))
        return recorder

    yield wrap
    for transport, recorder in reversed(wrapped):
        if getattr(transport.state, "agent", None) is recorder:
            transport.state.agent = recorder._agent


@pytest.fixture
def make_local() -> Iterator[MakeLocal]:
    made: list[Local] = []

    def make(num_blocks: int = 64, block_len: int = 4096, seed: int = 1, **options: Any) -> Local:
        local = Local(num_blocks, block_len, options, seed)
        made.append(local)
        return local

    yield make
    for local in made:
        try:
            local.transport.close()
        except Exception:
            pass


@pytest.fixture(scope="module")
def host() -> Iterator[PeerHost]:
    """A child process hosting healthy producers for the whole module (default UCX)."""
    with PeerHost(timeout=60.0, name="p2pkv-nixl-producers") as peer_host:
        yield peer_host


@contextlib.contextmanager
def _tcp_child(name: str) -> Iterator[PeerHost]:
    """A child whose UCX runs with ``UCX_TLS=tcp`` (no ``cma``: what a peer on another host
    without RDMA looks like); started at once, so only it sees the variable."""
    with pytest.MonkeyPatch.context() as env, PeerHost(timeout=60.0, name=name) as peer_host:
        env.setenv("UCX_TLS", "tcp")
        assert peer_host.child.process.is_alive()
        env.undo()
        yield peer_host


@pytest.fixture(scope="module")
def tcp_host() -> Iterator[PeerHost]:
    """Healthy tcp-only producers for the whole module (see ``_tcp_child``)."""
    with _tcp_child("p2pkv-nixl-tcp-producers") as peer_host:
        yield peer_host


@pytest.fixture
def doomed_tcp() -> Iterator[PeerHost]:
    """A tcp-only child of its own (see ``_tcp_child``), for a test that pauses it: reads
    from it are executed by its worker, so they stay in flight while it is stopped."""
    with _tcp_child("p2pkv-nixl-doomed-tcp") as peer_host:
        yield peer_host


@pytest.fixture
def doomed() -> Iterator[PeerHost]:
    """A child of its own, for a test that pauses or kills it."""
    with PeerHost(timeout=60.0, name="p2pkv-nixl-doomed") as peer_host:
        yield peer_host


def _wait_for(
    transport: NixlDataTransport, peer_id: str | None, ids: set[int]
) -> tuple[set[int], set[int]]:
    """Poll ``peer_id`` until every id in ``ids`` is terminal; returns (done, failed)."""
    done: set[int] = set()
    failed: set[int] = set()

    def finished() -> bool:
        result = transport.poll(peer_id)
        done.update(result.done)
        failed.update(result.failed)
        return ids <= done | failed

    wait_until(finished, timeout=TIMEOUT, what=f"transfers {sorted(ids)} to end")
    return done, failed


@pytest.fixture
def wait_for() -> WaitFor:
    """``wait_for(transport, peer_id, ids)`` -> (done, failed) once every id ended."""
    return _wait_for


@pytest.fixture
def poll_log() -> MakePollLog:
    """``poll_log(transport)``: a kit ``PollLog`` over its ``poll``/``cancel`` (it checks the
    reporting rules on every call)."""
    return lambda transport: PollLog(transport.poll, transport.cancel, "consumer")
