"""p2pkv: move KV-cache blocks peer to peer between LLM-serving instances.

The public API is this namespace: ``from p2pkv import P2PTier, TierConfig, DataTransport``.
Its names are in ``__all__``, and ``core/tests/test_public_api.py`` pins them. Three
packages are public beside it: the conformance kit (:mod:`p2pkv.testing`), the reference
backend (:mod:`p2pkv.reference`) and the hook specifications (:mod:`p2pkv.hookspecs`). Every
other module is internal, and its names may change in any release (docs/api.md).

Names load on first use, so ``import p2pkv`` stays light. It never imports a transport
library (zmq, nixl, ucxx): transports arrive as plugins through the ``p2pkv`` entry-point
group.
"""

import importlib as _importlib
import importlib.metadata as _metadata
import typing as _typing

if _typing.TYPE_CHECKING:  # the same names as _SOURCES (a test holds the two equal)
    from p2pkv.addressing import format_address as format_address
    from p2pkv.addressing import parse_address as parse_address
    from p2pkv.config import Flow as Flow
    from p2pkv.config import Limits as Limits
    from p2pkv.config import Peers as Peers
    from p2pkv.config import TierConfig as TierConfig
    from p2pkv.config import Timeouts as Timeouts
    from p2pkv.contracts import DRAIN_GRACE as DRAIN_GRACE
    from p2pkv.contracts import DRIVER_BOUND as DRIVER_BOUND
    from p2pkv.contracts import EMPTY_POLL as EMPTY_POLL
    from p2pkv.contracts import Capabilities as Capabilities
    from p2pkv.contracts import ControlConnection as ControlConnection
    from p2pkv.contracts import ControlSettings as ControlSettings
    from p2pkv.contracts import ControlTransport as ControlTransport
    from p2pkv.contracts import DataBackend as DataBackend
    from p2pkv.contracts import DataSettings as DataSettings
    from p2pkv.contracts import DataTransport as DataTransport
    from p2pkv.contracts import PollResult as PollResult
    from p2pkv.contracts import TransportKind as TransportKind
    from p2pkv.control_base import OVERSIZED as OVERSIZED
    from p2pkv.control_base import InboxConnection as InboxConnection
    from p2pkv.control_base import InboxControlTransport as InboxControlTransport
    from p2pkv.data_base import AttachedPeer as AttachedPeer
    from p2pkv.data_base import Indexes as Indexes
    from p2pkv.data_base import ReadState as ReadState
    from p2pkv.data_base import check_read as check_read
    from p2pkv.errors import ConcurrentCall as ConcurrentCall
    from p2pkv.errors import ConfigError as ConfigError
    from p2pkv.errors import ConnectionClosed as ConnectionClosed
    from p2pkv.errors import FrameTooLarge as FrameTooLarge
    from p2pkv.errors import P2PKVError as P2PKVError
    from p2pkv.errors import PeerRejected as PeerRejected
    from p2pkv.errors import ProtocolError as ProtocolError
    from p2pkv.errors import ResourceUnavailable as ResourceUnavailable
    from p2pkv.errors import SendQueueFull as SendQueueFull
    from p2pkv.errors import TransferBusy as TransferBusy
    from p2pkv.errors import TransferSubmitError as TransferSubmitError
    from p2pkv.errors import TransportUnavailable as TransportUnavailable
    from p2pkv.errors import UsageError as UsageError
    from p2pkv.hookspecs import PLUGIN_API_VERSION as PLUGIN_API_VERSION
    from p2pkv.hookspecs import CheckResult as CheckResult
    from p2pkv.hookspecs import DoctorCheck as DoctorCheck
    from p2pkv.hookspecs import hookimpl as hookimpl
    from p2pkv.options import option as option
    from p2pkv.options import parse_options as parse_options
    from p2pkv.tier import P2PTier as P2PTier
    from p2pkv.types import Job as Job
    from p2pkv.types import JobResult as JobResult
    from p2pkv.types import LocalHitSource as LocalHitSource
    from p2pkv.types import LookupResult as LookupResult
    from p2pkv.types import Outcome as Outcome
    from p2pkv.types import RequestContext as RequestContext

_SOURCES: dict[str, tuple[str, ...]] = {
    # what an engine adapter drives
    "p2pkv.tier": ("P2PTier",),
    "p2pkv.types": (
        "Job",
        "JobResult",
        "LocalHitSource",
        "LookupResult",
        "Outcome",
        "RequestContext",
    ),
    "p2pkv.config": ("Flow", "Limits", "Peers", "TierConfig", "Timeouts"),
    "p2pkv.errors": (
        "ConcurrentCall",
        "ConfigError",
        "ConnectionClosed",
        "FrameTooLarge",
        "P2PKVError",
        "PeerRejected",
        "ProtocolError",
        "ResourceUnavailable",
        "SendQueueFull",
        "TransferBusy",
        "TransferSubmitError",
        "TransportUnavailable",
        "UsageError",
    ),
    # what a transport plugin implements, and the bases it builds on
    "p2pkv.contracts": (
        "DRAIN_GRACE",
        "DRIVER_BOUND",
        "EMPTY_POLL",
        "Capabilities",
        "ControlConnection",
        "ControlSettings",
        "ControlTransport",
        "DataBackend",
        "DataSettings",
        "DataTransport",
        "PollResult",
        "TransportKind",
    ),
    "p2pkv.control_base": ("OVERSIZED", "InboxConnection", "InboxControlTransport"),
    "p2pkv.data_base": ("AttachedPeer", "Indexes", "ReadState", "check_read"),
    "p2pkv.options": ("option", "parse_options"),
    "p2pkv.addressing": ("format_address", "parse_address"),
    "p2pkv.hookspecs": ("PLUGIN_API_VERSION", "CheckResult", "DoctorCheck", "hookimpl"),
}
"""Module -> the public names it defines. The modules themselves are internal."""

_MODULE_OF = {name: module for module, names in _SOURCES.items() for name in names}

try:
    __version__ = _metadata.version("p2pkv")
except _metadata.PackageNotFoundError:  # pragma: no cover - running from a source tree
    __version__ = "0.0.0"

__all__ = [  # _SOURCES' names (a test holds the two equal)
    "DRAIN_GRACE",
    "DRIVER_BOUND",
    "EMPTY_POLL",
    "OVERSIZED",
    "PLUGIN_API_VERSION",
    "AttachedPeer",
    "Capabilities",
    "CheckResult",
    "ConcurrentCall",
    "ConfigError",
    "ConnectionClosed",
    "ControlConnection",
    "ControlSettings",
    "ControlTransport",
    "DataBackend",
    "DataSettings",
    "DataTransport",
    "DoctorCheck",
    "Flow",
    "FrameTooLarge",
    "InboxConnection",
    "InboxControlTransport",
    "Indexes",
    "Job",
    "JobResult",
    "Limits",
    "LocalHitSource",
    "LookupResult",
    "Outcome",
    "P2PKVError",
    "P2PTier",
    "PeerRejected",
    "Peers",
    "PollResult",
    "ProtocolError",
    "ReadState",
    "RequestContext",
    "ResourceUnavailable",
    "SendQueueFull",
    "TierConfig",
    "Timeouts",
    "TransferBusy",
    "TransferSubmitError",
    "TransportKind",
    "TransportUnavailable",
    "UsageError",
    "__version__",
    "check_read",
    "format_address",
    "hookimpl",
    "option",
    "parse_address",
    "parse_options",
]


def __getattr__(name: str) -> _typing.Any:
    """Import a public name's module on first use (``import p2pkv`` stays light)."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'p2pkv' has no attribute {name!r}")
    value = getattr(_importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF})
