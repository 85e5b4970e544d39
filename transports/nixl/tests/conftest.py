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
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from p2pkv.contracts import DataSettings
from p2pkv.testing.peers import PeerHost, pattern
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport

os.environ.setdefault("UCX_NET_DEVICES", "lo")

TIMEOUT = 15.0
"""Seconds any single expected event may take on a busy 2-core machine."""


class Recorder:
    """Wraps a transport's NIXL agent and records the calls that matter for ordering.

    ``calls`` holds ``(method, detail)``: the state for ``check_xfer_state``, ``id(handle)``
    for ``transfer``/``release_xfer_handle``/``initialize_xfer``, the result otherwise.
    ``state`` maps ``id(handle)`` to the last state NIXL reported. With ``refuse_release`` set,
    releasing a transfer handle raises (a backend refusing to free it); ``on_check`` runs after
    every state check.
    """

    RECORDED = (
        "make_prepped_xfer", "initialize_xfer", "transfer", "check_xfer_state",
        "release_xfer_handle", "release_dlist_handle", "remove_remote_agent",
        "deregister_memory", "add_remote_agent", "send_notif",
    )

    def __init__(self, agent: Any) -> None:
        self._agent = agent
        self.calls: list[tuple[str, Any]] = []
        self.state: dict[int, str] = {}
        self.refuse_release = False
        self.on_check: Callable[[], None] | None = None

    def __getattr__(self, name: str) -> Any:
        target = getattr(self._agent, name)
        if name not in self.RECORDED:
            return target

        def call(*args: Any, **kwargs: Any) -> Any:
            if name == "release_xfer_handle" and self.refuse_release:
                self.calls.append(("release_refused", id(args[0])))
                raise RuntimeError("NIXL_ERR_UNKNOWN (simulated refusal)")
            result = target(*args, **kwargs)
            if name in ("transfer", "check_xfer_state"):
                self.state[id(args[0])] = result
            if name == "check_xfer_state":
                detail: Any = result
            elif name in ("transfer", "release_xfer_handle"):
                detail = id(args[0])
            elif name == "initialize_xfer":
                detail = id(result)
            else:
                detail = result
            self.calls.append((name, detail))
            if name == "check_xfer_state" and self.on_check is not None:
                self.on_check()
            return result

        return call

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]


@pytest.fixture
def record() -> Iterator[Callable[[NixlDataTransport], Recorder]]:
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


class Local:
    """A transport in this process over a patterned region; closed by the fixture."""

    def __init__(self, num_blocks: int, block_len: int, options: dict[str, Any], seed: int):
        self.array = pattern(seed, num_blocks * block_len)
        self.blocks = self.array.reshape(num_blocks, block_len)
        self.transport = NixlDataTransport.create(
            DataSettings(memoryview(self.array), block_len, options)
        )


@pytest.fixture
def make_local() -> Iterator[Callable[..., Local]]:
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
def wait_for() -> Callable[..., tuple[set[int], set[int]]]:
    """``wait_for(transport, peer_id, ids)`` -> (done, failed) once every id ended."""
    return _wait_for


@pytest.fixture
def poll_log() -> Callable[[NixlDataTransport], PollLog]:
    """``poll_log(transport)``: a kit ``PollLog`` over its ``poll``/``cancel`` (it checks the
    reporting rules on every call)."""
    return lambda transport: PollLog(transport.poll, transport.cancel, "consumer")
