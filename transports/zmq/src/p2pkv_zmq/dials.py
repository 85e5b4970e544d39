"""How one zmq hub dials: a new dial's sockets and connection, at once or after a reach check.

- :meth:`LinkDials.dial`: a PUSH and its monitor, connected now, with the link's first
  message queued (a fresh dial, or one answering a peer that dialed us).
- :meth:`LinkDials.fresh`: a fresh dial to an IP literal. During a flood of dials that reach
  nothing, or a burst of unconnected ones, it starts as a reach check
  (:mod:`p2pkv_zmq.reach`): the connection exists, with no socket, and gets its PUSH once
  the check connects.

Every new connection is registered with the hub's pairing and followed by its monitors
(``connect_timeout`` from its start). Threading: the hub's driver thread only.
"""

from __future__ import annotations

import time
from typing import Protocol

import zmq
from p2pkv.errors import ConfigError, ResourceUnavailable
from p2pkv.logs import module_logger

from p2pkv_zmq.connection import CONNECTED, LinkLimits, Owner, PeerAddress, ZmqConnection
from p2pkv_zmq.identity import link_id, new_incarnation, tcp_url
from p2pkv_zmq.monitors import LINK_EVENTS, SocketMonitors
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.pairing import OPEN, LinkPairing
from p2pkv_zmq.poller import Readiness
from p2pkv_zmq.reach import ReachChecks
from p2pkv_zmq.sockets import SocketFactory

__all__ = ["DialOwner", "LinkDials"]

log = module_logger(__name__)

_NO_PIPE = (
    "could not open the link: libzmq had no pipe to the peer right after connecting "
    "(handshake refused?)"
)


class DialOwner(Owner, Protocol):
    """What the dials ask of their hub, beyond what its connections do."""

    @property
    def local_address(self) -> str:
        """Our address, which link ids name."""

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn`` with ``reason``."""

    def dial_failed(self, conn: ZmqConnection, reason: str) -> None:
        """``conn`` died before its handshake completed (remembered, logged, retired)."""


class LinkDials:
    """The dials of one hub (see the module docstring); ``reach`` holds its checks."""

    def __init__(
        self,
        owner: DialOwner,
        sockets: SocketFactory,
        options: ZmqOptions,
        limits: LinkLimits,
        roles: tuple[LinkPairing, SocketMonitors, Readiness],
    ) -> None:
        self._owner = owner
        self._sockets = sockets
        self._options = options
        self._limits = limits
        self._pairing, self._monitors, readiness = roles
        self.reach = ReachChecks(readiness, self._on_reached, owner.dial_failed)

    def fresh(self, peer: PeerAddress, host: str, port: int, now: float) -> ZmqConnection:
        """A new connection to ``peer`` at ``host`` (an IP literal): dialed at once, or,
        during a flood of fruitless dials, once a reach check connects; a check that fails
        at once fails the dial. Raises as :meth:`dial` does."""
        url = tcp_url(host, port)
        reach = self.reach
        if not reach.wanted(peer.key, now):
            conn = self.dial(peer, None, url)
            if conn.alive:
                reach.dialing(conn)
            return conn
        incarnation = new_incarnation()
        conn = self._connection(peer, incarnation, link_id(self._owner.local_address, incarnation))
        reach.dialing(conn)
        reason = reach.start(conn, host, port, url)
        self._pairing.add(conn)
        self._monitors.watch_deadline(conn)
        if reason is not None:
            self._owner.dial_failed(conn, reason)
        return conn

    def dial(self, peer: PeerAddress, answering: bytes | None, url: str) -> ZmqConnection:
        """A new connection to ``peer`` dialing ``url`` (``answering``: the peer's fresh PUSH
        it answers). ``ResourceUnavailable`` when libzmq refuses the dial (out of sockets or
        descriptors); ``ConfigError`` for an address libzmq cannot dial."""
        incarnation = new_incarnation()
        link = link_id(self._owner.local_address, incarnation)
        ref = b"" if answering is None else answering.rpartition(b"#")[2]
        push, monitor, queued = self._sockets.dial(
            peer.key, url, [link, b"", OPEN, ref], LINK_EVENTS
        )
        conn = self._connection(peer, incarnation, link, push, monitor)
        self._pairing.add(conn)
        self._monitors.watch_dial(conn)
        log.debug("dialing %s (%s)", peer.key, "answering" if answering else "fresh")
        if not queued:
            self._owner.retire(conn, _NO_PIPE, notify=False)
        return conn

    def _connection(
        self,
        peer: PeerAddress,
        incarnation: bytes,
        link: bytes,
        push: zmq.Socket[bytes] | None = None,
        monitor: zmq.Socket[bytes] | None = None,
    ) -> ZmqConnection:
        """A new dial's connection, due by now plus ``connect_timeout``."""
        deadline = time.monotonic() + self._options.connect_timeout
        return ZmqConnection(
            self._owner,
            self._limits,
            peer,
            out=push,
            monitor=monitor,
            incarnation=incarnation,
            link=link,
            deadline=deadline,
        )

    def _on_reached(self, conn: ZmqConnection, url: str) -> None:
        """The reach check of ``conn`` connected: it counts as connected (a dial making
        progress), is dialed with zmq now, and libzmq gets what was sent meanwhile. Out of
        sockets (or an address libzmq refuses) retires it."""
        conn.reached(CONNECTED)
        try:
            push, monitor, queued = self._sockets.dial(
                conn.key, url, [conn.link, b"", OPEN, b""], LINK_EVENTS
            )
        except (ResourceUnavailable, ConfigError) as exc:
            self._owner.retire(conn, str(exc), notify=False)
            return
        conn.out, conn.monitor = push, monitor
        self._monitors.watch_monitor(conn)
        log.debug("dialing %s (fresh, reached)", conn.key)
        if not queued:
            self._owner.retire(conn, _NO_PIPE, notify=False)
        else:
            conn.push()
