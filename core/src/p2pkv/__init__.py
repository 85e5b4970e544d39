"""p2pkv: move KV-cache blocks peer to peer between LLM-serving instances.

``import p2pkv`` never imports a transport library (zmq, nixl, ucxx); transports arrive as
plugins through the ``p2pkv`` entry-point group.
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from p2pkv.config import Limits, TierConfig, Timeouts
from p2pkv.errors import (
    ConfigError,
    ConnectionClosed,
    P2PKVError,
    PeerRejected,
    ProtocolError,
    SendQueueFull,
    TransferSubmitError,
    TransportUnavailable,
)
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext

try:
    __version__ = version("p2pkv")
except PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [
    "ConfigError",
    "ConnectionClosed",
    "Job",
    "JobResult",
    "Limits",
    "LookupResult",
    "Outcome",
    "P2PKVError",
    "PeerRejected",
    "ProtocolError",
    "RequestContext",
    "SendQueueFull",
    "TierConfig",
    "Timeouts",
    "TransferSubmitError",
    "TransportUnavailable",
    "__version__",
]
