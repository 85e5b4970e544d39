"""``host:port`` addresses, with IPv6 hosts in brackets (``[::1]:5710``)."""

from __future__ import annotations

import ipaddress

from p2pkv.errors import ConfigError

_LOOPBACK_NAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost"})


def format_address(host: str, port: int) -> str:
    """``host:port``; an IPv6 literal is bracketed."""
    host = host.strip("[]")
    if ":" in host:
        return f"[{host}]:{port}"
    return f"{host}:{port}"


def parse_address(address: str) -> tuple[str, int]:
    """Split ``host:port`` or ``[v6]:port``; the host comes back without brackets.

    Raises ``ConfigError`` naming the address when it is malformed or the port is out of range.
    """
    if address.startswith("["):
        host, sep, rest = address[1:].partition("]")
        if not sep or not rest.startswith(":"):
            raise ConfigError(f"malformed address {address!r}: expected [ipv6]:port")
        port_text = rest[1:]
    else:
        host, sep, port_text = address.rpartition(":")
        if not sep or ":" in host:
            raise ConfigError(f"malformed address {address!r}: expected host:port or [ipv6]:port")
    if not host:
        raise ConfigError(f"malformed address {address!r}: empty host")
    try:
        port = int(port_text)
    except ValueError:
        raise ConfigError(f"malformed address {address!r}: port is not an integer") from None
    if not 0 < port < 65536:
        raise ConfigError(f"malformed address {address!r}: port must be 1..65535")
    return host, port


def is_loopback_host(host: str) -> bool:
    """True for loopback names and addresses (127.0.0.0/8, ::1, localhost)."""
    host = host.strip("[]").lower()
    if host in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
