"""``control_options`` of the ``zmq`` transport: names, types, ranges, defaults.

=======================  =========  ==========  ===============================================
option                   type       default     meaning
=======================  =========  ==========  ===============================================
``advertise``            str        (host)      Address peers dial to reach us: ``host`` or
                                                ``host:port`` (``[v6]:port``). Required when
                                                ``host`` is a wildcard (``0.0.0.0``, ``::``,
                                                ``*``); defaults to ``host`` and the bound port.
``insecure``             bool       false       Allow a non-loopback bind without CURVE keys.
                                                Logged as a warning at every start.
``heartbeat_interval``   seconds    2.0         ZMTP PING interval (``ZMQ_HEARTBEAT_IVL``).
``heartbeat_timeout``    seconds    10.0        No traffic this long after a PING: the
                                                connection is dead (``ZMQ_HEARTBEAT_TIMEOUT``).
``handshake_timeout``    seconds    10.0        Bounds every ZMTP handshake, ours and our
                                                listener's (``ZMQ_HANDSHAKE_IVL``), and how
                                                long an inbound connection may take to send a
                                                well-formed first message before it is
                                                closed. Default: the tier's
                                                ``timeouts.handshake``.
``heartbeat_ttl``        seconds    10.0        Tells the peer to drop us after this much
                                                silence (``ZMQ_HEARTBEAT_TTL``; 0.1..6553).
``connect_timeout``      seconds    10.0        A dialed peer that has not completed the
                                                connection handshake by then is dead.
``max_queued_frames``    int        1000        Frames a connection queues before ``send``
                                                raises ``SendQueueFull`` (``ZMQ_SNDHWM``).
``max_sockets``          int        derived     Sockets of the transport's zmq context
                                                (``ZMQ_MAX_SOCKETS``): 3 per session,
                                                dialed or accepted. Default: derived from
                                                the soft ``ulimit -n`` (3 sockets per 5
                                                descriptors, less a reserve of 1/8, at
                                                least 256), within 1023..65535; see
                                                :mod:`p2pkv_zmq.socket_cap`.
``server_secret_key``    key        none        CURVE secret key our listener presents.
``server_public_key``    key        derived     CURVE public key of the listeners we dial
                                                (default: the public half of
                                                ``server_secret_key``, one key per cluster).
``client_secret_key``    key        none        CURVE secret key we present when dialing.
``allowed_client_keys``  list       none        Client public keys allowed to connect: keys,
                                                key files, or directories of ``*.key`` files.
=======================  =========  ==========  ===============================================

A *key* is a 40-character Z85 string or the path of a key file (``p2pkv keys`` writes them;
ZPL certificates from ``zmq.auth`` work too). Giving any CURVE option turns CURVE on and then
``server_secret_key``, ``client_secret_key`` and ``allowed_client_keys`` are all required.
Without any, ``$P2PKV_CURVE_DIR`` (a directory of fleet keys) turns CURVE on.

Pure Python: importing this module never imports zmq.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from p2pkv.options import option, parse_options

__all__ = ["CURVE_DIR_ENV", "CURVE_OPTIONS", "ZmqOptions", "read_options"]

CURVE_DIR_ENV = "P2PKV_CURVE_DIR"
"""Environment variable naming a directory of fleet keys (a mounted Kubernetes ``Secret``,
see :mod:`p2pkv_zmq.security`): CURVE without a key option in the tier entry."""

CURVE_OPTIONS = (
    "server_secret_key",
    "server_public_key",
    "client_secret_key",
    "allowed_client_keys",
)

_SECONDS = option(ge=0.001, unit="seconds")  # libzmq counts milliseconds
_TTL = option(ge=0.1, le=6553, unit="seconds")  # libzmq ignores < 100 ms; 16 bits of ds
_TEXT = option(nonblank=True)


@dataclass(frozen=True)
class ZmqOptions:
    """Validated ``control_options``; key options are still unread text (see ``security``)."""

    advertise: str | None = field(default=None, metadata=_TEXT)
    insecure: bool = False
    heartbeat_interval: float = field(default=2.0, metadata=_SECONDS)
    heartbeat_timeout: float = field(default=10.0, metadata=_SECONDS)
    heartbeat_ttl: float = field(default=10.0, metadata=_TTL)
    handshake_timeout: float = field(default=10.0, metadata=_SECONDS)
    connect_timeout: float = field(default=10.0, metadata=_SECONDS)
    max_queued_frames: int = field(default=1000, metadata=option(ge=1))
    max_sockets: int | None = field(default=None, metadata=option(ge=16, le=65535))
    server_secret_key: str | None = field(default=None, metadata=_TEXT)
    server_public_key: str | None = field(default=None, metadata=_TEXT)
    client_secret_key: str | None = field(default=None, metadata=_TEXT)
    allowed_client_keys: tuple[str, ...] = field(default=(), metadata=_TEXT)

    @property
    def curve_requested(self) -> bool:
        return any(getattr(self, name) for name in CURVE_OPTIONS)


def read_options(options: Mapping[str, Any]) -> ZmqOptions:
    """Validate ``control_options``; ``ConfigError`` names the offending key."""
    return parse_options(ZmqOptions, options, "zmq control option")
