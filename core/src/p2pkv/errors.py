"""The p2pkv error hierarchy.

Every error p2pkv raises on purpose derives from :class:`P2PKVError`, so an engine adapter can
catch one base class. Transports map their library's exceptions onto these in one place,
keeping the library's exception as ``__cause__`` when it tells the operator more.

::

    P2PKVError
    ├── TransportUnavailable        a transport cannot run here (library, OS); ends in the fix
    ├── ConfigError (ValueError)    a config key, option or environment variable; names the key
    ├── UsageError (ValueError)     the engine called the API wrongly; nothing done, tier goes on
    ├── ResourceUnavailable (RuntimeError)
    │                               a valid config, but a runtime resource is out (sockets,
    │                               descriptors, memory registration, a device)
    ├── ProtocolError (ValueError)  the *peer* broke the protocol; its session is closed
    ├── FrameTooLarge (ValueError)  *our* frame is over the cap; not sent, its request fails
    ├── PeerRejected                the peer is incompatible (shape, fingerprint, seed, major)
    ├── TransferSubmitError         a data transfer could not be submitted; nothing posted
    │   └── TransferBusy            ... for now: a bounded resource is in use; retry later
    ├── ConcurrentCall (RuntimeError)
    │                               a second thread entered a one-driver object
    ├── ConnectionClosed            ``send`` on a closed or dead control connection
    └── SendQueueFull               a control connection's send queue is full; frame not queued

Which one: wrong *input* is a ``ConfigError`` (at create) or ``UsageError`` (at a call); a
*runtime* shortage with valid input is ``ResourceUnavailable``; the *peer's* fault is
``ProtocolError`` or ``PeerRejected``; ours on the wire is ``FrameTooLarge``.
"""

from __future__ import annotations


class P2PKVError(Exception):
    """Base class of every error p2pkv raises deliberately."""


class TransportUnavailable(P2PKVError):
    """A transport cannot run here: an optional library is missing or broken, or the machine
    lacks what it needs.

    The message always ends with the fix, so the operator never meets an ``AttributeError``
    or a bare ``ImportError`` later. ``fix`` is the transport's own instruction ("load the
    kernel module ...", "run on Linux"); without one it is ``pip install <package>``.
    ``package`` is the pip requirement that provides the transport's library.
    """

    def __init__(self, transport: str, package: str, cause: str, *, fix: str | None = None) -> None:
        self.transport = transport
        self.package = package
        self.cause = cause
        self.fix = fix if fix is not None else f"Install it with: pip install {package}"
        super().__init__(f"transport {transport!r} is unavailable: {cause}. {self.fix}")


class ConfigError(P2PKVError, ValueError):
    """A tier config, option or environment variable is invalid; the message names the key."""


class UsageError(P2PKVError, ValueError):
    """The engine called the API wrongly (a bad argument, a call in the wrong state); nothing
    was done for that call and the tier goes on."""


class ResourceUnavailable(P2PKVError, RuntimeError):
    """A runtime resource could not be had (memory registration, a port that is busy only
    now, a device); the config itself is valid, so this is not a ``ConfigError``."""


class ProtocolError(P2PKVError, ValueError):
    """A peer sent something the protocol forbids; the session with that peer is closed."""


class FrameTooLarge(P2PKVError, ValueError):
    """One of *our own* frames is over the size cap; it was not sent. The peer did nothing
    wrong (contrast ``ProtocolError``), and the request that built the frame fails."""


class PeerRejected(P2PKVError):
    """A peer is incompatible (region shape, block length, fingerprint, hash seed, wire major)."""


class TransferSubmitError(P2PKVError):
    """A data transfer could not be submitted; nothing was posted for it."""


class TransferBusy(TransferSubmitError):
    """A read could not be posted *now*: a bounded resource it needs (a staging pool shared
    by the peers' reads) is in use by reads in flight. Nothing was posted; the same read may
    succeed once earlier reads ended (after a ``poll``). Back-pressure, never a failure of the
    read: the tier holds it and posts it later, within its load deadline. A caller that does
    not know this class sees a ``TransferSubmitError`` (it derives from it)."""


class ConcurrentCall(P2PKVError, RuntimeError):
    """A second thread called into an object that admits one driver thread at a time while
    the first was still inside; nothing was done for the second call."""


class ConnectionClosed(P2PKVError):
    """``send`` on a control connection that is closed or dead."""


class SendQueueFull(P2PKVError):
    """A control connection's bounded send queue is full; the frame was not queued."""
