"""The listener's gate: inbound TCP connections that do not speak the link protocol in time
are closed.

libzmq closes a connection whose ZMTP handshake has not completed within
``ZMQ_HANDSHAKE_IVL``, but once the handshake is done (anyone can do a NULL one) nothing
bounds a client that sends a partial frame, or nothing, and stays: the listener runs no
heartbeat timer (see :mod:`p2pkv_zmq.hub`). The gate tracks every TCP connection the listener
accepts (its monitor reports the descriptor, ``EVENT_ACCEPTED``, and its end,
``EVENT_DISCONNECTED``) until a well-formed link message (open, paired or gone: the first
message of every dialing socket of a p2pkv peer) comes over it (``ZMQ_SRCFD`` of the
message); one still unproven ``timeout`` seconds after we learnt of it is shut down
(``shutdown(2)`` on a duplicate of libzmq's descriptor: libzmq reads the end of the stream,
closes the connection and frees everything it held).

A descriptor can be closed by libzmq and reused for another socket before we act. Events of
one monitor arrive in order, and libzmq reports a connection's accept before reading from it
and its end before closing the descriptor, so after the monitor is drained each tracked
descriptor still names the connection it was accepted for, or its end is queued. The peer
address recorded at accept is checked again just before the shutdown, so a descriptor reused
meanwhile is left alone. (A connection that proves itself and ends at once may leave the
proof to the next connection on its descriptor, if that one is accepted before the hub
drains the monitor: a microseconds race, which exempts one connection from the gate.)

An unproven connection that ends with no handshake outcome (succeeded or failed) reported by
the listener since its accept was refused by libzmq for its socket type: libzmq hangs up in
the ZMTP handshake on a dialer that cannot pair with our PULL (a DEALER, say) without
reporting a failure, whereas a client that leaves or stalls in the handshake is reported as
one. :meth:`InboundGate.ended` names such a peer. It cannot name every one: when the dialer
finds the mismatch first and hangs up, our side reports a failure like any client that left
(measured on loopback: 5-30 % of a DEALER's dials end without an outcome), and with other
handshakes completing in between it names none. It never names a p2pkv peer.

Threading: used only from the hub's driver thread. Never closes a descriptor of libzmq's.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from p2pkv.addressing import format_address

__all__ = ["InboundGate", "Refused"]


@dataclass(frozen=True)
class Refused:
    """An inbound connection libzmq refused in its handshake for the dialer's socket type."""

    peer: str | None
    """``host:port`` of the dialer, None if it had hung up before we could ask."""


@dataclass(frozen=True)
class _Unproven:
    deadline: float
    peer: tuple[Any, ...] | None
    """``getpeername()`` when we learnt of the connection (None: it had ended by then)."""
    handshakes: int
    """The listener's handshake outcomes reported before we learnt of it."""


class InboundGate:
    """Unproven inbound connections by descriptor. ``on_close(peer)`` is called for each one
    the gate shuts down (``peer`` as ``host:port`` text)."""

    def __init__(self, timeout: float, on_close: Callable[[str], None]) -> None:
        self.timeout = timeout
        self._on_close = on_close
        self._unproven: dict[int, _Unproven] = {}  # insertion order is deadline order

    @property
    def pending(self) -> bool:
        """True while any accepted connection has not proven itself."""
        return bool(self._unproven)

    @property
    def next_deadline(self) -> float | None:
        """When the first unproven connection falls due, None if there is none."""
        for entry in self._unproven.values():
            return entry.deadline
        return None

    def accepted(self, fd: int, now: float, handshakes: int) -> None:
        """The listener accepted a connection on ``fd`` (its monitor says so), after
        ``handshakes`` handshake outcomes (a running count the caller keeps). A connection
        already gone is tracked too, unnamed, until its end (queued behind) is reported."""
        self._unproven.pop(fd, None)  # keep deadline order
        self._unproven[fd] = _Unproven(now + self.timeout, _peer_of(fd), handshakes)

    def ended(self, fd: int, handshakes: int) -> Refused | None:
        """The connection on ``fd`` ended (proven or not), ``handshakes`` outcomes counted by
        now. A :class:`Refused` if it was unproven and no handshake outcome came since its
        accept (a socket type libzmq refused; see the module docstring)."""
        entry = self._unproven.pop(fd, None)
        if entry is None or entry.handshakes != handshakes:
            return None
        return Refused(None if entry.peer is None else _text(entry.peer))

    def admit(self, fd: int) -> None:
        """A well-formed link message came over ``fd``: a peer, let it be."""
        self._unproven.pop(fd, None)

    def expire(self, due: float) -> int:
        """Shut down every unproven connection whose deadline is at or before ``due``; the
        number of entries examined. Call it only right after draining the listener's
        monitor."""
        examined = 0
        while self._unproven:
            fd, entry = next(iter(self._unproven.items()))
            examined += 1
            if entry.deadline > due:
                return examined
            del self._unproven[fd]
            if entry.peer is not None and _shut_down(fd, entry.peer):
                self._on_close(_text(entry.peer))
        return examined


def _text(peer: tuple[Any, ...]) -> str:
    """A ``getpeername()`` result as ``host:port`` text."""
    return format_address(str(peer[0]), int(peer[1]))


@contextmanager
def _borrowed(fd: int) -> Iterator[socket.socket]:
    """A socket object on a duplicate of ``fd`` (closed afterwards; ``fd`` stays libzmq's).
    ``OSError`` if ``fd`` is closed or no socket."""
    dup = os.dup(fd)
    try:
        sock = socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        raise
    with sock:
        yield sock


def _peer_of(fd: int) -> tuple[Any, ...] | None:
    """``getpeername()`` of the TCP connection on ``fd``, or None if there is none."""
    try:
        with _borrowed(fd) as sock:
            peer = sock.getpeername()
    except OSError:
        return None
    return peer if isinstance(peer, tuple) else None


def _shut_down(fd: int, peer: tuple[Any, ...]) -> bool:
    """Shut down the socket on ``fd`` if it is still connected to ``peer``; True if it was."""
    try:
        with _borrowed(fd) as sock:
            if sock.getpeername() != peer:
                return False  # libzmq closed it and the descriptor was reused
            sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        return False
    return True
