"""The socket monitors of one ``zmq`` hub: what libzmq reports about our sockets, turned into
the fate of connections and the listener's gate.

- **A dial's monitor** (one PAIR per PUSH) says how far the dial got and how it ends. TCP
  connected: ``progress`` "connected"; ZMTP handshake done: "ready". A refused TCP connect
  (``CONNECT_RETRIED``: libzmq would retry, we do not), a failed handshake (named), or a
  disconnect before any outcome (a listener of a foreign socket type) fails the dial. A
  disconnect after the handshake ends the connection, and the peer's half is told "gone".
- **Connect deadlines.** A dial not ready within ``connect_timeout`` fails. Every deadline is
  the dial's start plus that one timeout, so they fall due in the order the dials began: a
  FIFO is the timer queue, and a sweep looks only at the dials that are due.
- **The listener's monitor** feeds the gate (:mod:`p2pkv_zmq.gate`): accepted and ended TCP
  connections by descriptor, and handshake outcomes, counted and logged once per cause.
- **ZAP** refusals are counted and logged once per host and key.

Threading: the hub's driver thread only.
"""

from __future__ import annotations

import logging
import os
import time
from collections import deque
from collections.abc import Callable, Hashable
from functools import partial
from typing import Protocol

import zmq
from zmq.utils.monitor import parse_monitor_message

from p2pkv_zmq.connection import CONNECTED, READY, ZmqConnection
from p2pkv_zmq.dialing import (
    FOREIGN_PEER,
    foreign_dialer_reason,
    foreign_listener_reason,
    handshake_reason,
    protocol_failure,
    refused_reason,
)
from p2pkv_zmq.gate import InboundGate
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.poller import Readiness

__all__ = ["LINK_EVENTS", "LISTENER_EVENTS", "MonitorOwner", "SocketMonitors"]

_NOBLOCK = zmq.NOBLOCK
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
LINK_EVENTS = (  # a refused TCP connect (CONNECT_RETRIED) is fatal: fail fast, say why
    zmq.EVENT_CONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | _HANDSHAKE_FAILED
)
"""What a dial's monitor reports."""
LISTENER_EVENTS = (
    zmq.EVENT_ACCEPTED
    | zmq.EVENT_DISCONNECTED  # for the gate
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | _HANDSHAKE_FAILED  # outcomes, for the gate's count
)
"""What the listener's monitor reports."""

LogOnce = Callable[..., None]
"""``log_once(key, msg, *args, level=logging.WARNING)``."""


class MonitorOwner(Protocol):
    """What the monitors ask of their hub."""

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn`` with ``reason``."""

    def dial_failed(self, conn: ZmqConnection, reason: str) -> None:
        """``conn`` died before its handshake completed (remembered, logged, retired)."""

    def tell_gone(self, link: bytes) -> None:
        """Tell the peer PUSH ``link`` that its connection is gone."""


class SocketMonitors:
    """The monitors of one hub (see the module docstring): their sockets are watched in the
    hub's ``readiness`` set. ``counters`` is the hub's."""

    def __init__(
        self,
        readiness: Readiness,
        owner: MonitorOwner,
        options: ZmqOptions,
        *,
        curve: bool,
        counters: dict[str, int],
        log_once: LogOnce,
    ) -> None:
        self._readiness = readiness
        self._owner = owner
        self._options = options
        self._curve = curve
        self._counters = counters
        self._log_once = log_once
        self._dials: deque[ZmqConnection] = deque()
        """Dials by deadline (their start + ``connect_timeout``), not yet due."""
        self.gate = InboundGate(options.handshake_timeout, self._on_gate_close)
        self._handshakes = 0
        """Handshake outcomes the listener reported so far (see :mod:`p2pkv_zmq.gate`)."""
        self._listener_monitor: zmq.Socket[bytes] | None = None

    # -- dials ----------------------------------------------------------------------------------

    def watch_dial(self, conn: ZmqConnection) -> None:
        """Follow the new dial ``conn`` (its ``monitor`` set, ``deadline`` its start plus
        ``connect_timeout``)."""
        self.watch_deadline(conn)
        self.watch_monitor(conn)

    def watch_deadline(self, conn: ZmqConnection) -> None:
        """Fail the new dial ``conn`` if it is not ready by its ``deadline`` (its start plus
        ``connect_timeout``), with or without its sockets yet."""
        self._dials.append(conn)

    def watch_monitor(self, conn: ZmqConnection) -> None:
        """Follow what ``conn``'s ``monitor`` reports (set now, after its deadline)."""
        assert conn.monitor is not None
        self._readiness.watch(conn.monitor, partial(self._on_link_event, conn))

    def release(self, monitor: zmq.Socket[bytes]) -> None:
        """Stop following a retired dial's ``monitor`` (before it is closed)."""
        self._readiness.unwatch(monitor)

    def _on_link_event(self, conn: ZmqConnection) -> None:
        while conn.monitor is not None:
            try:
                event = parse_monitor_message(conn.monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_CONNECTED:
                conn.reached(CONNECTED)
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                conn.reached(READY)
            elif kind == zmq.EVENT_DISCONNECTED and conn.progress != READY:
                self._owner.dial_failed(conn, foreign_listener_reason(conn.key))  # no outcome
            elif kind == zmq.EVENT_DISCONNECTED:  # after the handshake (a failure comes first)
                link = conn.remote_link
                self._owner.retire(
                    conn, "disconnected (peer closed, crashed or silent)", notify=False
                )
                if link is not None:  # its half may live on (say, it refused our frame size)
                    self._owner.tell_gone(link)
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # the TCP connect failed
                dialed_us = conn.remote_link is not None
                self._owner.dial_failed(conn, refused_reason(conn.key, dialed_us=dialed_us))
            elif kind & _HANDSHAKE_FAILED:
                self._owner.dial_failed(
                    conn,
                    handshake_reason(
                        conn.key,
                        kind,
                        int(event["value"]),
                        curve=self._curve,
                        timeout=self._options.handshake_timeout,
                    ),
                )

    # -- timers ---------------------------------------------------------------------------------

    def on_sweep(self, now: float, previous: float) -> int:
        """Fail the dials whose connect deadline passed and let the gate close what was due
        at the ``previous`` sweep; the number of timer entries examined."""
        examined = self._expire_dials(now)
        if self.gate.pending:
            examined += self.gate.expire(previous)
        return examined

    def next_due(self) -> float | None:
        """When the first timer falls due (monotonic seconds), None if none is set."""
        dials = self._dials
        while dials and not _connecting(dials[0]):
            dials.popleft()  # ready or dead: its deadline no longer matters
        first = dials[0].deadline if dials else None
        gate = self.gate.next_deadline
        if gate is None or (first is not None and first <= gate):
            return first
        return gate

    def _expire_dials(self, now: float) -> int:
        dials = self._dials
        examined = 0
        timeout = self._options.connect_timeout
        while dials and dials[0].deadline <= now:
            conn = dials.popleft()
            examined += 1
            if _connecting(conn):
                self._owner.dial_failed(
                    conn,
                    f"not connected within connect_timeout "
                    f"({timeout:g} s): no answer from {conn.key}",
                )
        return examined

    # -- the listener ---------------------------------------------------------------------------

    def watch_listener(self, monitor: zmq.Socket[bytes]) -> None:
        self._listener_monitor = monitor
        self._readiness.watch(monitor, self._on_listener_event)

    def admit(self, fd: int) -> None:
        """A well-formed link message came over the inbound TCP connection ``fd``. libzmq
        reported its accept before reading from it, so the monitor is drained first: the gate
        then knows the connection, and lets it be."""
        self._on_listener_event()
        self.gate.admit(fd)

    def _on_listener_event(self) -> None:
        """Drain the listener's monitor: accepted and ended TCP connections (by descriptor)
        for the gate, refused handshakes for the counters and the log."""
        monitor = self._listener_monitor
        assert monitor is not None
        while True:
            try:
                event = parse_monitor_message(monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self.gate.accepted(value, time.monotonic(), self._handshakes)
            elif kind == zmq.EVENT_DISCONNECTED:
                refused = self.gate.ended(value, self._handshakes)
                if refused is not None:
                    self._counters["refused_handshakes"] += 1
                    host = refused.peer.rpartition(":")[0] if refused.peer else None
                    self._log_once(("foreign", host), "%s", foreign_dialer_reason(refused.peer))
            else:
                self._handshakes += 1
                self._on_listener_handshake(kind, value)

    def _on_listener_handshake(self, kind: int, value: int) -> None:
        """A handshake outcome on the listener (libzmq names our listening endpoint, not the
        peer): failures counted and logged once per cause; refused client keys are logged by
        the ZAP handler, which knows the peer."""
        if kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # stalled, left, or refused: see gate
            self._log_once(
                ("listen", "ended"),
                "an inbound connection ended in its zmq "
                "handshake (%s): a TCP probe, a client that left, or a zmq peer of "
                "another kind; %s",
                os.strerror(value),
                FOREIGN_PEER,
                level=logging.INFO,
            )
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self._counters["refused_handshakes"] += 1
            self._log_once(
                ("listen", value),
                "refused an inbound connection: security handshake failed: %s",
                protocol_failure(value),
            )

    def _on_gate_close(self, peer: str) -> None:
        self._counters["inbound_timeouts"] += 1
        self._log_once(
            ("gate", peer.rpartition(":")[0]),
            "closed an inbound connection from "
            "%s: no well-formed p2pkv message within handshake_timeout %g s (not a "
            "p2pkv zmq peer?)",
            peer,
            self.gate.timeout,
        )

    def on_zap_refusal(self, host: str, client: str) -> None:
        self._counters["refused_handshakes"] += 1
        key: Hashable = ("zap", host, client)
        self._log_once(
            key,
            "refused a connection from %s: client key %s is not in allowed_client_keys",
            host,
            client,
        )


def _connecting(conn: ZmqConnection) -> bool:
    """A live dial whose handshake has not completed."""
    return conn.alive and conn.progress != READY
