"""One logical connection to a peer: our PUSH socket out, the peer's frames in (via our PULL).

Sending may be batched (once the owner of the transport asked for it, ``batch_sends``, as the
tier does): ``send`` then queues the frame in the connection, and
:meth:`ZmqConnection.push` hands every queued frame to libzmq back to back at the transport's
flush point (the hub's ``flush``, which the tier calls as a public call that queued a frame
returns, and the start of every ``poll``). libzmq's I/O thread then wakes about once for a tick's
frames instead of once per frame. Nothing changes on the wire (each frame is its own
message), and a frame waits at most until the call that queued it returns (a frame the
tier sends as cleanup, the terminal fetch, until the next flush or poll). Without batching,
``send`` pushes at once. Either way, frames a full libzmq queue cannot take wait in the
connection, in order, for the next flush or poll, and ``send`` refuses more
(``SendQueueFull``) until they got through. So do frames sent while the hub still checks
that the peer's address accepts TCP connections (:mod:`p2pkv_zmq.reach`): ``out`` is None
then.

Progress of a dial (:attr:`ZmqConnection.progress`), as the hub's monitor of our PUSH reports
it: ``"dialing"`` until the TCP connection is up, ``"connected"`` while the ZMTP handshake runs
(CURVE included), ``"ready"`` once it completed and our frames reach the peer's listener. A
dial to a refused or black-holed address never leaves ``"dialing"``; a peer that accepts TCP
but does not speak ZMTP stays ``"connected"`` until ``handshake_timeout``. A dead connection
keeps the stage it reached. A connection the peer dialed first is ours dialing back, so it
starts at ``"dialing"`` too. A dial whose reach check connected (:mod:`p2pkv_zmq.reach`) is
``"connected"`` from then on: its address accepts TCP.

Threading: used only from the transport's driver thread, like the hub that owns it. The hub
fills ``inbox``, advances ``progress`` and retires the connection (``close_reason`` set,
sockets released); the connection never does I/O except ``send``/``push``, and knows of the
hub only its :class:`Owner` side (``retire``, and ``queued``: frames to push) and the limits
it was given.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

import zmq
from p2pkv.contracts import ControlConnection
from p2pkv.errors import ConnectionClosed, FrameTooLarge, SendQueueFull

__all__ = [
    "CONNECTED",
    "DIALING",
    "READY",
    "LinkLimits",
    "Owner",
    "PeerAddress",
    "Progress",
    "ZmqConnection",
]

Progress = Literal["dialing", "connected", "ready"]
DIALING: Progress = "dialing"
CONNECTED: Progress = "connected"
READY: Progress = "ready"

_NOBLOCK = zmq.NOBLOCK
_NOBLOCK_MORE = zmq.NOBLOCK | zmq.SNDMORE
_SEND = zmq.backend.Socket.send
"""pyzmq's own send, under ``zmq.Socket.send`` (which adds only the ``routing_id`` and
``group`` arguments of draft sockets): half the cost of a send of a small frame."""
_EMPTY: Sequence[bytes] = ()
_MAX_QUEUED = 64
"""Frames ``send`` queues before it pushes them at once (a tick that sends more is split)."""


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


class Owner(Protocol):
    """What a connection knows of its hub."""

    batching: bool
    """Whether ``send`` leaves frames queued for the flush point (else it pushes at once)."""

    def retire(self, conn: ZmqConnection, reason: str) -> None:
        """End ``conn`` with a reason (idempotent)."""

    def queued(self, conn: ZmqConnection) -> None:
        """``conn`` has frames to push at the next flush."""


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
        owner: Owner,
        limits: LinkLimits,
        peer: PeerAddress,
        *,
        out: zmq.Socket[bytes] | None,
        monitor: zmq.Socket[bytes] | None,
        incarnation: bytes,
        link: bytes,
        deadline: float,
    ) -> None:
        self._owner = owner
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
        self.listed = False
        """Listed for the next ``take_active`` already (the hub's news, see
        :mod:`p2pkv_zmq.pairing`)."""
        self._progress: Progress = DIALING
        self._max_frame = limits.max_frame_bytes
        self._unsent: list[bytes] = []
        """Frames ``send`` accepted that are not handed to libzmq yet, oldest first."""
        self._stalled = False
        """The last push met a full libzmq queue: ``send`` refuses until a push gets through."""

    @classmethod
    def failed(
        cls, owner: Owner, limits: LinkLimits, peer: PeerAddress, *, reason: str
    ) -> ZmqConnection:
        """A connection that is dead from the start (a dial that could not begin): no
        sockets, not registered with the hub, ``close_reason`` says why."""
        conn = cls(
            owner, limits, peer, out=None, monitor=None, incarnation=b"", link=b"", deadline=0.0
        )
        conn.close_reason = reason
        return conn

    @property
    def peer_address(self) -> str:
        return self._shown_address

    @property
    def alive(self) -> bool:
        return self.close_reason is None

    @property
    def progress(self) -> Progress:
        """How far our dial got: ``"dialing"``, ``"connected"`` or ``"ready"`` (see the
        module docstring). A caller that must choose which pending dial to give up can keep
        those that made progress: they reach a live peer."""
        return self._progress

    def reached(self, stage: Progress) -> None:
        """The hub's monitor saw our PUSH reach ``stage`` (never moves back)."""
        if stage == READY or self._progress == DIALING:
            self._progress = stage

    def send(self, frame: bytes) -> None:
        """Queue ``frame`` for the next push (see the module docstring). ``SendQueueFull``
        while libzmq's queue to the peer is full (the last push could not empty ours);
        ``ConnectionClosed``, ``FrameTooLarge`` as the contract says."""
        if self.close_reason is not None:
            raise ConnectionClosed(
                f"connection to {self._shown_address} is gone: {self.close_reason}"
            )
        if len(frame) > self._max_frame:
            raise FrameTooLarge(
                f"frame of {len(frame)} bytes exceeds max_frame_bytes {self._max_frame}; it "
                f"was not sent"
            )
        unsent = self._unsent
        if self._stalled and not self.push():
            raise SendQueueFull(
                f"send queue to {self._shown_address} is full "
                f"({self._limits.max_queued_frames} frames; zmq option max_queued_frames)"
            )
        unsent.append(frame)
        owner = self._owner
        if not owner.batching or len(unsent) >= _MAX_QUEUED:
            self.push()
            if self.close_reason is not None:  # libzmq failed it: say so, as before batching
                raise ConnectionClosed(f"connection to {self._shown_address}: {self.close_reason}")
        elif len(unsent) == 1:
            owner.queued(self)

    def push(self) -> bool:
        """Hand the queued frames to libzmq, oldest first, until its queue is full; True when
        none is left. A connection libzmq fails is retired with the error (its frames are
        dropped: the peer sees it die). A live one without its PUSH yet (a reach check runs)
        keeps them, up to ``max_queued_frames``, for the hub to push once it dials."""
        unsent = self._unsent
        out = self.out
        if out is None:
            if self.close_reason is None:
                self._stalled = len(unsent) >= self._limits.max_queued_frames
                return not self._stalled
            unsent.clear()
            return True
        if not unsent:
            return True
        sent = 0
        try:
            for frame in unsent:
                _SEND(out, self.link, _NOBLOCK_MORE)  # the only part that can find it full
                _SEND(out, frame, _NOBLOCK)
                sent += 1
        except zmq.Again:
            del unsent[:sent]
            self._stalled = True
            self._owner.queued(self)  # retried by the next flush or poll
            return False
        except zmq.ZMQError as exc:
            unsent.clear()
            self._owner.retire(self, f"send failed: {exc}")
            return True
        unsent.clear()
        self._stalled = False
        return True

    def recv(self) -> Sequence[bytes]:
        frames = self.inbox
        if not frames:
            return _EMPTY
        self.inbox = []
        return frames

    def close(self) -> None:
        """Push what is queued (a ``bye`` sent just before), then end the connection."""
        self.push()
        self._owner.retire(self, "closed locally")

    def __repr__(self) -> str:
        state = "alive" if self.close_reason is None else self.close_reason
        return f"<ZmqConnection {self._shown_address} {state}>"
