"""The ``memory`` control transport: framed connections between transports of one process.

Every :class:`MemoryControlTransport` of a process listens on a process-local hub, keyed by
its address. Addresses are ``mem://name`` (when ``ControlSettings.host`` is ``mem://name``) or
``host:port``; port 0 gets a fake port unique in the process, so addresses never collide.

Model (what the tests rely on):

- One logical connection per peer pair and side. ``connect(addr)`` returns the live
  connection to ``addr`` if there is one, including an inbound one ``poll`` has not returned
  yet. An inbound connection is handed out exactly once: by ``poll`` or, if the caller dialed
  that peer first, by that ``connect``.
- Frames move only in ``poll``: a frame sent by A sits in the A->B queue until B's transport
  polls; then ``recv`` on B's connection returns it. An inbound connection is returned by
  ``poll`` with the frames that arrived with it already buffered.
- Dialing an address nobody listens on yet is not an error: frames queue and the connection
  attaches once the address is bound (checked on the dialer's ``poll``), or dies after the
  ``connect_timeout`` option (seconds).
- ``close`` on one end: frames it sent before closing are still delivered, then the other end
  turns ``alive`` False on its transport's next ``poll``. Closing a transport closes all its
  connections.
- ``send`` copies the frame; it raises ``ConnectionClosed`` on a dead end, ``FrameTooLarge``
  above ``max_frame_bytes`` and ``SendQueueFull`` when ``max_queued_frames`` frames wait
  undelivered in that direction. A frame above the receiver's cap kills the connection.

Threading: transports may live on different threads; one hub lock guards all shared state and
``poll(timeout)`` waits on it. Each transport is still driven by one thread at a time.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import (
    Capabilities,
    ControlConnection,
    ControlSettings,
    ControlTransport,
)
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge, SendQueueFull
from p2pkv.logs import module_logger
from p2pkv.options import parse_options
from p2pkv.reference.options import MemoryControlOptions

__all__ = ["MEM_SCHEME", "MemoryConnection", "MemoryControlTransport"]

log = module_logger(__name__)

MEM_SCHEME = "mem://"
_FIRST_FAKE_PORT = 20000



class _Hub:
    """Process-wide table of listening memory control transports."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        """Guards all shared state (taken directly on the hot paths: cheaper than ``cond``)."""
        self.cond = threading.Condition(self.lock)
        self.waiting = 0
        """Threads waiting on ``cond`` in ``poll`` (changed under the lock)."""
        self.listeners: dict[str, MemoryControlTransport] = {}
        self._ports = itertools.count(_FIRST_FAKE_PORT)

    def wake(self) -> None:
        """Wake the threads waiting in ``poll`` (lock held); nothing to do when none waits."""
        if self.waiting:
            self.cond.notify_all()

    def fake_address(self, host: str) -> str:
        """A ``host:port`` nobody listens on; ports count up and wrap inside 1024..65535."""
        while True:
            port = 1024 + (next(self._ports) - 1024) % (65536 - 1024)
            address = format_address(host, port)
            if address not in self.listeners:
                return address


_HUB = _Hub()


class MemoryConnection(ControlConnection):
    """One end of an in-process link. Created only by :class:`MemoryControlTransport`."""

    def __init__(self, transport: MemoryControlTransport, peer_address: str) -> None:
        self._transport = transport
        self._peer_address = peer_address
        self.peer: MemoryConnection | None = None
        """The other end, once attached."""
        self.out: deque[bytes] = deque()
        """Frames sent by us, not yet moved by the peer transport's poll."""
        self.inbox: list[bytes] = []
        self.dead_reason = ""
        self.peer_closed = False
        self.announced = False
        self.deadline = time.monotonic() + transport.connect_timeout

    @property
    def peer_address(self) -> str:
        return self._peer_address

    @property
    def alive(self) -> bool:
        return not self.dead_reason

    def send(self, frame: bytes) -> None:
        if self.dead_reason:
            raise ConnectionClosed(f"connection to {self._peer_address} is {self.dead_reason}")
        cap = self._transport.max_frame_bytes
        if len(frame) > cap:
            raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds max_frame_bytes={cap}")
        with _HUB.lock:
            if len(self.out) >= self._transport.max_queued_frames:
                raise SendQueueFull(
                    f"{len(self.out)} frames to {self._peer_address} wait undelivered "
                    f"(max_queued_frames={self._transport.max_queued_frames})"
                )
            self.out.append(bytes(frame))
            _HUB.wake()

    def recv(self) -> Sequence[bytes]:
        frames = self.inbox
        if not frames:
            return ()  # the idle case allocates nothing
        self.inbox = []
        return frames

    def close(self) -> None:
        with _HUB.lock:
            self.kill("closed")

    def kill(self, reason: str) -> None:
        """Mark this end dead and tell the peer end (hub lock held). Idempotent."""
        if self.dead_reason:
            return
        self.dead_reason = reason
        self._transport.forget(self)
        if self.peer is not None:
            self.peer.peer_closed = True
            _HUB.wake()

    def __repr__(self) -> str:
        state = "alive" if self.alive else self.dead_reason
        return f"<MemoryConnection {self._transport.local_address}->{self._peer_address} {state}>"


class MemoryControlTransport(ControlTransport):
    """In-process control transport (see the module docstring for the model).

    Options (``control_options``): ``max_queued_frames`` (int > 0, default 1_000_000),
    ``connect_timeout`` (seconds > 0 an unattached dial may wait for its listener, default 10).
    """

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: ControlSettings) -> None:
        opts = parse_options(MemoryControlOptions, settings.options, "memory control option")
        if settings.max_frame_bytes <= 0:
            raise ConfigError("max_frame_bytes must be > 0")
        self.max_queued_frames = opts.max_queued_frames
        self.connect_timeout = opts.connect_timeout
        self.max_frame_bytes = settings.max_frame_bytes
        self._conns: dict[str, MemoryConnection] = {}
        self._accepted: list[MemoryConnection] = []
        self._closed = False
        self._interrupted = False  # guarded by _HUB.lock
        with _HUB.lock:
            self._address = _local_address(settings)
            if self._address in _HUB.listeners:
                raise ConfigError(f"memory address {self._address} is already in use")
            _HUB.listeners[self._address] = self

    @classmethod
    def create(cls, settings: ControlSettings) -> MemoryControlTransport:
        return cls(settings)

    @property
    def local_address(self) -> str:
        return self._address

    def connect(self, address: str) -> ControlConnection:
        if not address.startswith(MEM_SCHEME):
            parse_address(address)
        elif address == MEM_SCHEME:
            raise ConfigError(f"malformed memory address {address!r}: empty name")
        if address == self._address:
            raise ConfigError(
                f"memory transport {address} cannot connect to itself (the memory transport "
                f"is process-local: a peer in another process with the same address is "
                f"unreachable; use a network control transport such as zmq)")
        with _HUB.lock:
            if self._closed:
                raise ConnectionClosed(f"transport {self._address} is closed")
            conn = self._conns.get(address)
            if conn is not None and conn.alive:
                conn.announced = True
                return conn
            conn = MemoryConnection(self, address)
            conn.announced = True
            self._conns[address] = conn
            self._attach(conn)
            return conn

    def interrupt(self) -> None:
        """End a waiting ``poll`` now, or the next one (any thread)."""
        with _HUB.lock:
            self._interrupted = True
            _HUB.cond.notify_all()

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        deadline = time.monotonic() + timeout
        with _HUB.lock:
            while not self._closed:
                moved = self._progress()
                remaining = deadline - time.monotonic()
                if moved or remaining <= 0 or self._interrupted:
                    self._interrupted = False
                    break
                _HUB.waiting += 1
                try:
                    _HUB.cond.wait(remaining)
                finally:
                    _HUB.waiting -= 1
            if not self._accepted:
                return []
            # An inbound connection is announced once, with its first frames buffered (or
            # dead): one that has not sent anything yet waits for a later poll.
            self._accepted = [c for c in self._accepted if not c.announced]
            ready = [c for c in self._accepted if c.inbox or not c.alive]
            if ready:
                self._accepted = [c for c in self._accepted if not (c.inbox or not c.alive)]
                for conn in ready:
                    conn.announced = True
            return ready

    def close(self) -> None:
        with _HUB.lock:
            if self._closed:
                return
            self._closed = True
            for conn in list(self._conns.values()):
                conn.kill("closed")
            self._accepted = []
            if _HUB.listeners.get(self._address) is self:
                del _HUB.listeners[self._address]
            _HUB.wake()

    # -- internals (hub lock held) -------------------------------------------------------

    def forget(self, conn: MemoryConnection) -> None:
        if self._conns.get(conn.peer_address) is conn:
            del self._conns[conn.peer_address]

    def _attach(self, conn: MemoryConnection) -> bool:
        """Pair a dialed connection with an end at the listener, if the listener exists."""
        target = _HUB.listeners.get(conn.peer_address)
        if target is None:
            return False
        other = target._conns.get(self._address)
        if other is not None and other.peer is None and other.alive:
            pass  # both sides dialed before either attached: pair the two dialed ends
        else:
            if other is not None:
                other.kill("replaced by a new connection from the peer")
            other = MemoryConnection(target, self._address)
            target._conns[self._address] = other
            target._accepted.append(other)
        conn.peer, other.peer = other, conn
        _HUB.wake()
        return True

    def _progress(self) -> bool:
        """Attach pending dials, move inbound frames, notice dead peers. True if anything moved."""
        moved = False
        now = time.monotonic()
        for conn in list(self._conns.values()):
            peer = conn.peer
            if peer is None:
                if self._attach(conn):
                    moved = True
                elif now > conn.deadline:
                    conn.kill(f"unreachable: nobody listened on {conn.peer_address}")
                    moved = True
                continue
            while peer.out:
                frame = peer.out.popleft()
                if len(frame) > self.max_frame_bytes:
                    log.warning(
                        "frame of %d bytes from %s exceeds max_frame_bytes=%d; closing",
                        len(frame), conn.peer_address, self.max_frame_bytes,
                    )
                    conn.kill("closed: peer sent an oversized frame")
                    break
                conn.inbox.append(frame)
                moved = True
            if conn.peer_closed and conn.alive:
                conn.kill("closed by peer")
                moved = True
        return moved


def _local_address(settings: ControlSettings) -> str:
    host, port = settings.host, settings.port
    if host.startswith(MEM_SCHEME):
        if host == MEM_SCHEME:
            raise ConfigError(f"malformed memory address {host!r}: empty name")
        return host
    if not host:
        raise ConfigError("memory control transport: host must not be empty")
    if not 0 <= port < 65536:
        raise ConfigError(f"port {port} is outside 0..65535")
    return format_address(host, port) if port else _HUB.fake_address(host)
