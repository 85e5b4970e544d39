"""The ``loopback`` control transport: framed channels between transports of one process.

Addresses are ``loop://N``. ``connect`` pairs two connection ends at once; a frame sent on one
end waits in the other end's queue until the receiving transport's ``poll`` moves it to the
inbox (so ``recv`` does no I/O). ``poll`` visits only the ends with frames queued, so it costs
the same with one connection or thousands. Frame caps, one connection per peer, handing an
inbound end out once and listing active connections (``take_active``) come from
:mod:`p2pkv.control_base`. Closing an end kills both ends; closing a transport closes its
ends.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from p2pkv.contracts import Capabilities, ControlConnection, ControlSettings
from p2pkv.control_base import InboxConnection, InboxControlTransport
from p2pkv.errors import ConfigError

__all__ = ["LoopbackConnection", "LoopbackControlTransport"]

_LISTENERS: dict[str, LoopbackControlTransport] = {}
_NAMES = itertools.count(1)


class LoopbackConnection(InboxConnection):
    """One end of a loopback channel."""

    def __init__(self, owner: LoopbackControlTransport, peer_address: str) -> None:
        super().__init__(owner, peer_address)
        self.owner = owner
        self.other: LoopbackConnection | None = None
        self.queue: deque[bytes] = deque()
        """Frames sent to us, not yet moved to the inbox by our transport's poll."""

    def _transmit(self, frame: bytes) -> None:
        other = self.other
        assert other is not None  # a live end is paired
        other.queue.append(bytes(frame))
        other.owner.queued[other] = None

    def _on_end(self) -> None:
        if self.other is not None:
            self.other.end("closed by the peer")


class LoopbackControlTransport(InboxControlTransport[LoopbackConnection]):
    """In-process control transport (see the module docstring). No options."""

    name: ClassVar[str] = "loopback"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: ControlSettings) -> None:
        if settings.options:
            raise ConfigError(
                f"loopback control takes no options, got {sorted(settings.options)}"
            )
        super().__init__(settings.max_frame_bytes)
        self.queued: dict[LoopbackConnection, None] = {}
        """Our ends with frames in their queue (moved to their inbox by the next poll)."""
        self._address = f"loop://{next(_NAMES)}"
        _LISTENERS[self._address] = self

    @classmethod
    def create(cls, settings: ControlSettings) -> LoopbackControlTransport:
        return cls(settings)

    @property
    def local_address(self) -> str:
        return self._address

    def _dial(self, address: str) -> LoopbackConnection:
        ours = LoopbackConnection(self, address)
        listener = _LISTENERS.get(address)
        if listener is None:
            ours.end("refused: nobody listens there")  # born dead
            return ours
        theirs = LoopbackConnection(listener, self._address)
        ours.other, theirs.other = theirs, ours
        listener._accept(theirs)
        return ours

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        queued, self.queued = self.queued, {}
        for end in queued:
            while end.alive and end.queue and end.deliver(end.queue.popleft()):
                pass
        return self._announce()

    def close(self) -> None:
        super().close()
        _LISTENERS.pop(self._address, None)
