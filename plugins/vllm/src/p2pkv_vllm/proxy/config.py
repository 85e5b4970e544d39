"""The proxy's configuration: upstream instances, mode, failure policy, timeouts.

Upstreams come from flags (``URL[,key=value...]`` specs) or a small JSON/TOML file; flags win.
Every rejection is a ``p2pkv.ConfigError`` naming the offending spec, key or file. Pure stdlib:
importable without the ``proxy`` extra.
"""

from __future__ import annotations

import enum
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from typing import Any
from urllib.parse import urlsplit

from p2pkv.config import DEFAULT_PORT
from p2pkv.errors import ConfigError

__all__ = [
    "INSTANCE_OPTIONS",
    "Decoder",
    "Mode",
    "PrefillFailure",
    "Prefiller",
    "PrefixRouting",
    "ProxyConfig",
    "ProxyTimeouts",
    "load_config_file",
    "parse_decoder",
    "parse_prefiller",
]

P2P_PORT_ENV = "VLLM_P2P_SIDE_CHANNEL_PORT"


class Mode(str, enum.Enum):
    """How the two legs of a request are ordered (see docs/proxy.md)."""

    PREFILLER_FIRST = "prefiller-first"
    """Prefill leg (producer), then the decode leg (PD consumer, ``remote_prefiller``)."""
    DECODER_FIRST = "decoder-first"
    """Decode leg started first, prefill leg right after; the decoder's demand waits."""
    SYMMETRIC = "symmetric"
    """Plain prefill, then the decode leg probes the prefiller's cache (``remote_kv_source``)."""


class PrefillFailure(str, enum.Enum):
    """What a failed prefill leg (error status, timeout, unreachable) leads to."""

    RECOMPUTE = "recompute"
    """Run the decode leg without remote KV: the decoder computes the prompt itself."""
    FAIL = "fail"
    """Answer 502 naming the prefiller (a 4xx verdict on the request is relayed as is)."""


@dataclass(frozen=True)
class Prefiller:
    """A prefill instance: its HTTP URL and where its P2P side channel listens.

    DP rank ``r`` of this instance listens on ``p2p_port + r``.
    """

    url: str
    p2p_host: str
    p2p_port: int = DEFAULT_PORT
    dp_size: int = 1
    kv_events: str | None = None
    """vLLM's KV-event PUB endpoint (``tcp://host:port``, DP rank r on ``port + r``)."""
    kv_replay: str | None = None
    """vLLM's KV-event replay ROUTER endpoint, same DP rule."""

    @property
    def p2p_address(self) -> tuple[str, int]:
        """Where DP rank 0's P2P tier listens (rank r: port + r)."""
        return self.p2p_host, self.p2p_port


@dataclass(frozen=True)
class Decoder:
    """A decode instance: its HTTP URL and data-parallel size.

    ``p2p_host``/``p2p_port`` are optional: with them the decoder can be named as a
    ``remote_kv_source`` by prefix-aware routing."""

    url: str
    dp_size: int = 1
    kv_events: str | None = None
    kv_replay: str | None = None
    p2p_host: str | None = None
    p2p_port: int = DEFAULT_PORT

    @property
    def p2p_address(self) -> tuple[str, int] | None:
        return None if self.p2p_host is None else (self.p2p_host, self.p2p_port)


PREFIX_POLICIES = ("prefix-aware", "kv-indexer")
"""Policies that route by cached prefix: from the proxy's own index of the instances' KV
events, or from an external indexer speaking Mooncake RFC #1403's HTTP API."""


@dataclass(frozen=True)
class PrefixRouting:
    """Settings of the prefix policies (``policy = "prefix-aware"`` or ``"kv-indexer"``)."""

    min_cached_tokens_delta: int = 256
    """Name a ``remote_kv_source`` only when its cached prefix is at least this many tokens
    longer than the chosen prefiller's."""
    block_size: int | None = None
    """The instances' KV block size; default: learnt from the first event."""
    max_blocks_per_instance: int = 131_072
    """LRU cap of the in-process index, per instance and DP rank."""
    lookup_timeout: float = 1.0
    """Bound on finding the prompt's tokens and matches; past it the request is routed
    round-robin (logged as ``prefix_lookup: timeout``)."""
    indexer_url: str | None = None
    """Base URL of the external indexer (``kv-indexer`` policy)."""
    indexer_tenant: str = "default"


@dataclass(frozen=True)
class ProxyTimeouts:
    """Seconds. Every upstream wait is bounded by one of these."""

    connect: float = 5.0
    """TCP connect to an upstream."""
    prefill: float = 120.0
    """The whole prefill leg (queueing, prompt compute, response)."""
    decode: float = 1800.0
    """The decode leg until its response starts. A whole request (both legs, every byte) is
    bounded by ``prefill + decode + connect``."""
    idle: float = 300.0
    """Longest silence between two reads of an upstream response."""


@dataclass(frozen=True)
class ProxyConfig:
    prefillers: tuple[Prefiller, ...]
    decoders: tuple[Decoder, ...]
    mode: Mode = Mode.PREFILLER_FIRST
    on_prefill_failure: PrefillFailure = PrefillFailure.RECOMPUTE
    policy: str = "round-robin"
    """Slot selection policy: a built-in name, a prefix policy (``PREFIX_POLICIES``) or
    ``module:factory`` (see ``selection``)."""
    prefix_routing: PrefixRouting = field(default_factory=PrefixRouting)
    timeouts: ProxyTimeouts = field(default_factory=ProxyTimeouts)
    max_connections: int = 1024
    """Pooled upstream connections (all upstreams together)."""
    max_body_bytes: int = 32 * 1024 * 1024
    api_key: str | None = None
    """Sent as ``Authorization: Bearer`` to upstreams when the client sent no auth header."""
    warm_pairs: bool = False
    """At startup, open the P2P session of every pair of instances with one tiny PD
    request each (see ``warm_pairs``), so no user request pays the first-pull setup."""
    warm_pairs_wait: float = 600.0
    """Seconds the warm-up waits in all for the instances to answer ``/health``."""

    def __post_init__(self) -> None:
        if not self.prefillers:
            raise ConfigError(
                "no prefiller configured (--prefiller URL or 'prefillers' in the config file)"
            )
        if not self.decoders:
            raise ConfigError(
                "no decoder configured (--decoder URL or 'decoders' in the config file)"
            )
        if self.max_connections < 1 or self.max_body_bytes < 1:
            raise ConfigError("max_connections and max_body_bytes must be >= 1")
        with_events = [u for u in self.prefillers if u.kv_events] + [
            u for u in self.decoders if u.kv_events
        ]
        if self.policy == "prefix-aware" and not with_events:
            raise ConfigError(
                "policy prefix-aware needs kv_events=tcp://HOST:PORT on at least "
                "one --prefiller or --decoder (vLLM's --kv-events-config endpoint)"
            )
        if self.policy == "kv-indexer" and not (
            self.prefix_routing.indexer_url and self.prefix_routing.block_size
        ):
            raise ConfigError(
                "policy kv-indexer needs prefix_routing.indexer_url and "
                "prefix_routing.block_size (the indexer's /query takes it)"
            )

    @classmethod
    def from_mapping(cls, raw: Mapping[str, Any], *, source: str = "config") -> ProxyConfig:
        """Build from a parsed config file (see docs/proxy.md for the layout)."""
        _only(raw, sorted(f.name for f in fields(cls)), source)
        values: dict[str, Any] = dict(raw)
        values["prefillers"] = tuple(
            _prefiller_from(item, f"{source}: prefillers[{i}]")
            for i, item in enumerate(_list(raw.get("prefillers", []), f"{source}: prefillers"))
        )
        values["decoders"] = tuple(
            _decoder_from(item, f"{source}: decoders[{i}]")
            for i, item in enumerate(_list(raw.get("decoders", []), f"{source}: decoders"))
        )
        if "mode" in raw:
            values["mode"] = _enum(Mode, raw["mode"], f"{source}: mode")
        if "on_prefill_failure" in raw:
            values["on_prefill_failure"] = _enum(
                PrefillFailure, raw["on_prefill_failure"], f"{source}: on_prefill_failure"
            )
        if "timeouts" in raw:
            values["timeouts"] = timeouts_from(raw["timeouts"], f"{source}: timeouts")
        if "prefix_routing" in raw:
            values["prefix_routing"] = prefix_routing_from(
                raw["prefix_routing"], f"{source}: prefix_routing"
            )
        for key in ("max_connections", "max_body_bytes"):
            if key in raw:
                values[key] = _positive_int(raw[key], f"{source}: {key}")
        if "warm_pairs" in raw and not isinstance(raw["warm_pairs"], bool):
            raise ConfigError(
                f"{source}: warm_pairs must be true or false, got {raw['warm_pairs']!r}"
            )
        if "warm_pairs_wait" in raw:
            values["warm_pairs_wait"] = timeouts_from(
                {"connect": raw["warm_pairs_wait"]}, f"{source}: warm_pairs_wait"
            ).connect
        for key in ("policy", "api_key"):
            if key in raw and not isinstance(raw[key], str):
                raise ConfigError(f"{source}: {key} must be a string, got {raw[key]!r}")
        return cls(**values)

    def with_overrides(self, **changes: Any) -> ProxyConfig:
        return replace(self, **{k: v for k, v in changes.items() if v is not None})


def parse_prefiller(spec: str, *, environ: Mapping[str, str] | None = None) -> Prefiller:
    """``URL[,p2p_host=H][,p2p_port=P][,dp_size=N]``.

    ``p2p_host`` defaults to the URL's host, ``p2p_port`` to ``$VLLM_P2P_SIDE_CHANNEL_PORT``
    or 5710 (the tier's own default; a decoder's too), ``dp_size`` to 1.
    """
    url, opts = _split_spec(spec, _PREFILLER_KEYS[1:], "--prefiller")
    return _prefiller_from({"url": url, **opts}, f"--prefiller {spec!r}", environ=environ)


def parse_decoder(spec: str, *, environ: Mapping[str, str] | None = None) -> Decoder:
    """``URL[,dp_size=N][,kv_events=E][,kv_replay=E][,p2p_host=H][,p2p_port=P]``;
    ``p2p_port`` defaults as a prefiller's does."""
    url, opts = _split_spec(spec, _DECODER_KEYS[1:], "--decoder")
    return _decoder_from({"url": url, **opts}, f"--decoder {spec!r}", environ=environ)


def load_config_file(path: str) -> dict[str, Any]:
    """Parse a ``.json`` or ``.toml`` proxy config file into a plain mapping."""
    try:
        with open(path, "rb") as fh:
            data = fh.read()
    except OSError as exc:
        raise ConfigError(f"cannot read proxy config file {path!r}: {exc.strerror}") from None
    try:
        if path.endswith(".toml"):
            import tomllib

            parsed: Any = tomllib.loads(data.decode())
        else:
            parsed = json.loads(data)
    except ConfigError:
        raise
    except (ValueError, UnicodeDecodeError) as exc:
        kind = "TOML" if path.endswith(".toml") else "JSON"
        raise ConfigError(f"{path}: not valid {kind}: {exc}") from None
    if not isinstance(parsed, dict):
        raise ConfigError(f"{path}: the top level must be a table/object")
    return parsed


def timeouts_from(raw: Any, source: str) -> ProxyTimeouts:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must be a table/object")
    _only(raw, sorted(f.name for f in fields(ProxyTimeouts)), source)
    values = {}
    for key, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{source}.{key} must be a number of seconds > 0, got {value!r}")
        values[key] = float(value)
    return ProxyTimeouts(**values)


def prefix_routing_from(raw: Any, source: str) -> PrefixRouting:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must be a table/object")
    _only(raw, sorted(f.name for f in fields(PrefixRouting)), source)
    values: dict[str, Any] = {}
    for key in ("min_cached_tokens_delta", "block_size", "max_blocks_per_instance"):
        if key in raw:
            minimum = 0 if key == "min_cached_tokens_delta" else 1
            values[key] = _int_at_least(raw[key], minimum, f"{source}.{key}")
    if "lookup_timeout" in raw:
        values["lookup_timeout"] = timeouts_from(
            {"connect": raw["lookup_timeout"]}, f"{source}.lookup_timeout"
        ).connect
    if "indexer_url" in raw:
        values["indexer_url"] = _url(raw["indexer_url"], f"{source}.indexer_url")
    if "indexer_tenant" in raw:
        if not isinstance(raw["indexer_tenant"], str):
            raise ConfigError(f"{source}.indexer_tenant must be a string")
        values["indexer_tenant"] = raw["indexer_tenant"]
    return PrefixRouting(**values)


def _split_spec(spec: str, allowed: Sequence[str], flag: str) -> tuple[str, dict[str, str]]:
    url, *rest = (part.strip() for part in spec.split(","))
    opts: dict[str, str] = {}
    for part in rest:
        key, sep, value = part.partition("=")
        if not sep or key not in allowed:
            raise ConfigError(
                f"{flag} {spec!r}: bad option {part!r}; expected URL followed by "
                f"{', '.join(k + '=...' for k in allowed)}"
            )
        opts[key] = value
    return url, opts


def _url(value: Any, source: str) -> str:
    if not isinstance(value, str):
        raise ConfigError(f"{source}: url must be a string, got {value!r}")
    parts = urlsplit(value)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{source}: url {value!r} must look like http://host:port")
    try:
        parts.port  # noqa: B018 - validates the port
    except ValueError:
        raise ConfigError(f"{source}: url {value!r} has an invalid port") from None
    return value.rstrip("/")


def _prefiller_from(
    raw: Any, source: str, *, environ: Mapping[str, str] | None = None
) -> Prefiller:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must be a table/object with at least 'url'")
    _only(raw, _PREFILLER_KEYS, source)
    url = _url(raw.get("url"), source)
    host = raw.get("p2p_host") or urlsplit(url).hostname
    if not isinstance(host, str):
        raise ConfigError(f"{source}: p2p_host must be a string, got {host!r}")
    port = _positive_int(raw.get("p2p_port", _default_port(environ)), f"{source}: p2p_port")
    dp_size = _positive_int(raw.get("dp_size", 1), f"{source}: dp_size")
    if port + dp_size - 1 > 65535:
        raise ConfigError(f"{source}: p2p_port {port} + dp_size {dp_size} exceeds 65535")
    return Prefiller(
        url=url,
        p2p_host=host.strip("[]"),
        p2p_port=port,
        dp_size=dp_size,
        **_kv_event_endpoints(raw, source),
    )


def _default_port(environ: Mapping[str, str] | None) -> Any:
    """An instance's ``p2p_port`` when it gives none: ``$VLLM_P2P_SIDE_CHANNEL_PORT`` (the
    variable vLLM's tier reads; the proxy runs in the engines' environment), else 5710."""
    return (os.environ if environ is None else environ).get(P2P_PORT_ENV) or DEFAULT_PORT


def _decoder_from(raw: Any, source: str, *, environ: Mapping[str, str] | None = None) -> Decoder:
    if not isinstance(raw, Mapping):
        raise ConfigError(f"{source} must be a table/object with at least 'url'")
    _only(raw, _DECODER_KEYS, source)
    host = raw.get("p2p_host")
    if host is not None and not isinstance(host, str):
        raise ConfigError(f"{source}: p2p_host must be a string, got {host!r}")
    return Decoder(
        url=_url(raw.get("url"), source),
        dp_size=_positive_int(raw.get("dp_size", 1), f"{source}: dp_size"),
        p2p_host=host.strip("[]") if host else None,
        p2p_port=_positive_int(raw.get("p2p_port", _default_port(environ)), f"{source}: p2p_port"),
        **_kv_event_endpoints(raw, source),
    )


INSTANCE_OPTIONS = {
    "p2p_host": "host of its P2P tier (prefiller default: the URL's host; a decoder "
    "without one is never named a source)",
    "p2p_port": "the tier's base port, + DP rank (default $VLLM_P2P_SIDE_CHANNEL_PORT, "
    f"else {DEFAULT_PORT})",
    "dp_size": "data-parallel ranks behind the URL (default 1)",
    "kv_events": "tcp://HOST:PORT of the instance's KV-event publisher (prefix routing)",
    "kv_replay": "tcp://HOST:PORT of its replay endpoint (recovers missed KV events)",
}
"""The options after an instance's URL (``--prefiller``/``--decoder URL,OPT=V,...``, or keys
of a config file's instance), one line of help each (``p2pkv proxy --help`` lists them)."""
_PREFILLER_KEYS = ("url", *INSTANCE_OPTIONS)
_DECODER_KEYS = ("url", *INSTANCE_OPTIONS)


def _kv_event_endpoints(raw: Mapping[str, Any], source: str) -> dict[str, str | None]:
    """``kv_events``/``kv_replay``: ``tcp://host:port`` the proxy connects to."""
    out: dict[str, str | None] = {}
    for key in ("kv_events", "kv_replay"):
        value = raw.get(key)
        if value is not None and (
            not isinstance(value, str)
            or not value.startswith("tcp://")
            or "*" in value
            or not value.rpartition(":")[2].isdigit()
        ):
            raise ConfigError(
                f"{source}: {key} {value!r} must be tcp://HOST:PORT (the host "
                "the engine publishes on; the proxy connects)"
            )
        out[key] = value
    return out


def _only(raw: Mapping[str, Any], allowed: Sequence[str], source: str) -> None:
    unknown = sorted(set(raw) - set(allowed))
    if unknown:
        raise ConfigError(f"{source}: unknown key(s) {unknown}; valid: {', '.join(allowed)}")


def _positive_int(value: Any, source: str) -> int:
    return _int_at_least(value, 1, source)


def _int_at_least(value: Any, minimum: int, source: str) -> int:
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            raise ConfigError(f"{source} must be an integer, got {value!r}") from None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(f"{source} must be an integer >= {minimum}, got {value!r}")
    return value


def _list(value: Any, source: str) -> list[Any]:
    if not isinstance(value, list):
        raise ConfigError(f"{source} must be a list")
    return value


def _enum(cls: type[enum.Enum], value: Any, source: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        valid = ", ".join(str(m.value) for m in cls)
        raise ConfigError(f"{source}: {value!r} is not one of {valid}") from None
