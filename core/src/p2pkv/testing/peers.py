"""The other side of a conformance test: a peer transport in this process or in a child.

A *peer* wraps one transport instance built from the class under test, behind one small
interface whether it lives here (:class:`LocalDataPeer`, :class:`LocalControlPeer`) or in a
spawned child process (:class:`PeerHost` hosts any number of them; the proxies
:class:`ChildDataPeer`, :class:`ChildControlPeer` forward each call over the harness pipe).
The test drives its own transport directly and the peer through this interface, so every
suite test runs unchanged in either mode.

In-process peers do I/O only when pumped (``pump()``: ``progress()`` for data, ``poll(0)`` for
control); a host pumps its peers continuously between harness calls, so a child peer behaves
like a live serving process. ``pause()`` makes a data peer stop serving (a same-process peer is
no longer pumped; a child peer's whole host is SIGSTOPped, so no harness call may go to it
until ``resume()``): that is how the kit posts a read that cannot complete yet.

Errors raised by a child peer's transport are re-raised here with the same class when it is a
p2pkv error or a builtin exception (otherwise :class:`RemotePeerError`), so suites can assert
error types across processes.

Threading: a peer is driven by one thread, like the transport it wraps.
"""

from __future__ import annotations

import builtins
import itertools
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import numpy.typing as npt

from p2pkv import errors
from p2pkv.child import Child
from p2pkv.contracts import (
    ControlConnection,
    ControlSettings,
    ControlTransport,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.data_base import allocated_region

__all__ = [
    "ChildControlPeer",
    "ChildDataPeer",
    "ControlPeer",
    "DataPeer",
    "LocalControlPeer",
    "LocalDataPeer",
    "PeerHost",
    "RemotePeerError",
    "make_region",
]


class RemotePeerError(Exception):
    """A child peer raised an exception that is neither a p2pkv error nor a builtin one."""


def make_region(num_blocks: int, block_len: int) -> npt.NDArray[np.uint8]:
    """A zeroed, C-contiguous, writable ``num_blocks * block_len`` byte region of process
    memory (for tests that need a region with no transport class; the kit's peers get theirs
    from ``allocate_region``)."""
    return np.zeros(num_blocks * block_len, dtype=np.uint8)


def pattern(seed: int, nbytes: int) -> npt.NDArray[np.uint8]:
    """Deterministic pseudo-random bytes (different seeds give different blocks)."""
    return np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)


# -- data peers ------------------------------------------------------------------------------


class DataPeer(ABC):
    """A data transport on the other side of a test. ``mode``: ``same-process`` or
    ``child-process``."""

    mode: str

    @property
    @abstractmethod
    def descriptor(self) -> bytes: ...

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def block_len(self) -> int: ...

    @abstractmethod
    def pump(self) -> None:
        """Progress the peer's I/O (no-op for a child peer: its host pumps continuously)."""

    @abstractmethod
    def add_peer(self, peer_id: str, descriptor: bytes) -> None: ...

    @abstractmethod
    def remove_peer(self, peer_id: str) -> list[int]: ...

    @abstractmethod
    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """The transport's ``read_blocks``: the peer's blocks into ours."""

    @abstractmethod
    def poll(self, peer_id: str | None = None) -> PollResult: ...

    @abstractmethod
    def cancel(self, transfer_ids: Sequence[int]) -> object:
        """The transport's ``cancel``; returns what it returned (None by the contract: the
        kit's ``PollLog`` checks)."""

    @abstractmethod
    def region_bytes(self) -> bytes:
        """A copy of the peer's whole region."""

    @abstractmethod
    def fill(self, seed: int) -> None:
        """Overwrite the peer's region with ``pattern(seed, ...)``."""

    @abstractmethod
    def set_blocks(self, idxs: Sequence[int], data: bytes) -> None:
        """Overwrite blocks ``idxs`` of the region with ``data`` (``len(idxs)`` blocks), as an
        engine reusing slots does: a canary that no late byte may change. Works after
        ``close`` too (the region is then its caller's again)."""

    @abstractmethod
    def pause(self) -> None:
        """Stop serving until ``resume`` (see the module docstring)."""

    @abstractmethod
    def resume(self) -> None: ...

    @abstractmethod
    def close(self) -> list[int]: ...


class LocalDataPeer(DataPeer):
    """A data transport of class ``cls`` over a fresh region from ``cls.allocate_region``, in
    this process."""

    mode = "same-process"

    def __init__(
        self,
        cls: type[DataTransport],
        num_blocks: int,
        block_len: int,
        options: Mapping[str, Any],
    ) -> None:
        self.region = allocated_region(cls, num_blocks, block_len, options)
        """The region, as the transport class allocated it (``allocate_region``)."""
        self.array: npt.NDArray[np.uint8] = np.frombuffer(self.region, dtype=np.uint8)
        assert not self.array.any(), f"{cls.__name__}.allocate_region must return zeroed memory"
        self.transport = cls.create(
            DataSettings(region=self.region, block_len=block_len, options=options)
        )
        self._descriptor = self.transport.descriptor()
        self._block_len = block_len
        self.paused = False

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    @property
    def num_blocks(self) -> int:
        return self.transport.num_blocks

    @property
    def block_len(self) -> int:
        return self.transport.block_len

    def pump(self) -> None:
        if not self.paused:
            self.transport.progress()

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> None:
        self.paused = False

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self.transport.add_peer(peer_id, descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        return list(self.transport.remove_peer(peer_id))

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        return self.transport.read_blocks(peer_id, local_idxs, remote_idxs)

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = self.transport.poll(peer_id)
        return PollResult(list(result.done), list(result.failed))

    def cancel(self, transfer_ids: Sequence[int]) -> object:
        cancel: Callable[[Sequence[int]], object] = self.transport.cancel
        return cancel(transfer_ids)

    def region_bytes(self) -> bytes:
        return self.array.tobytes()

    def fill(self, seed: int) -> None:
        self.array[:] = pattern(seed, self.array.size)

    def set_blocks(self, idxs: Sequence[int], data: bytes) -> None:
        b = self._block_len  # not the transport's: it may be closed by now
        blocks = self.array.reshape(-1, b)
        blocks[list(idxs)] = np.frombuffer(data, dtype=np.uint8).reshape(-1, b)

    def close(self) -> list[int]:
        return list(self.transport.close())


# -- control peers ---------------------------------------------------------------------------


class ControlPeer(ABC):
    """A control transport on the other side of a test; connections are named by handles."""

    mode: str

    @property
    @abstractmethod
    def address(self) -> str: ...

    @abstractmethod
    def pump(self) -> None:
        """Do the peer's I/O (no-op for a child peer: its host pumps continuously)."""

    @abstractmethod
    def connect(self, address: str) -> int: ...

    @abstractmethod
    def accepted(self) -> list[int]:
        """Handles of inbound connections accepted since the last call."""

    @abstractmethod
    def send(self, handle: int, frame: bytes) -> None: ...

    @abstractmethod
    def frames(self, handle: int) -> list[bytes]:
        """Frames received on ``handle`` since the last call, in order."""

    @abstractmethod
    def alive(self, handle: int) -> bool: ...

    @abstractmethod
    def peer_address(self, handle: int) -> str: ...

    @abstractmethod
    def close_conn(self, handle: int) -> None: ...

    @abstractmethod
    def close(self) -> None: ...


class LocalControlPeer(ControlPeer):
    """A control transport of class ``cls`` listening on an ephemeral port, in this process."""

    mode = "same-process"

    def __init__(
        self,
        cls: type[ControlTransport],
        options: Mapping[str, Any],
        max_frame_bytes: int,
        host: str = "127.0.0.1",
    ) -> None:
        self.transport = cls.create(
            ControlSettings(host=host, port=0, max_frame_bytes=max_frame_bytes, options=options)
        )
        self._conns: dict[int, ControlConnection] = {}
        self._inbox: dict[int, list[bytes]] = {}
        self._new: list[int] = []
        self._ids = itertools.count(1)

    @property
    def address(self) -> str:
        return self.transport.local_address

    def _handle(self, conn: ControlConnection) -> int:
        for handle, known in self._conns.items():
            if known is conn:
                return handle
        handle = next(self._ids)
        self._conns[handle] = conn
        self._inbox[handle] = []
        return handle

    def pump(self) -> None:
        for conn in self.transport.poll(0.0):
            self._new.append(self._handle(conn))
        for handle, conn in self._conns.items():
            self._inbox[handle].extend(conn.recv())

    def connect(self, address: str) -> int:
        return self._handle(self.transport.connect(address))

    def accepted(self) -> list[int]:
        new, self._new = self._new, []
        return new

    def send(self, handle: int, frame: bytes) -> None:
        self._conns[handle].send(frame)

    def frames(self, handle: int) -> list[bytes]:
        self._inbox[handle].extend(self._conns[handle].recv())
        frames, self._inbox[handle] = self._inbox[handle], []
        return frames

    def alive(self, handle: int) -> bool:
        return self._conns[handle].alive

    def peer_address(self, handle: int) -> str:
        return self._conns[handle].peer_address

    def close_conn(self, handle: int) -> None:
        self._conns[handle].close()

    def close(self) -> None:
        self.transport.close()


# -- peers in a child process ----------------------------------------------------------------

_PEER_METHODS = frozenset(
    {
        "add_peer",
        "remove_peer",
        "read_blocks",
        "poll",
        "cancel",
        "region_bytes",
        "fill",
        "set_blocks",
        "close",
        "connect",
        "accepted",
        "send",
        "frames",
        "alive",
        "peer_address",
        "close_conn",
    }
)


def _encode_error(exc: BaseException) -> tuple[str, str, str, str]:
    return ("err", type(exc).__module__, type(exc).__qualname__, str(exc))


def _decode_error(module: str, qualname: str, message: str) -> BaseException:
    cls: Any = None
    if module == errors.__name__:
        cls = getattr(errors, qualname, None)
    elif module == "builtins":
        cls = getattr(builtins, qualname, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        exc = cls.__new__(cls)
        Exception.__init__(exc, message)
        return exc
    return RemotePeerError(f"{module}.{qualname}: {message}")


def _host_main(conn: Connection) -> None:
    """Child side: build peers on request, pump them between requests. A closed peer is no
    longer pumped but still answers calls (a test overwrites a closed data peer's region, as
    its caller would reuse it)."""
    peers: dict[int, DataPeer | ControlPeer] = {}
    closed: dict[int, DataPeer | ControlPeer] = {}
    ids = itertools.count(1)
    while True:
        if conn.poll(0.001 if peers else None):
            try:
                request = conn.recv()
            except EOFError:
                break
            try:
                reply: Any = ("ok", _serve(request, peers, closed, ids))
            except Exception as exc:
                reply = _encode_error(exc)
            conn.send(reply)
        for peer in list(peers.values()):
            peer.pump()
    for peer in peers.values():
        try:
            peer.close()
        except Exception:
            pass


def _serve(
    request: tuple[Any, ...],
    peers: dict[int, DataPeer | ControlPeer],
    closed: dict[int, DataPeer | ControlPeer],
    ids: Any,
) -> Any:
    op = request[0]
    if op == "new_data":
        _, cls, num_blocks, block_len, options = request
        data = LocalDataPeer(cls, num_blocks, block_len, options)
        handle = next(ids)
        peers[handle] = data
        return handle, data.descriptor, data.num_blocks, data.block_len
    if op == "new_control":
        _, cls, options, max_frame_bytes, host = request
        control = LocalControlPeer(cls, options, max_frame_bytes, host)
        handle = next(ids)
        peers[handle] = control
        return handle, control.address
    if op == "call":
        _, handle, method, args = request
        if method not in _PEER_METHODS:
            raise ValueError(f"peer host: no method {method!r}")
        peer = peers[handle] if handle in peers else closed[handle]
        result = getattr(peer, method)(*args)
        if method == "close" and handle in peers:
            closed[handle] = peers.pop(handle)
        return result
    raise ValueError(f"peer host: unknown request {op!r}")


class PeerHost:
    """A spawned process hosting peers; starts on first use. Use as a context manager.

    ``timeout`` bounds every harness call (the first one includes importing the transport in
    the child). ``kill`` (SIGKILL) and ``pause``/``resume`` (SIGSTOP/SIGCONT) act on every peer
    the host holds: that is how suites make a peer die or fall silent.
    """

    def __init__(self, timeout: float = 60.0, name: str = "p2pkv-peer-host") -> None:
        self.timeout = timeout
        self._name = name
        self._child: Child | None = None

    @property
    def child(self) -> Child:
        if self._child is None or not self._child.process.is_alive():
            if self._child is not None:
                self._child.stop()
            self._child = Child(_host_main, name=self._name).start()
        return self._child

    def call(self, *request: Any) -> Any:
        reply = self.child.request(request, self.timeout, f"a reply to {request[0]}")
        if reply[0] == "ok":
            return reply[1]
        raise _decode_error(*reply[1:])

    def data_peer(
        self,
        cls: type[DataTransport],
        num_blocks: int,
        block_len: int,
        options: Mapping[str, Any],
    ) -> ChildDataPeer:
        handle, descriptor, n, b = self.call("new_data", cls, num_blocks, block_len, dict(options))
        return ChildDataPeer(self, handle, descriptor, n, b)

    def control_peer(
        self,
        cls: type[ControlTransport],
        options: Mapping[str, Any],
        max_frame_bytes: int,
        host: str = "127.0.0.1",
    ) -> ChildControlPeer:
        handle, address = self.call("new_control", cls, dict(options), max_frame_bytes, host)
        return ChildControlPeer(self, handle, address)

    def kill(self) -> None:
        if self._child is not None:
            self._child.kill()

    def pause(self) -> None:
        self.child.pause()

    def resume(self) -> None:
        if self._child is not None:
            self._child.resume()

    def close(self) -> None:
        if self._child is not None:
            self._child.resume()
            self._child.stop()
            self._child = None

    def __enter__(self) -> PeerHost:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class ChildDataPeer(DataPeer):
    """Proxy of a :class:`LocalDataPeer` living in a :class:`PeerHost`."""

    mode = "child-process"

    def __init__(
        self, host: PeerHost, handle: int, descriptor: bytes, num_blocks: int, block_len: int
    ) -> None:
        self.host = host
        self._handle = handle
        self._descriptor = descriptor
        self._num_blocks = num_blocks
        self._block_len = block_len

    def _call(self, method: str, *args: Any) -> Any:
        return self.host.call("call", self._handle, method, args)

    @property
    def descriptor(self) -> bytes:
        return self._descriptor

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def pump(self) -> None:
        return None

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self._call("add_peer", peer_id, descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        return list(self._call("remove_peer", peer_id))

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        local, remote = _plain(local_idxs), _plain(remote_idxs)
        return int(self._call("read_blocks", peer_id, local, remote))

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = self._call("poll", peer_id)
        return PollResult(list(result[0]), list(result[1]))

    def cancel(self, transfer_ids: Sequence[int]) -> object:
        return self._call("cancel", _plain(transfer_ids))

    def region_bytes(self) -> bytes:
        return bytes(self._call("region_bytes"))

    def fill(self, seed: int) -> None:
        self._call("fill", seed)

    def set_blocks(self, idxs: Sequence[int], data: bytes) -> None:
        self._call("set_blocks", _plain(idxs), bytes(data))

    def pause(self) -> None:
        """SIGSTOP the host: every peer it holds stops (no call may go to them meanwhile)."""
        self.host.pause()

    def resume(self) -> None:
        self.host.resume()

    def close(self) -> list[int]:
        return list(self._call("close"))


def _plain(idxs: Sequence[int]) -> list[Any]:
    """Indexes as a plain list for the pipe (ints stay ints; anything else goes as it is, so
    the child's transport refuses it as it would here)."""
    return [
        int(i) if isinstance(i, (int, np.integer)) and not isinstance(i, bool) else i for i in idxs
    ]


class ChildControlPeer(ControlPeer):
    """Proxy of a :class:`LocalControlPeer` living in a :class:`PeerHost`."""

    mode = "child-process"

    def __init__(self, host: PeerHost, handle: int, address: str) -> None:
        self.host = host
        self._handle = handle
        self._address = address

    def _call(self, method: str, *args: Any) -> Any:
        return self.host.call("call", self._handle, method, args)

    @property
    def address(self) -> str:
        return self._address

    def pump(self) -> None:
        return None

    def connect(self, address: str) -> int:
        return int(self._call("connect", address))

    def accepted(self) -> list[int]:
        return list(self._call("accepted"))

    def send(self, handle: int, frame: bytes) -> None:
        self._call("send", handle, frame)

    def frames(self, handle: int) -> list[bytes]:
        return list(self._call("frames", handle))

    def alive(self, handle: int) -> bool:
        return bool(self._call("alive", handle))

    def peer_address(self, handle: int) -> str:
        return str(self._call("peer_address", handle))

    def close_conn(self, handle: int) -> None:
        self._call("close_conn", handle)

    def close(self) -> None:
        self._call("close")
