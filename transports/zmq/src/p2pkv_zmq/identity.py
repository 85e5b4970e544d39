"""Peer addresses, ``tcp://`` URLs and the link ids our dialing sockets present.

A peer is known by one canonical ``host:port`` string (host lower-cased, IPv6 literals
compressed and bracketed), so ``[0:0::1]:5710`` and ``[::1]:5710`` are one peer. Every dialing
socket has the link id ``<canonical address>#<incarnation>``, sent as the first frame of each
message (the listener is a PULL socket, which does not say who sent a message): the address is
exactly what others dial to reach its owner, and the incarnation (16 random hex digits, 64
bits, new for every dialing socket) tells a restarted peer, or a re-dialed connection, from
the old one. Incarnations are the only secret of the link protocol: a ``paired`` or ``gone``
naming one is obeyed from any sender (see :mod:`p2pkv_zmq.hub`).

Pure Python: importing this module never imports zmq.
"""

from __future__ import annotations

import ipaddress
import secrets

from p2pkv.addressing import format_address, parse_address
from p2pkv.errors import ConfigError

__all__ = [
    "MAX_LINK_ID_BYTES",
    "WILDCARD_HOSTS",
    "canonical_address",
    "canonical_host",
    "is_ipv6_literal",
    "link_id",
    "new_incarnation",
    "parse_link_id",
    "tcp_url",
]

MAX_LINK_ID_BYTES = 255
"""The longest link id we send or accept (longer first frames are refused unparsed)."""

WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::"})
"""Hosts that bind every interface; nobody can dial them, so they need ``advertise``."""

_INCARNATION_HEX = 16
_SEPARATOR = b"#"


def canonical_host(host: str) -> str:
    """``host`` without brackets, lower-cased; IPv6 literals in compressed form."""
    host = host.strip().strip("[]").lower()
    if ":" in host:
        try:
            return ipaddress.IPv6Address(host).compressed
        except ValueError:
            raise ConfigError(f"malformed IPv6 host {host!r}") from None
    return host


def canonical_address(address: str) -> str:
    """The one spelling of ``address`` (``host:port`` or ``[v6]:port``) used as a peer's key.

    Raises ``ConfigError`` naming the address when it is malformed.
    """
    host, port = parse_address(address.strip())
    return format_address(canonical_host(host), port)


def is_ipv6_literal(host: str) -> bool:
    return ":" in host


def tcp_url(host: str, port: int | str) -> str:
    """``tcp://host:port`` with an IPv6 literal bracketed (``tcp://[::1]:5710``)."""
    host = host.strip("[]")
    if is_ipv6_literal(host):
        return f"tcp://[{host}]:{port}"
    return f"tcp://{host}:{port}"


def new_incarnation() -> bytes:
    return secrets.token_hex(_INCARNATION_HEX // 2).encode("ascii")


def link_id(address: str, incarnation: bytes) -> bytes:
    return address.encode("ascii") + _SEPARATOR + incarnation


def parse_link_id(lid: bytes) -> tuple[str, bytes] | None:
    """``(canonical address, incarnation)`` of a link id, or None if it is not one of ours.

    Only canonical addresses are accepted, so one peer can never appear under two spellings.
    """
    if len(lid) > MAX_LINK_ID_BYTES:
        return None
    address_part, sep, incarnation = lid.rpartition(_SEPARATOR)
    if not sep or len(incarnation) != _INCARNATION_HEX:
        return None
    if incarnation.strip(b"0123456789abcdef"):
        return None
    try:
        address = address_part.decode("ascii")
        if canonical_address(address) != address:
            return None
    except ValueError:  # ConfigError and UnicodeDecodeError are ValueErrors
        return None
    return address, incarnation
