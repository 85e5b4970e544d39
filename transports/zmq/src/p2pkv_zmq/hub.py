"""The sockets of one ``zmq`` control transport and the small link protocol between peers.

Sockets (all in the transport's own ``zmq.Context``, all used only from the driver thread):
one ROUTER bound at our address (every peer's frames come in here), one DEALER per connection
dialing the peer's ROUTER (our frames go out there), one monitor PAIR per DEALER and one for
the ROUTER (``inproc://p2pkv-monitor-<n>``, never reused), and the ZAP handler with CURVE.

Link protocol, below the opaque frames of the contract:

- DEALER -> ROUTER. A DEALER's routing id is ``<our address>#<incarnation>``. Its first
  message is ``["", "open", ref]``: ``ref`` is empty when we dialed on our own, or the
  incarnation of the peer DEALER we answer. Every later message is one frame of payload.
- ROUTER -> DEALER. ``["paired", rid]``: "I pair your DEALER with mine, ``rid``" (both
  dialed at once, below). Anything else means "the connection you dialed with this DEALER is
  gone"; it is how a ``close`` reaches the peer, since a ROUTER cannot drop one peer's TCP
  connection.
- Accepting: a DEALER that opened fresh is remembered until its first payload frame, then a
  connection is created (dialing back, answering that DEALER) and returned by ``poll`` with
  the frame buffered. An open answering one of our DEALERs completes that connection (or gets
  "gone" if we retired it).
- Both dialed at once: a fresh open while our own dial to that address is unanswered is
  offered our connection ("paired"); its frames are held until the peer makes the same offer
  to our DEALER, and then the two dials are one connection on both sides (a side that gets
  the offer before it saw the peer's open accepts it and offers back once the open arrives).
  If the peer answers our dial instead (the fresh open was a DEALER it had already closed),
  the offer lapses, the held frames are dropped and that DEALER gets "gone". So frames never
  reach a connection the peer does not consider the same one.
- An older connection to the same address is left alone: if the peer restarted or re-dialed,
  it dies by itself (disconnect or "gone"); frames arrive over TCP streams that are not
  ordered with each other, so arrival order cannot tell old from new.
- Payload from a DEALER that never opened to us (one that reconnected by itself to a
  restarted us) is dropped and answered with "gone", so stale frames never enter a session.

Liveness: a connection dies when its DEALER disconnects (the peer closed, crashed, or missed
heartbeats), fails or stalls its handshake, gets "gone", or has not connected within
``connect_timeout``; a dial-back to a peer that just dialed us dies at its first refused
attempt (the peer is gone). ``poll`` waits on the ROUTER only; the other sockets and the
deadlines are swept every ``_SWEEP_INTERVAL`` (10 ms), so a death shows within that of libzmq
reporting it.

Only DEALERs send ZMTP heartbeats: the ROUTER answers PINGs, and libzmq drops an inbound TCP
connection that stays silent past the TTL its peer's PINGs carry. The ROUTER runs no heartbeat
timer of its own: in libzmq 4.3.5 that timer fires on a connection whose input stopped (pipe
full, or handed over) after its peer hung up, and aborts the process (``!_io_error``,
stream_engine_base.cpp:310), so any client could kill us by overfilling its pipe and
resetting. ``ROUTER_HANDOVER`` is on: without it, a connection presenting a routing id that is
already attached is parked and all it sends is kept until the ROUTER closes (a memory leak
anyone who reaches the port can grow). With it the newest connection takes the id over. Ours
are unique per DEALER (64 random bits), so only someone who reads the link in clear text (no
CURVE) could take a live one over; the peer whose link was taken gets no PONG once it sends a
frame into it, and drops it within ``heartbeat_timeout``. libzmq still keeps a taken-over
connection's engine and socket until the ROUTER closes when data reached it after the takeover
(about 40 KB and one file descriptor each).

A client that announces no routing id is filed under one the ROUTER generates: ``\x00`` and a
counter started from the C library's ``rand()``, never checked against ids clients announced
themselves. Unseeded, ``rand()`` gives the same values in every process, so a client could
announce the next generated id and, once an id-less client connects, make libzmq abort on the
collision (socket_base.cpp:2113). ``rand()`` is therefore seeded with a secret right before
each ROUTER is created: guessing the counter's start is then a 1-in-2^32 shot per squatted id.

Memories of retired ids, pending opens and logged refusals are bounded (oldest forgotten).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq
from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import ControlConnection
from p2pkv.errors import ConfigError, ConnectionClosed
from p2pkv.logs import module_logger
from zmq.utils.monitor import parse_monitor_message

from p2pkv_zmq.connection import ZmqConnection
from p2pkv_zmq.identity import (
    canonical_address,
    is_ipv6_literal,
    new_incarnation,
    parse_routing_id,
    routing_id,
    tcp_url,
)
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.security import CurveKeys
from p2pkv_zmq.transport import ListenPlan, ZmqControlTransport
from p2pkv_zmq.zap import ZapHandler

__all__ = ["ZmqHub"]

log = module_logger(__name__)

_NOBLOCK = zmq.NOBLOCK
_RCVMORE = zmq.RCVMORE
_RCVTIMEO = zmq.RCVTIMEO
_OPEN = b"open"
_GONE = b"gone"
_PAIRED = b"paired"
_ZAP_DOMAIN = b"p2pkv"
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_DEALER_EVENTS = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | _HANDSHAKE_FAILED
_ANSWERING_EVENTS = _DEALER_EVENTS | zmq.EVENT_CONNECT_RETRIED  # a refused dial-back is fatal
_ROUTER_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
_MAX_MESSAGES_PER_POLL = 4096
_SWEEP_INTERVAL = 0.01  # seconds between checks of connection sockets and deadlines
_SWEEP_MS = 10  # the longest single wait on the ROUTER, so sweeps stay on time
_MEMORY = 4096  # entries in each bounded memory
_MAX_HELD_FRAMES = 10_000  # frames held for an offered pairing before giving up on it
_DEALER_MAX_MSG = 65536  # a DEALER receives only "gone" (and handshake commands, ~200 B)
_EMPTY: Sequence[ControlConnection] = ()


@dataclass(eq=False)
class _Opened:
    """A peer DEALER that opened to us and is not part of a connection yet."""

    address: str
    offered: ZmqConnection | None = None
    """Our unanswered dial we offered to pair it with (both dialed at once)."""
    frames: list[bytes] = field(default_factory=list)
    """Frames held until the peer pairs too."""


class ZmqHub(ZmqControlTransport):
    """A listening ``zmq`` control transport. Build it through ``ZmqControlTransport.create``."""

    def __init__(
        self, plan: ListenPlan, options: ZmqOptions, keys: CurveKeys | None, max_frame_bytes: int
    ) -> None:
        self.max_frame_bytes = max_frame_bytes
        self.max_queued_frames = options.max_queued_frames
        self._plan = plan
        self._options = options
        self._keys = keys
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self._sweeper = zmq.Poller()  # every socket but the ROUTER, checked periodically
        self._rcvtimeo = -1  # the ROUTER's current receive timeout (ms)
        self._router_ready = zmq.Poller()  # the ROUTER alone: "is a message waiting?"
        self._handlers: dict[zmq.Socket[bytes], Callable[[], None]] = {}
        self._next_sweep = 0.0
        self._router: zmq.Socket[bytes] | None = None
        self._router_monitor: zmq.Socket[bytes] | None = None
        self._zap: ZapHandler | None = None
        self._local_address = ""
        self._by_address: dict[str, ZmqConnection] = {}
        self._by_rid: dict[bytes, ZmqConnection] = {}
        self._by_incarnation: dict[bytes, ZmqConnection] = {}
        self._connecting: set[ZmqConnection] = set()
        self._pending: OrderedDict[bytes, _Opened] = OrderedDict()  # DEALERs not yet paired
        self._owed: dict[bytes, ZmqConnection] = {}  # peer DEALERs owed our "paired"
        self._retired: OrderedDict[bytes, None] = OrderedDict()  # rids and our incarnations
        self._logged: OrderedDict[Hashable, None] = OrderedDict()
        self._new: list[ZmqConnection] = []
        self._monitor_seq = itertools.count()
        self._closed = False
        self.counters = {"refused_handshakes": 0, "dropped_messages": 0, "accepted": 0,
                         "refused_accepts": 0}

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def open(
        cls, plan: ListenPlan, options: ZmqOptions, keys: CurveKeys | None, max_frame_bytes: int
    ) -> ZmqHub:
        """Bind and listen; on any failure everything is closed again and the error raised."""
        hub = cls(plan, options, keys, max_frame_bytes)
        try:
            hub._listen()
        except BaseException:
            hub.close()
            raise
        return hub

    def _listen(self) -> None:
        plan, keys = self._plan, self._keys
        if keys is not None:  # before the listener exists, or libzmq admits everyone
            self._zap = ZapHandler(self._ctx, keys.allowed, self._on_zap_refusal)
            self._watch(self._zap.socket, self._zap.serve)
        _seed_c_rand()
        router = self._router = self._ctx.socket(zmq.ROUTER)
        self._tune(router, ipv6=plan.ipv6)
        router.router_handover = 1
        router.maxmsgsize = self.max_frame_bytes
        if keys is not None:
            router.curve_server = True
            router.curve_secretkey = keys.server_secret
            router.zap_domain = _ZAP_DOMAIN
        self._router_ready.register(router, zmq.POLLIN)
        self._router_monitor = self._monitor(router, _ROUTER_EVENTS)
        self._watch(self._router_monitor, self._on_router_event)
        try:
            router.bind(tcp_url(plan.bind_host, plan.port or "*"))
        except zmq.ZMQError as exc:
            raise self._bind_error(exc) from None
        endpoint = router.getsockopt_string(zmq.LAST_ENDPOINT)
        port = plan.advertise_port or int(endpoint.rsplit(":", 1)[1])
        self._local_address = format_address(plan.advertise_host, port)
        log.info("zmq control transport listening on %s as %s (%s)", endpoint,
                 self._local_address, "CURVE" if keys else "no authentication")

    def _bind_error(self, exc: zmq.ZMQError) -> ConfigError:
        plan = self._plan
        where = format_address(plan.bind_host, plan.port)
        if exc.errno == zmq.EADDRINUSE:
            return ConfigError(
                f"zmq control port {plan.port} is already in use on {plan.bind_host} "
                f"(port = base port {plan.port - plan.dp_rank} + data-parallel rank offset "
                f"{plan.dp_rank}); stop the process holding it, or choose another base port "
                "with the environment variable P2PKV_PORT or the tier config key 'port'"
            )
        return ConfigError(
            f"cannot listen on {where}: {exc.strerror}; check the tier config key 'host' "
            "(or P2PKV_HOST)"
        )

    def _tune(self, sock: zmq.Socket[bytes], *, ipv6: bool) -> None:
        sock.linger = 0
        sock.ipv6 = ipv6

    def _monitor(self, sock: zmq.Socket[bytes], events: int) -> zmq.Socket[bytes]:
        # A fresh endpoint every time: libzmq frees inproc names asynchronously.
        endpoint = f"inproc://p2pkv-monitor-{next(self._monitor_seq)}"
        monitor: zmq.Socket[bytes] = sock.get_monitor_socket(events, endpoint)
        monitor.linger = 0
        return monitor

    def _watch(self, sock: zmq.Socket[bytes], handler: Callable[[], None]) -> None:
        self._sweeper.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler

    def _unwatch(self, sock: zmq.Socket[bytes]) -> None:
        self._sweeper.unregister(sock)
        del self._handlers[sock]

    # -- ControlTransport -----------------------------------------------------------------

    @property
    def local_address(self) -> str:
        return self._local_address

    def connect(self, address: str) -> ControlConnection:
        if self._closed:
            raise ConnectionClosed("the zmq control transport is closed")
        key = canonical_address(address)
        conn = self._by_address.get(key)
        if conn is not None:
            return conn
        answering = self._take_pending(key)
        conn = self._dial(key, address, answering)
        if answering is not None:
            self._confirm(conn, answering)
        return conn

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        """Frames (the hot path) are waited for with a plain receive on the ROUTER; the other
        sockets (connection monitors, "gone" notices, ZAP, the ROUTER's monitor) and connect
        deadlines are swept every ``_SWEEP_INTERVAL``, so a poll costs the same with one peer
        or hundreds, and about what a raw pyzmq receive costs. libzmq waits in whole
        milliseconds: a wait that has less than one left ends without waiting (never more
        than ``timeout``)."""
        if self._closed:
            return _EMPTY
        now = time.monotonic()
        deadline = now + timeout
        while True:
            swept = now >= self._next_sweep and self._sweep(now)
            wait_ms = min(int((deadline - now) * 1000), _SWEEP_MS)
            if self._read_router(wait_ms) or swept or wait_ms <= 0:
                break
            now = time.monotonic()
            if now >= deadline:
                break
        new = self._new
        if not new:
            return _EMPTY
        self._new = []
        return new

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for conn in list(self._by_incarnation.values()):
            self.retire(conn, "transport closed", notify=False)
        for sock in (self._router_monitor, self._zap.socket if self._zap else None):
            if sock is not None:
                sock.close(0)
        if self._router is not None:
            self._router.close(0)
        self._ctx.term()

    def stats(self) -> dict[str, int]:
        """Counters: refused handshakes, dropped messages, accepted connections, live ones."""
        return {**self.counters, "connections": len(self._by_incarnation)}

    # -- connections ----------------------------------------------------------------------

    def _dial(self, key: str, shown: str, answering: bytes | None) -> ZmqConnection:
        host, port = parse_address(key)
        incarnation = new_incarnation()
        try:
            dealer: zmq.Socket[bytes] = self._ctx.socket(zmq.DEALER)
        except zmq.ZMQError as exc:  # out of sockets (ZMQ_MAX_SOCKETS) or file descriptors
            raise ConfigError(f"cannot dial zmq peer {key}: {exc}") from None
        monitor = None
        try:
            self._tune(dealer, ipv6=is_ipv6_literal(host))
            opts = self._options
            dealer.heartbeat_ivl = _ms(opts.heartbeat_interval)
            dealer.heartbeat_timeout = _ms(opts.heartbeat_timeout)
            dealer.heartbeat_ttl = _ms(opts.heartbeat_ttl)
            dealer.routing_id = routing_id(self._local_address, incarnation)
            # A peer that stalls the handshake (frozen right after accepting the TCP
            # connection) is as silent as one that stops answering PINGs.
            dealer.handshake_ivl = _ms(self._options.heartbeat_timeout)
            dealer.sndhwm = self.max_queued_frames + 1  # + the open message
            dealer.rcvhwm = 64  # link messages only
            dealer.maxmsgsize = _DEALER_MAX_MSG
            if self._keys is not None:
                dealer.curve_serverkey = self._keys.server_public
                dealer.curve_publickey = self._keys.client_public
                dealer.curve_secretkey = self._keys.client_secret
            # A peer that just dialed us listens: if dialing it back fails, it is gone. A peer
            # we dial first may start later, so that dial retries until connect_timeout.
            monitor = self._monitor(
                dealer, _DEALER_EVENTS if answering is None else _ANSWERING_EVENTS
            )
            dealer.connect(tcp_url(host, port))
            ref = b"" if answering is None else answering.rpartition(b"#")[2]
            dealer.send_multipart([b"", _OPEN, ref], _NOBLOCK)
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(0)
            dealer.close(0)
            raise ConfigError(f"cannot dial zmq peer {key}: {exc}") from None
        deadline = time.monotonic() + self._options.connect_timeout
        conn = ZmqConnection(
            self, shown_address=shown, key=key, dealer=dealer, monitor=monitor,
            incarnation=incarnation, deadline=deadline,
        )
        self._by_address[key] = conn
        self._by_incarnation[incarnation] = conn
        self._connecting.add(conn)
        self._watch(dealer, partial(self._on_notice, conn))
        self._watch(monitor, partial(self._on_dealer_event, conn))
        log.debug("dialing %s (%s)", key, "answering" if answering else "fresh")
        return conn

    def _confirm(self, conn: ZmqConnection, rid: bytes) -> None:
        """The peer's DEALER ``rid`` carries the peer's half of ``conn``; frames held for it
        are delivered, other offers of ``conn`` lapse."""
        conn.remote_rid = rid
        self._by_rid[rid] = conn
        opened = self._pending.pop(rid, None)
        if opened is not None:
            conn.inbox.extend(opened.frames)
        self._withdraw_offers(conn)

    def _withdraw_offers(self, conn: ZmqConnection) -> None:
        for rid in [r for r, o in self._pending.items() if o.offered is conn]:
            del self._pending[rid]
            _remember(self._retired, rid)
            self._tell(rid, _GONE)

    def _accept(self, rid: bytes, address: str) -> ZmqConnection:
        conn = self._dial(address, address, rid)  # the newest one is what connect returns
        self._confirm(conn, rid)
        self._new.append(conn)
        self.counters["accepted"] += 1
        return conn

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn`` (idempotent): forget its ids, tell the peer, release its sockets."""
        if conn.reason is not None:
            return
        conn.reason = reason
        del self._by_incarnation[conn.incarnation]
        if self._by_address.get(conn.key) is conn:
            del self._by_address[conn.key]
            for other in reversed(self._by_incarnation.values()):  # an older one still alive
                if other.key == conn.key:
                    self._by_address[conn.key] = other
                    break
        self._connecting.discard(conn)
        _remember(self._retired, conn.incarnation)
        self._withdraw_offers(conn)
        rid = conn.remote_rid
        if rid is not None:
            del self._by_rid[rid]
            self._owed.pop(rid, None)
            _remember(self._retired, rid)
            if notify:
                self._tell(rid, _GONE)
        dealer, monitor = conn.dealer, conn.monitor
        conn.dealer = conn.monitor = None
        if dealer is not None and monitor is not None:
            self._unwatch(dealer)
            self._unwatch(monitor)
            dealer.disable_monitor()
            dealer.close(0)
            monitor.close(0)
        log.debug("connection to %s ended: %s", conn.key, reason)

    def _take_pending(self, address: str) -> bytes | None:
        """The newest fresh DEALER of ``address`` that has not sent a frame yet, if any."""
        for rid, opened in reversed(self._pending.items()):
            if opened.address == address and opened.offered is None:
                del self._pending[rid]
                return rid
        return None

    def _tell(self, rid: bytes, *parts: bytes) -> None:
        """A link message to the peer's DEALER ``rid`` (through our ROUTER)."""
        assert self._router is not None
        try:
            self._router.send_multipart([rid, *parts], _NOBLOCK)
        except zmq.ZMQError:
            pass  # unroutable or full: the peer's heartbeats and timeouts still end it

    # -- inbound --------------------------------------------------------------------------

    def _read_router(self, wait_ms: int) -> bool:
        """Receive what the ROUTER holds, waiting up to ``wait_ms`` for the first message;
        True if anything came.

        Costs are pyzmq's, per call: a blocking receive with a timeout for the wait; after the
        first message a one-socket zero-timeout poll asks for more (cheapest when there is
        none: a ``zmq.Again`` costs about 2.5x that), and a burst is drained until one
        ``zmq.Again`` (cheaper than a poll per message)."""
        router = self._router
        assert router is not None
        recv, more = router.recv, self._router_ready.poll
        if wait_ms > 0:
            if wait_ms != self._rcvtimeo:  # mostly _SWEEP_MS, so rarely re-set
                router.setsockopt(_RCVTIMEO, wait_ms)
                self._rcvtimeo = wait_ms
            try:
                rid = recv()
            except zmq.Again:
                return False
        elif more(0):
            rid = recv(_NOBLOCK)
        else:
            return False
        by_rid, option = self._by_rid, router.getsockopt
        count = 1
        while True:
            first = recv(_NOBLOCK)  # a ROUTER message is a routing id and at least one part
            if option(_RCVMORE):
                self._on_unrouted([rid, first, *router.recv_multipart(_NOBLOCK)])
            else:
                conn = by_rid.get(rid)
                if conn is not None:
                    conn.inbox.append(first)
                else:
                    self._on_unrouted([rid, first])
            if count == _MAX_MESSAGES_PER_POLL:  # fairness: the rest waits for the next poll
                return True
            if count == 1:
                if not more(0):
                    return True
                rid = recv(_NOBLOCK)
            else:
                try:
                    rid = recv(_NOBLOCK)
                except zmq.Again:
                    return True
            count += 1

    def _on_unrouted(self, parts: list[bytes]) -> None:
        rid = parts[0]
        is_open = len(parts) == 4 and parts[1] == b"" and parts[2] == _OPEN
        is_payload = len(parts) == 2
        if rid in self._retired:  # its connection ended; the peer may not know yet
            # Normal at every close (frames in flight cross our close): not worth a warning.
            self._drop(rid, "frames for a connection that has ended", notify=is_open,
                       level=logging.DEBUG)
            return
        if rid in self._by_rid:  # an open after the pairing was confirmed is expected
            if not is_open:
                self._drop(rid, "malformed message from a connected peer", notify=False)
            elif (owed := self._owed.pop(rid, None)) is not None:
                self._tell(rid, _PAIRED, routing_id(self._local_address, owed.incarnation))
            return
        parsed = parse_routing_id(rid)
        if parsed is None or not (is_open or is_payload):
            self._drop(rid, "malformed message (not a p2pkv zmq peer?)", notify=False)
            return
        address, _ = parsed
        opened = self._pending.get(rid)
        if is_open:
            self._on_open(rid, address, parts[3])
        elif opened is None:
            self._drop(rid, "frames from a peer connection that never opened to this "
                       "transport (a stale reconnect after a restart?)", notify=True)
        elif opened.offered is None:
            del self._pending[rid]
            try:
                conn = self._accept(rid, address)
            except ConfigError as exc:  # a flood of connections used up our sockets
                _remember(self._retired, rid)
                self.counters["refused_accepts"] += 1
                self._tell(rid, _GONE)
                self._log_once(("accept",), "refused connections from peers: %s (a flood of "
                               "connections? counted in refused_accepts)", exc)
                return
            conn.inbox.append(parts[1])
        elif len(opened.frames) < _MAX_HELD_FRAMES:
            opened.frames.append(parts[1])  # until the peer pairs too
        else:
            del self._pending[rid]
            _remember(self._retired, rid)
            self._drop(rid, "too many frames before the peer confirmed the pairing",
                       notify=True)

    def _on_open(self, rid: bytes, address: str, ref: bytes) -> None:
        if ref:  # the peer answers one of our DEALERs
            conn = self._by_incarnation.get(ref)
            if conn is None:
                self._tell(rid, _GONE)  # we already retired that connection
            elif conn.remote_rid is None:
                if conn.key != address:  # matched by incarnation, so still one connection
                    self._log_once(("alias", conn.key, address),
                                   "peer dialed as %s presents itself as %s; dial the address "
                                   "it advertises, or set its 'advertise' option", conn.key,
                                   address)
                self._confirm(conn, rid)
            else:
                self.retire(conn, "the peer replaced its end of the connection")
                self._tell(rid, _GONE)
            return
        conn = self._by_address.get(address)
        if conn is not None and conn.remote_rid is None:  # we dialed each other at once
            self._pending[rid] = _Opened(address, offered=conn)
            self._tell(rid, _PAIRED, routing_id(self._local_address, conn.incarnation))
        else:  # a completed connection to that address stays (see the module docstring)
            self._pending[rid] = _Opened(address)
        while len(self._pending) > _MEMORY:
            self._pending.popitem(last=False)

    def _drop(self, rid: bytes, why: str, *, notify: bool, level: int = logging.WARNING) -> None:
        self.counters["dropped_messages"] += 1
        if notify:
            self._tell(rid, _GONE)
        self._log_once(("drop", rid), "dropped a message from %r: %s", rid[:64], why, level=level)

    # -- events ---------------------------------------------------------------------------

    def _on_notice(self, conn: ZmqConnection) -> None:
        """A link message from the peer's ROUTER on our DEALER: "paired" or "gone"."""
        while conn.dealer is not None:
            try:
                parts = conn.dealer.recv_multipart(_NOBLOCK)
            except zmq.Again:
                return
            if len(parts) != 2 or parts[0] != _PAIRED:
                self.retire(conn, "closed by the peer", notify=False)
            elif conn.remote_rid is None and parts[1] not in self._retired:
                offer = self._pending.get(parts[1])
                self._confirm(conn, parts[1])
                if offer is None or offer.offered is not conn:
                    # Pair back once that DEALER's open shows our ROUTER can reach it.
                    self._owed[parts[1]] = conn
            elif conn.remote_rid != parts[1]:
                self._tell(parts[1], _GONE)  # ours is paired otherwise: the offer lapses

    def _on_dealer_event(self, conn: ZmqConnection) -> None:
        while conn.monitor is not None:
            try:
                event = parse_monitor_message(conn.monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connecting.discard(conn)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.retire(conn, "disconnected (peer closed, crashed or silent)")
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # only subscribed for dial-backs
                self.retire(conn, "the peer that dialed us no longer listens")
            elif kind == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:  # interrupted, not refused
                self.retire(conn, "disconnected during the handshake")
            elif kind & _HANDSHAKE_FAILED:
                reason = _handshake_failure(kind, event["value"])
                self._log_once(("dial", conn.key, kind), "connection to %s refused: %s",
                               conn.key, reason)
                self.retire(conn, f"handshake failed: {reason}")

    def _on_router_event(self) -> None:
        assert self._router_monitor is not None
        while True:
            try:
                event = parse_monitor_message(self._router_monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            # libzmq names our listening endpoint here, not the peer: log once per cause.
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL:
                log.debug("an inbound connection ended during its handshake")
                continue
            self.counters["refused_handshakes"] += 1
            reason = _handshake_failure(event["event"], event["value"])
            self._log_once(("listen", event["event"], event["value"]),
                           "refused an inbound connection: %s", reason)

    def _on_zap_refusal(self, host: str, client: str) -> None:
        self.counters["refused_handshakes"] += 1
        self._log_once(("zap", host, client),
                       "refused a connection from %s: client key %s is not in "
                       "allowed_client_keys", host, client)

    def _sweep(self, now: float) -> bool:
        """Handle every connection socket with something to read; True if any had."""
        self._next_sweep = now + _SWEEP_INTERVAL
        ready = self._sweeper.poll(0)
        for sock, _ in ready:
            handler = self._handlers.get(sock)
            if handler is not None:  # None: unwatched by an earlier handler
                handler()
        if self._connecting:
            self._expire_connects(now)
        return bool(ready)

    def _expire_connects(self, now: float) -> None:
        for conn in [c for c in self._connecting if c.deadline <= now]:
            self._log_once(("unreachable", conn.key),
                           "peer %s did not complete a connection within connect_timeout %ss",
                           conn.key, self._options.connect_timeout)
            self.retire(conn, f"not connected within connect_timeout "
                              f"({self._options.connect_timeout} s)")

    def _log_once(
        self, key: Hashable, msg: str, *args: object, level: int = logging.WARNING
    ) -> None:
        """Log once per ``key`` (per peer, never per frame or per reconnect attempt)."""
        if key in self._logged:
            return
        _remember(self._logged, key)
        log.log(level, msg, *args)


def _seed_c_rand() -> None:
    """Seed the C library's ``rand()``, where libzmq starts a new ROUTER's generated routing
    ids (see the module docstring). Best effort: without a C library to call, logged."""
    try:
        ctypes.CDLL(None).srand(secrets.randbits(32))
    except (OSError, AttributeError) as exc:
        log.warning("cannot seed rand() (%s): the listener's generated routing ids stay "
                    "predictable", exc)


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))


def _remember(memory: OrderedDict[Any, None], key: Hashable) -> None:
    memory[key] = None
    if len(memory) > _MEMORY:
        memory.popitem(last=False)


def _handshake_failure(kind: int, value: int) -> str:
    if kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return f"authentication refused (ZAP status {value}): our client key is not allowed there"
    return (f"security handshake failed (ZMTP protocol error {value:#x}); both sides must use "
            "the same security mode (CURVE or none) and server key")
