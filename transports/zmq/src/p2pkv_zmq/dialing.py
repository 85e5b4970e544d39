"""Dials that cannot work fail fast, and say why.

- :func:`resolve`: the address a dial hands libzmq. A host name is resolved once per dial, in
  the calling thread, with ``getaddrinfo`` (IPv4, as libzmq resolves host names with
  ``ZMQ_IPV6`` off); given the name, libzmq would resolve it again in its I/O thread at every
  reconnect attempt, stalling every socket's heartbeats while the resolver waits, and a name
  that does not resolve would look like a peer that never answers.
- :class:`DialFailures`: the negative cache. A dial that died before its handshake completed
  (refused, no such host, a failed or stalled handshake, ``connect_timeout``) is remembered
  for :data:`DIAL_BACKOFF` seconds; a new dial to that address meanwhile is answered at once
  with a dead connection carrying the reason, instead of waiting again.
- The ``*_reason`` functions word why a dial died, for ``ZmqConnection.close_reason`` and the
  log: what failed, at which address, and what to check.

Threading: used only from the hub's driver thread.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from collections import OrderedDict

import zmq

__all__ = [
    "DIAL_BACKOFF",
    "DialFailed",
    "DialFailures",
    "handshake_reason",
    "protocol_failure",
    "refused_reason",
    "resolve",
]

DIAL_BACKOFF = 1.0
"""Seconds a failed dial is remembered: dials to that address meanwhile fail at once."""

_MEMORY = 4096  # addresses remembered at most (oldest forgotten)
_NO_SUCH_HOST = {socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)}
_TIMED_OUT = {errno.EAGAIN, errno.ETIMEDOUT}  # libzmq's errno when ZMQ_HANDSHAKE_IVL fires


class DialFailed(Exception):
    """A dial that cannot start; ``str()`` is the reason."""


def resolve(host: str) -> str:
    """``host`` unchanged if it is an IP literal, else its first IPv4 address. Blocks for the
    system resolver (``/etc/hosts``, DNS). Raises :class:`DialFailed` naming the host."""
    try:
        ipaddress.ip_address(host)
    except ValueError:
        pass
    else:
        return host
    try:
        found = socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM)
    except socket.gaierror as exc:
        if exc.errno in _NO_SUCH_HOST:
            raise DialFailed(f"no such host {host!r} (DNS: {exc.strerror})") from None
        raise DialFailed(f"cannot resolve host {host!r} (DNS: {exc.strerror})") from None
    except UnicodeError:
        raise DialFailed(f"no such host {host!r} (not a valid host name)") from None
    return str(found[0][4][0])


class DialFailures:
    """Addresses whose last dial failed less than :data:`DIAL_BACKOFF` seconds ago, with the
    reason (bounded: the oldest are forgotten first)."""

    def __init__(self) -> None:
        self._failed: OrderedDict[str, tuple[float, str]] = OrderedDict()

    def record(self, key: str, reason: str, now: float) -> None:
        self._failed.pop(key, None)
        self._failed[key] = (now, reason)
        while len(self._failed) > _MEMORY:
            self._failed.popitem(last=False)

    def forget(self, key: str) -> None:
        """The next dial to ``key`` is a real one, whatever failed before."""
        self._failed.pop(key, None)

    def recent(self, key: str, now: float) -> str | None:
        """The reason a dial to ``key`` failed within the backoff, said as such, or None."""
        entry = self._failed.get(key)
        if entry is None:
            return None
        when, reason = entry
        if now - when >= DIAL_BACKOFF:
            del self._failed[key]
            return None
        return (
            f"{reason} (remembered from the dial {round((now - when) * 1000)} ms ago: a "
            f"failed address is dialed again after {DIAL_BACKOFF:g} s)"
        )


def refused_reason(key: str, *, dialed_us: bool) -> str:
    if dialed_us:
        return f"connection refused: the peer that dialed us no longer listens at {key}"
    return (
        f"connection refused: nothing accepts TCP connections at {key} (nothing listens "
        "there, or no route to it)"
    )


FOREIGN_PEER = (
    "vLLM's built-in P2P tier (the same 'p2p' entry without "
    "P2PKV_REPLACE_P2P=1) is such a peer; see 'Mixed fleets' in docs/vllm.md"
)
"""What a zmq peer that libzmq refuses for its socket type most likely is, in a fleet."""


def foreign_listener_reason(key: str) -> str:
    """Why our dial to ``key`` ended in its ZMTP handshake with no failure named: libzmq
    hangs up silently on a peer whose socket type cannot pair with ours (our PUSH dials a
    PULL; a ROUTER, say, refuses it)."""
    return (
        f"{key} hung up in the zmq handshake without a security failure: it is not a "
        f"p2pkv zmq listener (its socket type refuses ours): {FOREIGN_PEER}"
    )


def foreign_dialer_reason(peer: str | None) -> str:
    """Why an inbound connection from ``peer`` (None: it hung up before it could be named)
    ended in its ZMTP handshake with no outcome reported (libzmq refused the dialing socket's
    type: not a PUSH)."""
    source = f" from {peer}" if peer is not None else ""
    return (
        f"refused an inbound connection{source}: not a p2pkv zmq peer (libzmq refused "
        f"its socket type in the handshake): {FOREIGN_PEER}"
    )


def protocol_failure(value: int) -> str:
    """What a ZMTP protocol error code of a failed handshake means for the operator."""
    if value == zmq.PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH:
        return (
            "the security modes differ (CURVE keys configured on one side only); give "
            "both peers the same CURVE options (vLLM's built-in P2P tier has no CURVE: "
            "see 'Mixed fleets' in docs/vllm.md)"
        )
    if value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC:
        return "CURVE decryption failed (the two sides use different server key pairs)"
    return (
        f"ZMTP protocol error {value:#x}; both sides must use the same security mode "
        "(CURVE or none) and server key"
    )


def handshake_reason(key: str, kind: int, value: int, *, curve: bool, timeout: float) -> str:
    """Why our dial to ``key`` died in its handshake (monitor event ``kind``, ``value``)."""
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return (
            f"security handshake failed: {key} refused our client key (ZAP status "
            f"{value}); add our client public key to its allowed_client_keys"
        )
    if kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return f"security handshake failed with {key}: {protocol_failure(value)}"
    if value in _TIMED_OUT:
        return (
            f"handshake timed out: {key} accepted the TCP connection but did not complete "
            f"the ZMTP handshake within handshake_timeout ({timeout:g} s); not a p2pkv "
            "zmq listener, or stopped?"
        )
    # The side that finds a mismatch hangs up, often before the other side can tell why.
    if curve:
        return (
            f"security handshake failed: {key} closed the connection during the CURVE "
            "handshake: its server key pair is not the one our server_public_key names, "
            f"or it runs without CURVE (or it is not a p2pkv zmq listener: {FOREIGN_PEER})"
        )
    # Without CURVE on our side the likelier cause in a fleet is a foreign listener; the
    # wording matches foreign_listener_reason's, whichever way libzmq reported the hang-up.
    return (
        f"{key} hung up in the zmq handshake: it is not a p2pkv zmq listener "
        f"({FOREIGN_PEER}), or its security mode differs: it requires CURVE keys, which "
        "we do not have (give both peers the same CURVE options)"
    )
