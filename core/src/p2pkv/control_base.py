"""A base for control transports whose ``poll`` moves frames into per-connection inboxes.

The control contract (:class:`~p2pkv.contracts.ControlTransport`) leaves three rules to every
transport, and they are the same everywhere; :class:`InboxControlTransport` and
:class:`InboxConnection` write them once:

- **Frame caps.** ``send`` refuses a frame above ``max_frame_bytes`` (``FrameTooLarge``) and a
  dead end (``ConnectionClosed``); a frame *received* above our cap ends that connection with
  a logged reason (a broken peer), and the transport goes on.
- **Reuse on connect.** One connection per peer address: ``connect`` returns the live one,
  dialed or accepted, and dials only when there is none (a dead one is replaced).
- **Accept once.** An inbound connection is handed out exactly once: by the ``poll`` that
  finds its first frames buffered (or finds it dead), or by a ``connect`` to that peer that
  came first. An inbound connection that replaces a live one for the same address ends the
  old one.
- **Active connections.** ``take_active`` lists each connection that received a frame
  (``deliver``) or ended (``end``) since the previous call, once, so the tier visits only
  those (:meth:`~p2pkv.contracts.ControlTransport.take_active`).

What is left to a subclass is its medium: how a connection puts a frame on its way
(:meth:`InboxConnection._transmit`) and tells its peer it ended
(:meth:`InboxConnection._on_end`), how a transport dials (:meth:`InboxControlTransport._dial`)
and moves frames in its ``poll`` (calling :meth:`InboxConnection.deliver` for each frame and
:meth:`InboxControlTransport._announce` for the connections to return).

Threading: like every control transport, one driver thread at a time. A subclass whose peers
live on other threads (the reference ``memory`` transport) takes its own lock around these
calls; the base holds none.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Sequence
from typing import Generic, TypeVar

from p2pkv.contracts import ControlConnection, ControlTransport
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge
from p2pkv.logs import module_logger

log = module_logger(__name__)

OVERSIZED = "closed: peer sent an oversized frame"
"""Why a connection that received a frame above our cap ended."""

_C = TypeVar("_C", bound="InboxConnection")


class InboxConnection(ControlConnection):
    """One end of a connection of an :class:`InboxControlTransport`.

    Owns its inbox (frames its transport's ``poll`` delivered, drained by ``recv``) and its
    end: ``close_reason`` is None while it lives, then says why it ended (``end`` sets it
    once; the core puts it into the detail of the jobs that fail). Subclasses implement
    ``_transmit`` and may extend ``_on_end``.
    """

    def __init__(self, transport: InboxControlTransport[_C], peer_address: str) -> None:
        self._transport: InboxControlTransport[_C] = transport
        self._peer_address = peer_address
        self.inbox: list[bytes] = []
        self.close_reason: str | None = None
        self.announced = False
        """Handed out already (by ``connect`` or ``poll``): ``poll`` never returns it again."""

    @property
    def peer_address(self) -> str:
        """The peer's dialable address (its ``local_address``), also for an accepted end."""
        return self._peer_address

    @property
    def alive(self) -> bool:
        """True until :meth:`end` ran (closed here, by the peer, or found dead)."""
        return self.close_reason is None

    def send(self, frame: bytes) -> None:
        if self.close_reason is not None:
            raise ConnectionClosed(f"connection to {self._peer_address} is {self.close_reason}")
        cap = self._transport.max_frame_bytes
        if len(frame) > cap:
            raise FrameTooLarge(f"frame of {len(frame)} bytes exceeds max_frame_bytes={cap}")
        self._transmit(frame)

    def recv(self) -> Sequence[bytes]:
        frames = self.inbox
        if not frames:
            return ()  # the idle case allocates nothing
        self.inbox = []
        return frames

    def close(self) -> None:
        self.end("closed")

    def end(self, reason: str) -> None:
        """End this connection with ``reason``: it turns dead, its transport forgets it and
        its peer is told (``_on_end``). Idempotent: the first reason stays."""
        if self.close_reason is not None:
            return
        self.close_reason = reason
        self._transport._forget(self)
        self._transport._active[self] = None
        self._on_end()

    def deliver(self, frame: bytes) -> bool:
        """Put a received ``frame`` in the inbox (the transport's ``poll`` calls it), or,
        above our cap, end the connection with a logged reason. True if delivered."""
        cap = self._transport.max_frame_bytes
        if len(frame) > cap:
            log.warning(
                "frame of %d bytes from %s exceeds max_frame_bytes=%d; closing",
                len(frame),
                self._peer_address,
                cap,
            )
            self.end(OVERSIZED)
            return False
        self.inbox.append(frame)
        self._transport._active[self] = None
        return True

    @abstractmethod
    def _transmit(self, frame: bytes) -> None:
        """Put ``frame`` (within the cap, on a live connection) on its way to the peer
        without blocking; copy it if it is kept. May raise ``SendQueueFull``."""

    def _on_end(self) -> None:
        """Tell the peer this end is gone (called once, from ``end``). Default: nothing."""


class InboxControlTransport(ControlTransport, Generic[_C]):
    """A control transport built on :class:`InboxConnection` (see the module docstring).

    Owns the table of connections by peer address and the accepted connections not yet
    handed out. Subclasses implement ``create``, ``local_address``, ``_dial`` and ``poll``
    (moving frames, then returning ``self._announce()``), and extend ``close``. An inbound
    connection is registered with ``_accept(conn)`` only, its ``peer_address`` being the
    dialer's ``local_address``. ``_connections`` (peer address -> live connection) is
    theirs to read, never to write. All on the driver thread.
    """

    def __init__(self, max_frame_bytes: int) -> None:
        if max_frame_bytes <= 0:
            raise ConfigError(f"max_frame_bytes must be > 0, got {max_frame_bytes}")
        self.max_frame_bytes = max_frame_bytes
        self._connections: dict[str, _C] = {}
        """One connection per peer address, dialed or accepted."""
        self._accepted: list[_C] = []
        """Inbound connections not handed out yet."""
        self._active: dict[InboxConnection, None] = {}
        """Connections that received frames or ended since the last ``take_active``."""

    def connect(self, address: str) -> _C:
        known = self._connections.get(address)
        if known is not None and known.alive:
            known.announced = True
            return known
        conn = self._dial(address)
        conn.announced = True
        self._connections[address] = conn
        return conn

    def take_active(self) -> Collection[InboxConnection]:
        """The connections that received frames or ended since the previous call, once
        each, in the order that first happened to them."""
        active = self._active
        if not active:
            return ()  # the idle case allocates nothing
        self._active = {}
        return active.keys()

    def close(self) -> None:
        """End every connection; subclasses also stop listening."""
        for conn in list(self._connections.values()):
            conn.end("closed")
        self._accepted = []

    @abstractmethod
    def _dial(self, address: str) -> _C:
        """A new connection to ``address`` (never blocks; frames may be sent at once)."""

    def _accept(self, conn: _C) -> None:
        """Register an inbound connection; a live one to the same address is replaced."""
        old = self._connections.get(conn.peer_address)
        if old is not None and old is not conn:
            old.end("replaced by a new connection from the peer")
        self._connections[conn.peer_address] = conn
        self._accepted.append(conn)

    def _announce(self) -> list[_C]:
        """The accepted connections to hand out now: those with their first frames
        buffered, or dead, each once."""
        if not self._accepted:
            return []
        waiting = [c for c in self._accepted if not c.announced]
        ready = [c for c in waiting if c.inbox or not c.alive]
        self._accepted = [c for c in waiting if not (c.inbox or not c.alive)]
        for conn in ready:
            conn.announced = True
        return ready

    def _forget(self, conn: InboxConnection) -> None:
        if self._connections.get(conn.peer_address) is conn:
            del self._connections[conn.peer_address]
