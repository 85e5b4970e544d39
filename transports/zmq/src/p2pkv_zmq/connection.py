"""One logical connection to a peer: our PUSH socket out, the peer's frames in (via our PULL).

Threading: used only from the transport's driver thread, like the hub that owns it. The hub
fills ``inbox`` and retires the connection (``close_reason`` set, sockets released); the
connection never does I/O except ``send``, and knows of the hub only the ``retire`` callable
its ``close`` calls and the limits it was given.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import zmq
from p2pkv.contracts import ControlConnection
from p2pkv.errors import ConnectionClosed, FrameTooLarge, SendQueueFull

__all__ = ["LinkLimits", "PeerAddress", "Retire", "ZmqConnection"]

_NOBLOCK = zmq.NOBLOCK
_NOBLOCK_MORE = zmq.NOBLOCK | zmq.SNDMORE
_SEND = zmq.backend.Socket.send
"""pyzmq's own send, under ``zmq.Socket.send`` (which adds only the ``routing_id`` and
``group`` arguments of draft sockets): half the cost of a send of a small frame."""
_EMPTY: Sequence[bytes] = ()


@dataclass(frozen=True)
class LinkLimits:
    """What ``send`` enforces on every connection of one transport."""

    max_frame_bytes: int
    """Largest frame ``send`` accepts (``FrameTooLarge`` above it)."""
    max_queued_frames: int
    """Frames queued before ``send`` raises ``SendQueueFull`` (the zmq option)."""


@dataclass(frozen=True)
class PeerAddress:
    """Whom a connection is to."""

    key: str
    """The canonical address: what the hub knows connections by."""
    shown: str
    """The address as the caller spelled it: ``peer_address`` and error messages show it."""


Retire = Callable[["ZmqConnection", str], None]
"""Ends a connection with a reason (the hub's ``retire``; idempotent)."""


class ZmqConnection(ControlConnection):
    """A connection of a :class:`~p2pkv_zmq.hub.ZmqHub`; created by ``connect`` or ``poll``.

    ``key`` is the peer's canonical address, ``incarnation`` our PUSH socket's and ``link`` its
    link id (the first frame of everything it sends), ``remote_link`` the link id of the
    peer's PUSH once known. ``close_reason`` is None while alive, then says why the
    connection ended (set by the hub only; the core puts it into a failed job's detail):
    "connection refused: ...", "no such host ...", "security handshake failed: ...",
    "closed by the peer", and so on. Frames received before that stay readable with ``recv``.
    """

    def __init__(
        self,
        retire: Retire,
        limits: LinkLimits,
        peer: PeerAddress,
        *,
        out: zmq.Socket[bytes] | None,
        monitor: zmq.Socket[bytes] | None,
        incarnation: bytes,
        link: bytes,
        deadline: float,
    ) -> None:
        self._retire = retire
        self._limits = limits
        self._shown_address = peer.shown
        self.key = peer.key
        self.out: zmq.Socket[bytes] | None = out
        self.monitor: zmq.Socket[bytes] | None = monitor
        self.incarnation = incarnation
        self.link = link
        self.remote_link: bytes | None = None
        self.inbox: list[bytes] = []
        self.deadline = deadline
        self.close_reason: str | None = None
        self._max_frame = limits.max_frame_bytes

    @classmethod
    def failed(
        cls, retire: Retire, limits: LinkLimits, peer: PeerAddress, *, reason: str
    ) -> ZmqConnection:
        """A connection that is dead from the start (a dial that could not begin): no
        sockets, not registered with the hub, ``close_reason`` says why."""
        conn = cls(retire, limits, peer, out=None, monitor=None, incarnation=b"", link=b"",
                   deadline=0.0)
        conn.close_reason = reason
        return conn

    @property
    def peer_address(self) -> str:
        return self._shown_address

    @property
    def alive(self) -> bool:
        return self.close_reason is None

    def send(self, frame: bytes) -> None:
        if self.close_reason is not None:
            raise ConnectionClosed(
                f"connection to {self._shown_address} is gone: {self.close_reason}"
            )
        if len(frame) > self._max_frame:
            raise FrameTooLarge(
                f"frame of {len(frame)} bytes exceeds max_frame_bytes {self._max_frame}; it "
                f"was not sent"
            )
        out = self.out
        assert out is not None  # released only together with setting close_reason
        try:
            _SEND(out, self.link, _NOBLOCK_MORE)  # the only part that can find the queue full
            _SEND(out, frame, _NOBLOCK)
        except zmq.Again:
            raise SendQueueFull(
                f"send queue to {self._shown_address} is full "
                f"({self._limits.max_queued_frames} frames; zmq option max_queued_frames)"
            ) from None
        except zmq.ZMQError as exc:
            raise ConnectionClosed(f"connection to {self._shown_address}: {exc}") from exc

    def recv(self) -> Sequence[bytes]:
        frames = self.inbox
        if not frames:
            return _EMPTY
        self.inbox = []
        return frames

    def close(self) -> None:
        self._retire(self, "closed locally")

    def __repr__(self) -> str:
        state = "alive" if self.close_reason is None else self.close_reason
        return f"<ZmqConnection {self._shown_address} {state}>"
