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

Pure Python: importing this module never imports zmq.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

from p2pkv.errors import ConfigError

__all__ = ["CURVE_OPTIONS", "ZmqOptions", "read_options"]

CURVE_OPTIONS = (
    "server_secret_key",
    "server_public_key",
    "client_secret_key",
    "allowed_client_keys",
)

_MIN_TTL = 0.1  # libzmq ignores a TTL below 100 ms
_MAX_TTL = 6553.0  # deciseconds in 16 bits


@dataclass(frozen=True)
class ZmqOptions:
    """Validated ``control_options``; key options are still unread text (see ``security``)."""

    advertise: str | None = None
    insecure: bool = False
    heartbeat_interval: float = 2.0
    heartbeat_timeout: float = 10.0
    heartbeat_ttl: float = 10.0
    handshake_timeout: float = 10.0
    connect_timeout: float = 10.0
    max_queued_frames: int = 1000
    server_secret_key: str | None = None
    server_public_key: str | None = None
    client_secret_key: str | None = None
    allowed_client_keys: tuple[str, ...] = ()

    @property
    def curve_requested(self) -> bool:
        return any(getattr(self, name) for name in CURVE_OPTIONS)


_SECONDS = ("heartbeat_interval", "heartbeat_timeout", "heartbeat_ttl", "handshake_timeout",
            "connect_timeout")
_STRINGS = ("advertise", "server_secret_key", "server_public_key", "client_secret_key")


def read_options(options: Mapping[str, Any]) -> ZmqOptions:
    """Validate ``control_options``; ``ConfigError`` names the offending key."""
    known = [f.name for f in fields(ZmqOptions)]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ConfigError(f"unknown zmq control option(s) {unknown}; valid: {', '.join(known)}")
    values: dict[str, Any] = {}
    for key, value in options.items():
        if key in _SECONDS:
            values[key] = _seconds(key, value)
        elif key in _STRINGS:
            values[key] = _text(key, value)
        elif key == "insecure":
            if not isinstance(value, bool):
                raise ConfigError(f"zmq option 'insecure' must be true or false, got {value!r}")
            values[key] = value
        elif key == "max_queued_frames":
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(
                    f"zmq option 'max_queued_frames' must be an integer >= 1, got {value!r}"
                )
            values[key] = value
        else:  # allowed_client_keys
            values[key] = _text_list(key, value)
    opts = ZmqOptions(**values)
    if not _MIN_TTL <= opts.heartbeat_ttl <= _MAX_TTL:
        raise ConfigError(
            f"zmq option 'heartbeat_ttl' must be within {_MIN_TTL}..{_MAX_TTL} s, "
            f"got {opts.heartbeat_ttl!r}"
        )
    return opts


def _seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(f"zmq option {key!r} must be a number of seconds > 0, got {value!r}")
    if value * 1000 < 1:
        raise ConfigError(f"zmq option {key!r} must be at least 0.001 s, got {value!r}")
    return float(value)


def _text(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"zmq option {key!r} must be a non-empty string")
    return value.strip()


def _text_list(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str) or not isinstance(value, Sequence) or not value:
        raise ConfigError(f"zmq option {key!r} must be a non-empty list of keys or key files")
    return tuple(_text(f"{key}[{i}]", item) for i, item in enumerate(value))
