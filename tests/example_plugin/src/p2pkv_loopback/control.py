"""The ``loopback`` control transport: framed channels between transports of one process.

Addresses are ``loop://N``. ``connect`` pairs two connection ends at once; a frame sent on one
end waits in the other end's queue until the receiving transport's ``poll`` moves it to the
inbox (so ``recv`` does no I/O). An inbound end is returned by ``poll`` once, after its first
frame has arrived. Closing an end kills both ends; closing a transport closes its ends.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from p2pkv.contracts import Capabilities, ControlConnection, ControlSettings, ControlTransport
from p2pkv.errors import ConfigError, ConnectionClosed, FrameTooLarge

__all__ = ["LoopbackConnection", "LoopbackControlTransport"]

_LISTENERS: dict[str, LoopbackControlTransport] = {}
_NAMES = itertools.count(1)


class LoopbackConnection(ControlConnection):
    """One end of a loopback channel."""

    def __init__(self, owner: LoopbackControlTransport, peer_address: str) -> None:
        self.owner = owner
        self._peer_address = peer_address
        self.other: LoopbackConnection | None = None
        self.queue: deque[bytes] = deque()
        """Frames sent to us, not yet moved to ``inbox`` by our transport's poll."""
        self.inbox: list[bytes] = []
        self.dead = False

    @property
    def peer_address(self) -> str:
        return self._peer_address

    @property
    def alive(self) -> bool:
        return not self.dead

    def send(self, frame: bytes) -> None:
        if self.dead or self.other is None:
            raise ConnectionClosed(f"connection to {self._peer_address} is closed")
        if len(frame) > self.owner.max_frame_bytes:
            raise FrameTooLarge(
                f"frame of {len(frame)} bytes exceeds max_frame_bytes={self.owner.max_frame_bytes}"
            )
        self.other.queue.append(bytes(frame))

    def recv(self) -> Sequence[bytes]:
        frames, self.inbox = self.inbox, []
        return frames

    def close(self) -> None:
        for end in (self, self.other):
            if end is not None and not end.dead:
                end.dead = True
                end.owner.ends.discard(end)


class LoopbackControlTransport(ControlTransport):
    """In-process control transport (see the module docstring). No options."""

    name: ClassVar[str] = "loopback"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: ControlSettings) -> None:
        if settings.options:
            raise ConfigError(
                f"loopback control takes no options, got {sorted(settings.options)}"
            )
        self.max_frame_bytes = settings.max_frame_bytes
        self._address = f"loop://{next(_NAMES)}"
        self.ends: set[LoopbackConnection] = set()
        self._dialed: dict[str, LoopbackConnection] = {}
        self._unannounced: list[LoopbackConnection] = []
        _LISTENERS[self._address] = self

    @classmethod
    def create(cls, settings: ControlSettings) -> LoopbackControlTransport:
        return cls(settings)

    @property
    def local_address(self) -> str:
        return self._address

    def connect(self, address: str) -> ControlConnection:
        known = self._dialed.get(address)
        if known is not None and known.alive:
            return known
        ours = LoopbackConnection(self, address)
        listener = _LISTENERS.get(address)
        if listener is None:
            ours.dead = True  # nobody listens there: the connection is born dead
        else:
            theirs = LoopbackConnection(listener, self._address)
            ours.other, theirs.other = theirs, ours
            self.ends.add(ours)
            listener.ends.add(theirs)
            listener._unannounced.append(theirs)
        self._dialed[address] = ours
        return ours

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        for end in list(self.ends):
            while end.queue:
                frame = end.queue.popleft()
                if len(frame) > self.max_frame_bytes:
                    end.close()  # a peer above our cap is a broken peer
                    break
                end.inbox.append(frame)
        ready = [end for end in self._unannounced if end.inbox or end.dead]
        self._unannounced = [end for end in self._unannounced if end not in ready]
        return [end for end in ready if not end.dead]

    def close(self) -> None:
        for end in list(self.ends):
            end.close()
        self._unannounced.clear()
        _LISTENERS.pop(self._address, None)
