"""The ``control_options`` / ``data_options`` of the memory transports, read by
:func:`p2pkv.options.parse_options` (unknown keys, wrong types and out-of-range values are a
``ConfigError`` naming the key)."""

from __future__ import annotations

from dataclasses import dataclass, field

from p2pkv.options import option


@dataclass(frozen=True)
class MemoryControlOptions:
    """``control_options`` of the memory control transport."""

    max_queued_frames: int = field(default=1_000_000, metadata=option(gt=0))
    """Frames a connection queues before ``send`` raises ``SendQueueFull``."""
    connect_timeout: float = field(default=10.0, metadata=option(gt=0, unit="seconds"))
    """How long an unattached dial may wait for its listener."""
    max_connections: int = field(default=0, metadata=option(ge=0))
    """Connections (dialed and accepted) the transport holds at most; a peer's dial beyond
    it is refused (0: unbounded). Models a transport out of sockets in tests."""


@dataclass(frozen=True)
class MemoryDataOptions:
    """``data_options`` of the memory data transport."""

    completion_polls: int = field(default=0, metadata=option(ge=0))
    """Polls a read stays in flight before it completes (0: copied at submit)."""
    read_capacity: int = field(default=0, metadata=option(ge=0))
    """Blocks all reads may have in flight at once, like a staging pool every peer's reads
    share (0: unbounded). A read that does not fit now raises ``TransferBusy``, one larger
    than the capacity ``TransferSubmitError``; models a window-limited transport in tests."""
