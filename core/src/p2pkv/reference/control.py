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
  polls; then ``recv`` on B's connection returns it. A poll visits only the connections
  something happened to (frames, a close, a dial waiting for its listener), so an idle
  transport polls in constant time however many connections it has. An inbound connection
  is returned by ``poll`` with the frames that arrived with it already buffered.
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
from p2pkv.contracts import Capabilities, ControlConnection, ControlSettings, SessionRoom
from p2pkv.control_base import InboxConnection, InboxControlTransport
from p2pkv.errors import ConfigError, ConnectionClosed, SendQueueFull
from p2pkv.options import parse_options
from p2pkv.reference.options import MemoryControlOptions

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
        self.opened = 0
        """Listeners opened so far (a dial waiting for its listener retries when it grows)."""
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


class MemoryConnection(InboxConnection):
    """One end of an in-process link. Created only by :class:`MemoryControlTransport`."""

    def __init__(self, transport: MemoryControlTransport, peer_address: str) -> None:
        super().__init__(transport, peer_address)
        self._owner = transport
        self.peer: MemoryConnection | None = None
        """The other end, once attached."""
        self.out: deque[bytes] = deque()
        """Frames sent by us, not yet moved by the peer transport's poll."""
        self.peer_closed = False
        self.deadline = time.monotonic() + transport.connect_timeout

    def _transmit(self, frame: bytes) -> None:
        with _HUB.lock:
            if len(self.out) >= self._owner.max_queued_frames:
                raise SendQueueFull(
                    f"{len(self.out)} frames to {self.peer_address} wait undelivered "
                    f"(max_queued_frames={self._owner.max_queued_frames})"
                )
            self.out.append(bytes(frame))
            if self.peer is not None:
                self.peer.pending()
            _HUB.wake()

    def close(self) -> None:
        with _HUB.lock:
            super().close()

    def _on_end(self) -> None:
        """Tell the peer end (hub lock held)."""
        if self.peer is not None:
            self.peer.peer_closed = True
            self.peer.pending()
            _HUB.wake()

    def pending(self) -> None:
        """Its peer sent frames or ended: its transport's next poll visits this end (hub lock
        held)."""
        self._owner._incoming[self] = None

    def __repr__(self) -> str:
        state = "alive" if self.close_reason is None else self.close_reason
        return f"<MemoryConnection {self._owner.local_address}->{self.peer_address} {state}>"


class MemoryControlTransport(InboxControlTransport[MemoryConnection]):
    """In-process control transport (see the module docstring for the model).

    Options (``control_options``): ``max_queued_frames`` (int > 0, default 1_000_000),
    ``connect_timeout`` (seconds > 0 an unattached dial may wait for its listener, default 10),
    ``max_connections`` (int >= 0: connections held at most, a peer's dial beyond it refused
    and counted in ``accepts_refused``, as a transport out of sockets does; default 0,
    unbounded).
    """

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: ControlSettings) -> None:
        opts = parse_options(MemoryControlOptions, settings.options, "memory control option")
        super().__init__(settings.max_frame_bytes)
        self.max_queued_frames = opts.max_queued_frames
        self.connect_timeout = opts.connect_timeout
        self.max_connections = opts.max_connections
        self._refused = 0
        """Peers' dials refused over ``max_connections`` (hub lock)."""
        self._closed = False
        self._interrupted = False  # guarded by _HUB.lock
        self._attaching: dict[MemoryConnection, None] = {}
        """Dialed connections whose listener was not there yet (retried when a listener
        opens, ended at their deadline)."""
        self._attach_seen = -1
        """``_HUB.opened`` when the waiting dials were last tried."""
        self._incoming: dict[MemoryConnection, None] = {}
        """Our ends whose peer sent frames or ended since the last poll (hub lock)."""
        with _HUB.lock:
            self._address = _local_address(settings)
            if self._address in _HUB.listeners:
                raise ConfigError(f"memory address {self._address} is already in use")
            _HUB.listeners[self._address] = self
            _HUB.opened += 1

    @classmethod
    def create(cls, settings: ControlSettings) -> MemoryControlTransport:
        return cls(settings)

    @property
    def local_address(self) -> str:
        return self._address

    def connect(self, address: str) -> MemoryConnection:
        if not address.startswith(MEM_SCHEME):
            parse_address(address)
        elif address == MEM_SCHEME:
            raise ConfigError(f"malformed memory address {address!r}: empty name")
        if address == self._address:
            raise ConfigError(
                f"memory transport {address} cannot connect to itself (the memory transport "
                f"is process-local: a peer in another process with the same address is "
                f"unreachable; use a network control transport such as zmq)"
            )
        with _HUB.lock:
            if self._closed:
                raise ConnectionClosed(f"transport {self._address} is closed")
            return super().connect(address)

    def session_room(self) -> SessionRoom | None:
        """``max_connections`` less the connections held; None when unbounded."""
        cap = self.max_connections
        if not cap:
            return None
        with _HUB.lock:
            return SessionRoom(max(0, cap - len(self._connections)), cap)

    @property
    def accepts_refused(self) -> int:
        return self._refused

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
            return self._announce()

    def close(self) -> None:
        with _HUB.lock:
            if self._closed:
                return
            self._closed = True
            super().close()
            if _HUB.listeners.get(self._address) is self:
                del _HUB.listeners[self._address]
            _HUB.wake()

    # -- internals (hub lock held) -------------------------------------------------------

    def _dial(self, address: str) -> MemoryConnection:
        conn = MemoryConnection(self, address)
        if not self._attach(conn):
            self._attaching[conn] = None
        return conn

    def _attach(self, conn: MemoryConnection) -> bool:
        """Pair a dialed connection with an end at the listener, if the listener exists."""
        target = _HUB.listeners.get(conn.peer_address)
        if target is None:
            return False
        other = target._connections.get(self._address)
        if other is None or other.peer is not None or not other.alive:
            if other is None and target._full():  # a replaced connection frees its place
                target._refused += 1
                conn.end(f"refused by {target._address}: no room for another connection")
                return True
            other = MemoryConnection(target, self._address)
            target._accept(other)
        # else both sides dialed before either attached: pair the two dialed ends
        conn.peer, other.peer = other, conn
        target._attaching.pop(other, None)
        conn.pending()  # frames either end sent before the pairing move now
        other.pending()
        _HUB.wake()
        return True

    def _full(self) -> bool:
        """Whether ``max_connections`` connections are held (a new peer would be refused)."""
        return 0 < self.max_connections <= len(self._connections)

    def _retry_attaching(self) -> bool:
        """Attach the waiting dials whose listener opened since the last try; end those past
        their deadline (the oldest first: they wait in dial order)."""
        now, retry = time.monotonic(), _HUB.opened != self._attach_seen
        self._attach_seen = _HUB.opened
        moved = False
        for conn in list(self._attaching):
            if not conn.alive or (retry and self._attach(conn)):
                moved = moved or conn.alive
            elif now > conn.deadline:
                conn.end(f"unreachable: nobody listened on {conn.peer_address}")
                moved = True
            elif not retry:
                break  # the rest were dialed later: not due either
            else:
                continue
            del self._attaching[conn]
        return moved

    def _progress(self) -> bool:
        """Attach pending dials, move inbound frames, notice dead peers; only the connections
        something happened to are visited. True if anything moved."""
        moved = False
        if self._attaching:
            moved = self._retry_attaching()
        if self._incoming:
            incoming, self._incoming = self._incoming, {}
            for conn in incoming:
                peer = conn.peer
                if peer is None or not conn.alive:
                    continue
                while peer.out and conn.deliver(peer.out.popleft()):
                    moved = True
                if conn.peer_closed and conn.alive:
                    conn.end("closed by peer")
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
