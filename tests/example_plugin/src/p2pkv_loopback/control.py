"""The ``loopback`` control transport: framed channels between transports of one process.

Addresses are ``host:port``, as the tier routes (docs/plugin-authors.md, "Addresses and non-IP
media"): the medium has no ports, so port 0 takes the next number free in this process, and a
port already taken is refused. ``connect`` pairs two connection ends at once; a frame sent on
one end waits in the other end's queue until the receiving transport's ``poll`` moves it to
the inbox (so ``recv`` does no I/O). ``poll`` visits only the ends with frames queued, so it
costs the same with one connection or thousands. Frame caps, one connection per peer, handing
an inbound end out once and listing active connections (``take_active``) come from
:class:`p2pkv.InboxControlTransport`. Closing an end kills both ends;
closing a transport closes its ends.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Sequence
from typing import ClassVar

from p2pkv import (
    Capabilities,
    ConfigError,
    ControlConnection,
    ControlSettings,
    InboxConnection,
    InboxControlTransport,
    format_address,
)

__all__ = ["LoopbackConnection", "LoopbackControlTransport"]

_LISTENERS: dict[str, LoopbackControlTransport] = {}
_PORTS = itertools.cycle(range(40000, 65536))
"""The numbers port 0 tries, in turn, for one nobody in this process listens on."""


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
            raise ConfigError(f"loopback control takes no options, got {sorted(settings.options)}")
        address = self._free_address(settings)
        super().__init__(settings.max_frame_bytes)
        self.queued: dict[LoopbackConnection, None] = {}
        """Our ends with frames in their queue (moved to their inbox by the next poll)."""
        self._address = address
        _LISTENERS[address] = self

    @staticmethod
    def _free_address(settings: ControlSettings) -> str:
        if settings.port:
            address = format_address(settings.host, settings.port)
            if address in _LISTENERS:
                raise ConfigError(
                    f"loopback address {address} is already in use; change {settings.port_setting}"
                )
            return address
        for _ in range(65536 - 40000):
            address = format_address(settings.host, next(_PORTS))
            if address not in _LISTENERS:
                return address
        raise ConfigError(f"loopback: every port of {settings.host} is taken")

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
