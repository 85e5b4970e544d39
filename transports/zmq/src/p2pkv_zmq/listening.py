"""Where a ``zmq`` control transport binds and what it advertises, decided (and refused with
what to change) before any socket exists. Pure Python: never imports zmq."""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import ControlSettings
from p2pkv.errors import ConfigError

from p2pkv_zmq.identity import (
    MAX_LINK_ID_BYTES,
    WILDCARD_HOSTS,
    canonical_host,
    is_ipv6_literal,
)
from p2pkv_zmq.options import ZmqOptions

__all__ = ["ListenPlan", "plan_listener"]


@dataclass(frozen=True)
class ListenPlan:
    """Where to bind and what to advertise, decided before any socket exists."""

    bind_host: str
    """Host to bind, unbracketed (``*`` for every IPv4 interface, ``::`` for every one)."""
    port: int
    advertise_host: str
    advertise_port: int | None
    """None: advertise the bound port."""
    dp_rank: int
    host_setting: str
    """How the operator changes the host (``ControlSettings.host_setting``)."""
    port_setting: str
    """How the operator changes the base port (``ControlSettings.port_setting``)."""

    @property
    def ipv6(self) -> bool:
        return is_ipv6_literal(self.bind_host)


def plan_listener(settings: ControlSettings, options: ZmqOptions) -> ListenPlan:
    """Validate host, port and ``advertise``; ``ConfigError`` names what to change."""
    if not isinstance(settings.max_frame_bytes, int) or settings.max_frame_bytes < 1:
        raise ConfigError(
            f"max_frame_bytes must be a positive integer, got {settings.max_frame_bytes!r}"
        )
    if not 0 <= settings.port < 65536:
        raise ConfigError(f"zmq control port must be 0..65535, got {settings.port}")
    bind_host = canonical_host(settings.host or "*")
    wildcard = bind_host in WILDCARD_HOSTS
    if options.advertise is not None:
        advertise_host, advertise_port = _split_advertise(options.advertise)
    elif wildcard:
        raise ConfigError(
            f"host {settings.host!r} binds every interface, which no peer can dial: set the zmq "
            "control option 'advertise' to the address peers should use (host or host:port)"
        )
    else:
        advertise_host, advertise_port = bind_host, None
    longest = format_address(advertise_host, 65535)
    if len(longest.encode("utf-8")) + 17 > MAX_LINK_ID_BYTES:
        raise ConfigError(f"advertised host {advertise_host!r} is too long for a zmq link id")
    if not advertise_host.isascii():
        raise ConfigError(f"advertised host {advertise_host!r} must be ASCII (use the IDNA form)")
    return ListenPlan(
        bind_host,
        settings.port,
        advertise_host,
        advertise_port,
        settings.dp_rank,
        settings.host_setting,
        settings.port_setting,
    )


def _split_advertise(value: str) -> tuple[str, int | None]:
    try:
        host, port = parse_address(value)
    except ConfigError:
        host, port = value, None  # a bare host (also an unbracketed IPv6 literal)
    host = canonical_host(host)
    if not host or host in WILDCARD_HOSTS:
        raise ConfigError(f"zmq option 'advertise' must name a dialable host, got {value!r}")
    return host, port
