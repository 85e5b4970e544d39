"""The p2pkv error hierarchy.

Every error p2pkv raises on purpose derives from :class:`P2PKVError`, so an engine adapter can
catch one base class. Transports map their library's exceptions onto these in one place.
"""

from __future__ import annotations

__all__ = [
    "ConcurrentCall",
    "ConfigError",
    "ConnectionClosed",
    "P2PKVError",
    "PeerRejected",
    "ProtocolError",
    "SendQueueFull",
    "TransferSubmitError",
    "TransportUnavailable",
]


class P2PKVError(Exception):
    """Base class of every error p2pkv raises deliberately."""


class TransportUnavailable(P2PKVError):
    """An optional library a transport needs is missing or broken.

    ``package`` is the pip requirement that fixes it; the message always names it, so the
    operator never meets an ``AttributeError`` or a bare ``ImportError`` later.
    """

    def __init__(self, transport: str, package: str, cause: str) -> None:
        self.transport = transport
        self.package = package
        self.cause = cause
        super().__init__(
            f"transport {transport!r} is unavailable: {cause}. "
            f"Install it with: pip install {package}"
        )


class ConfigError(P2PKVError, ValueError):
    """A tier config, option or environment variable is invalid; the message names the key."""


class ProtocolError(P2PKVError, ValueError):
    """A peer sent something the protocol forbids; the session with that peer is closed."""


class PeerRejected(P2PKVError):
    """A peer is incompatible (region shape, block length, fingerprint, hash seed, wire major)."""


class TransferSubmitError(P2PKVError):
    """A data transfer could not be submitted; nothing was posted for it."""


class ConcurrentCall(P2PKVError, RuntimeError):
    """A second thread called into an object that admits one driver thread at a time while
    the first was still inside; nothing was done for the second call."""


class ConnectionClosed(P2PKVError):
    """``send`` on a control connection that is closed or dead."""


class SendQueueFull(P2PKVError):
    """A control connection's bounded send queue is full; the frame was not queued."""
