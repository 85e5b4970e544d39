"""The ``zmq`` control transport as the registry sees it: name, capabilities, availability,
and ``create`` (options, address and security policy, then the sockets).

Importing this module never imports zmq: ``create`` does, and returns a
:class:`p2pkv_zmq.hub.ZmqHub` (a subclass of :class:`ZmqControlTransport`) that owns the
sockets. Options are listed in :mod:`p2pkv_zmq.options`.

Model (what callers and tests rely on):

- Addresses are ``host:port`` / ``[v6]:port``. ``local_address`` is the advertised address
  (``advertise`` option, else ``host``) with the bound port; it is the identity we present,
  so peers must dial exactly it. Wildcard hosts need ``advertise``.
- One PULL socket listens; every connection dials the peer with its own PUSH socket, whose
  messages start with its link id ``<our address>#<incarnation>``. Frames go out on our PUSH
  and come in on our PULL, so each direction is one TCP stream and frames arrive in order,
  each once. No socket of ours files peers under ids they choose (no ROUTER).
- An inbound peer is accepted on its first frame and returned once by ``poll`` with that frame
  buffered. Two peers dialing each other at once end up with one connection on each side.
- ``send`` never blocks: ``max_queued_frames`` per connection, then ``SendQueueFull``.
- Liveness: ZMTP heartbeats on every dialing socket (the listener only answers them and
  drops an inbound link silent past the peer's TTL); a disconnect, a refused dial, a failed
  handshake or none within ``handshake_timeout``, no connection within ``connect_timeout``,
  or the peer closing its end makes ``alive`` False on our next ``poll``, and
  ``ZmqConnection.close_reason`` says which. An unresolvable host, or an address whose dial
  failed within the last second, is dead at ``connect``. A restarted peer or a re-dialed
  connection is a fresh connection, never a continuation of the old one.
- Listener: connections that are not p2pkv peers (stray bytes, a cut handshake, no
  well-formed first message within ``handshake_timeout``) are closed.
- Threading: no threads of our own; every socket is used only by the thread calling the
  transport (one at a time, as the contracts require). libzmq's I/O thread does the network
  work, so heartbeats are answered even between polls. A CURVE handshake waits for our next
  ``poll`` (the ZAP allow-list check runs there).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import Capabilities, ControlSettings, ControlTransport
from p2pkv.errors import ConfigError, TransportUnavailable

from p2pkv_zmq.identity import (
    MAX_LINK_ID_BYTES,
    WILDCARD_HOSTS,
    canonical_host,
    is_ipv6_literal,
)
from p2pkv_zmq.options import ZmqOptions

__all__ = ["DISTRIBUTION", "ListenPlan", "ZmqControlTransport", "plan_listener"]

DISTRIBUTION = "p2pkv-zmq"
_MIN_LIBZMQ = (4, 3, 0)  # stable handshake events and heartbeats


class ZmqControlTransport(ControlTransport):
    """ZeroMQ control transport (``control: zmq``). Build it with :meth:`create`."""

    name: ClassVar[str] = "zmq"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True, cross_host=True, auth=True, heartbeats=True
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        try:
            import zmq
        except ImportError as exc:
            return TransportUnavailable(
                cls.name, DISTRIBUTION, f"pyzmq is not importable ({type(exc).__name__}: {exc})"
            )
        if zmq.zmq_version_info() < _MIN_LIBZMQ:
            return TransportUnavailable(
                cls.name,
                DISTRIBUTION,
                f"pyzmq is linked against libzmq {zmq.zmq_version()}; 4.3 or newer is needed",
            )
        return None

    @classmethod
    def create(cls, settings: ControlSettings) -> ControlTransport:
        problem = cls.availability()
        if problem is not None:
            raise problem
        import zmq

        from p2pkv_zmq.hub import ZmqHub
        from p2pkv_zmq.options import read_options
        from p2pkv_zmq.security import curve_keys

        options = read_options({"handshake_timeout": settings.handshake_timeout,
                                **settings.options})
        plan = plan_listener(settings, options)
        keys = curve_keys(plan.bind_host, options, curve_supported=bool(zmq.has("curve")))
        return ZmqHub.open(plan, options, keys, settings.max_frame_bytes)


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
    return ListenPlan(bind_host, settings.port, advertise_host, advertise_port, settings.dp_rank,
                      settings.host_setting, settings.port_setting)


def _split_advertise(value: str) -> tuple[str, int | None]:
    try:
        host, port = parse_address(value)
    except ConfigError:
        host, port = value, None  # a bare host (also an unbracketed IPv6 literal)
    host = canonical_host(host)
    if not host or host in WILDCARD_HOSTS:
        raise ConfigError(f"zmq option 'advertise' must name a dialable host, got {value!r}")
    return host, port
