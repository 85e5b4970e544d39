"""``TierConfig``: a tier config dict, environment defaults and the data-parallel port offset.

Precedence for ``host`` and ``port``: explicit key > environment variable > built-in default.
The bound port is ``base port + dp_rank``. Every rejection is a ``ConfigError`` that names the
key and what would be valid.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from p2pkv.addressing import format_address
from p2pkv.errors import ConfigError

__all__ = [
    "DEFAULT_HOST",
    "DEFAULT_PORT",
    "Limits",
    "TierConfig",
    "Timeouts",
    "config_fingerprint",
]

DEFAULT_HOST = "localhost"
DEFAULT_PORT = 5710
HOST_ENV = ("P2PKV_HOST",)
PORT_ENV = ("P2PKV_PORT",)


@dataclass(frozen=True)
class Timeouts:
    """Deadlines in seconds. Every wait in the tier is bounded by one of these."""

    handshake: float = 10.0
    """A connected peer must complete the hello exchange within this."""
    load: float = 30.0
    """A load whose blocks have not all arrived by then fails ``load_timeout`` (its reads are
    cancelled first, finally: the slots are free again the moment the result is out)."""
    lease_margin: float = 10.0
    """The producer pins a round's source blocks for the lease, ``load + lease_margin``, from
    each ``ready`` (or until the consumer's ``release``). The consumer accepts a read only if
    it completed within the lease of the moment it *sent* the fetch, on its own clock; with
    the lease above ``load`` that rejects only a consumer that was itself paused past it."""
    store: float = 30.0
    """A store bound to a consumer but not finished by then fails."""
    unbound_store: float = 60.0
    """A store whose consumer never asked for it fails after this."""
    lookup: float = 5.0
    """A producer answers MISS for lookups its hit source has not settled by then."""
    shutdown_drain: float = 5.0
    """Shutdown waits this long for sessions to wind down (consumers' releases, internal
    transfers of the data transport) before closing them anyway."""

    @property
    def lease(self) -> float:
        """How long a ``ready`` pins the producer's source blocks (``load + lease_margin``)."""
        return self.load + self.lease_margin


@dataclass(frozen=True)
class Limits:
    """Caps on what a peer may send; exceeding one is a protocol error."""

    max_frame_bytes: int = 64 * 1024 * 1024
    """Largest control frame accepted or sent."""
    max_keys_per_message: int = 65536
    """Most keys (blocks) in one fetch, lookup or lookup response."""
    max_key_bytes: int = 1024
    """Longest block key."""
    max_request_id_chars: int = 256
    """Longest ``kv_request_id``."""
    max_descriptor_bytes: int = 16 * 1024 * 1024
    """Largest data-transport descriptor in a hello."""
    max_consecutive_internal_errors: int = 5
    """Internal errors in a row while handling one peer's messages before its session is closed."""


_TOP_KEYS = (
    "type",
    "control",
    "data",
    "host",
    "port",
    "control_options",
    "data_options",
    "timeouts",
    "limits",
    "fingerprint",
    "hash_seed",
)


def _setting(key: str, source: str, env_names: Sequence[str]) -> str:
    """How to change ``key`` given where its value came from (``source``)."""
    if source.startswith("environment variable"):
        return f"the {source} (it set this {key}; the tier config key {key!r} overrides it)"
    if source == "default":
        return f"the tier config key {key!r} or the environment variable {env_names[0]}"
    return f"the tier config key {key!r}"


@dataclass(frozen=True)
class TierConfig:
    """A validated tier config. Build it with :meth:`from_dict`."""

    control: str = "zmq"
    """Control transport name (``p2pkv plugins`` lists what is installed)."""
    data: str = "nixl"
    """Data transport name."""
    host: str = DEFAULT_HOST
    """Host to bind and advertise; env ``P2PKV_HOST``. Non-loopback needs authentication."""
    base_port: int = DEFAULT_PORT
    """Base control port (key ``port``; env ``P2PKV_PORT``); the bound port adds ``dp_rank``.
    0 = ephemeral."""
    dp_rank: int = 0
    """Data-parallel rank (given by the engine, not a config key)."""
    control_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of the control transport (see Transports)."""
    data_options: Mapping[str, Any] = field(default_factory=dict)
    """Options of the data transport (see Transports)."""
    timeouts: Timeouts = field(default_factory=Timeouts)
    """Deadlines, below."""
    limits: Limits = field(default_factory=Limits)
    """Caps on what peers may send, below."""
    fingerprint: str = ""
    """Model/run fingerprint; peers with different non-empty fingerprints are rejected."""
    hash_seed: str = ""
    """Block-hash seed; peers with a different seed are rejected at handshake."""
    host_setting: str = _setting("host", "default", HOST_ENV)
    """How an operator changes ``host`` here (derived, not a key): the variable in force."""
    port_setting: str = _setting("port", "default", PORT_ENV)
    """How an operator changes the base port here (derived, not a key): under vLLM it names
    ``VLLM_P2P_SIDE_CHANNEL_PORT``, which overrides ``P2PKV_PORT``."""

    @property
    def port(self) -> int:
        """The port this tier binds: base port + data-parallel rank (0 stays 0: ephemeral)."""
        return self.base_port + self.dp_rank if self.base_port else 0

    @property
    def address(self) -> str:
        return format_address(self.host, self.port)

    @classmethod
    def from_dict(
        cls,
        d: Mapping[str, Any] | None = None,
        *,
        dp_rank: int = 0,
        environ: Mapping[str, str] | None = None,
        host_env: Sequence[str] = HOST_ENV,
        port_env: Sequence[str] = PORT_ENV,
    ) -> TierConfig:
        """Validate a tier config dict.

        ``host_env``/``port_env`` name the environment variables consulted, first match wins
        (engine adapters put their own names first). ``environ`` defaults to ``os.environ``.
        """
        d = dict(d or {})
        env = os.environ if environ is None else environ
        unknown = sorted(set(d) - set(_TOP_KEYS))
        if unknown:
            raise ConfigError(
                f"unknown tier config key(s) {unknown}; valid keys: {', '.join(_TOP_KEYS)}"
            )
        if "type" in d and not isinstance(d["type"], str):
            raise ConfigError("tier config key 'type' must be a string")
        control = _str(d, "control", "zmq")
        data = _str(d, "data", "nixl")
        if "host" in d:
            host, host_source = _str(d, "host", ""), "key 'host'"
        else:
            host, host_source = _from_env(env, host_env, DEFAULT_HOST)
        if not host:
            raise ConfigError(f"{host_source}: host must not be empty")
        if "port" in d:
            base_port = d["port"]
            port_source = "key 'port'"
            if isinstance(base_port, bool) or not isinstance(base_port, int):
                raise ConfigError(f"tier config key 'port' must be an integer, got {base_port!r}")
        else:
            text, port_source = _from_env(env, port_env, str(DEFAULT_PORT))
            try:
                base_port = int(text)
            except ValueError:
                raise ConfigError(f"{port_source}: port must be an integer, got {text!r}") from None
        if isinstance(dp_rank, bool) or not isinstance(dp_rank, int) or dp_rank < 0:
            raise ConfigError(f"dp_rank must be a non-negative integer, got {dp_rank!r}")
        if base_port != 0 and not 0 < base_port + dp_rank < 65536:
            raise ConfigError(
                f"{port_source}: port {base_port} + data-parallel rank {dp_rank} = "
                f"{base_port + dp_rank} is outside 1..65535"
            )
        if base_port < 0:
            raise ConfigError(f"{port_source}: port must be >= 0 (0 = ephemeral)")
        return cls(
            control=control,
            data=data,
            host=host,
            base_port=base_port,
            dp_rank=dp_rank,
            control_options=_mapping(d, "control_options"),
            data_options=_mapping(d, "data_options"),
            timeouts=_dataclass_from(Timeouts, d.get("timeouts"), "timeouts"),
            limits=_dataclass_from(Limits, d.get("limits"), "limits"),
            fingerprint=_str(d, "fingerprint", ""),
            hash_seed=_str(d, "hash_seed", ""),
            host_setting=_setting("host", host_source, host_env),
            port_setting=_setting("port", port_source, port_env),
        )



def config_fingerprint(fields_: Mapping[str, Any]) -> str:
    """16 hex chars identifying a model/run config; empty fields give "" (matches anyone)."""
    if not fields_:
        return ""
    blob = json.dumps(dict(fields_), sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _from_env(env: Mapping[str, str], names: Sequence[str], default: str) -> tuple[str, str]:
    for name in names:
        value = env.get(name)
        if value not in (None, ""):
            return str(value), f"environment variable {name}"
    return default, "default"


def _str(d: Mapping[str, Any], key: str, default: str) -> str:
    value = d.get(key, default)
    if not isinstance(value, str):
        raise ConfigError(f"tier config key {key!r} must be a string, got {value!r}")
    return value


def _mapping(d: Mapping[str, Any], key: str) -> Mapping[str, Any]:
    value = d.get(key, {})
    if not isinstance(value, Mapping):
        raise ConfigError(f"tier config key {key!r} must be a mapping, got {type(value).__name__}")
    return dict(value)


def _dataclass_from(cls: Any, raw: Any, key: str) -> Any:
    if raw is None:
        return cls()
    if not isinstance(raw, Mapping):
        raise ConfigError(f"tier config key {key!r} must be a mapping")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ConfigError(f"unknown {key} key(s) {unknown}; valid: {', '.join(known)}")
    values: dict[str, Any] = {}
    for name, value in raw.items():
        default = getattr(cls(), name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}.{name} must be a number, got {value!r}")
        if value <= 0:
            raise ConfigError(f"{key}.{name} must be > 0, got {value!r}")
        if isinstance(default, int) and not isinstance(value, int):
            raise ConfigError(f"{key}.{name} must be an integer, got {value!r}")
        values[name] = type(default)(value)
    return cls(**values)
