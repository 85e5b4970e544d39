"""A session's outbox: frames its connection's send queue had no room for, held in order.

A full send queue is back-pressure, never a reason to close a healthy session
(docs/protocol.md §9, ``ControlConnection.send``): the frame that met ``SendQueueFull`` and
every frame after it wait here, in order, and go out as the peer drains the queue (the tier
calls :meth:`Outbox.flush` every tick). Only a peer that reads nothing at all for so long
that ``flow.max_held_frames`` frames pile up is given up on (:class:`OutboxOverflow`): such a
peer is stuck, and a live connection to it would hold our memory for ever.

Threading: driver thread only.
"""

from __future__ import annotations

from collections import deque

from p2pkv.contracts import ControlConnection
from p2pkv.errors import P2PKVError, SendQueueFull


class OutboxOverflow(P2PKVError):
    """More frames are held for a peer than ``flow.max_held_frames``: it reads nothing."""


class Outbox:
    """Sends frames on ``conn``, holding them (in order) while its send queue is full."""

    __slots__ = ("_conn", "_held", "_limit")

    def __init__(self, conn: ControlConnection, limit: int) -> None:
        self._conn = conn
        self._limit = limit
        self._held: deque[bytes] = deque()

    def send(self, frame: bytes) -> bool:
        """Send ``frame``, or hold it behind the frames already held. Returns True when it
        was held. Raises what ``conn.send`` raises but ``SendQueueFull`` (``ConnectionClosed``,
        ``FrameTooLarge``), and ``OutboxOverflow`` when the hold is full."""
        if not self._held:
            try:
                self._conn.send(frame)
            except SendQueueFull:
                pass
            else:
                return False
        if len(self._held) >= self._limit:
            raise OutboxOverflow(
                f"{len(self._held)} control frames are held for a peer whose send queue stays "
                f"full (flow.max_held_frames={self._limit}): it reads nothing"
            )
        self._held.append(frame)
        return True

    def flush(self) -> bool:
        """Send held frames, oldest first, until the queue is full again; True when none is
        held any more. Raises what ``conn.send`` raises but ``SendQueueFull``."""
        held, send = self._held, self._conn.send
        while held:
            try:
                send(held[0])
            except SendQueueFull:
                return False
            held.popleft()
        return True

    def __len__(self) -> int:
        return len(self._held)
