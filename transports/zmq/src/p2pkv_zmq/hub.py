"""The routing and link state of one ``zmq`` control transport: the small link protocol
between peers, over sockets that :mod:`p2pkv_zmq.sockets` creates and tunes.

Sockets (all in the transport's own ``zmq.Context``, all used only from the driver thread):
one PULL bound at our address (every peer's frames come in here), one PUSH per connection
dialing the peer's PULL (our frames go out there), one monitor PAIR per PUSH and one for the
PULL, the ZAP handler with CURVE, and short-lived notice PUSH sockets (below). No socket of
ours is a ROUTER: libzmq 4.3.5 files a ROUTER's inbound connections under the routing id each
client announces, and a client reusing or squatting ids made it keep dead connections or
abort. A PULL has no ids at all.

Link protocol, below the opaque frames of the contract. Every message a PUSH sends starts with
its link id ``<our address>#<incarnation>`` (:mod:`p2pkv_zmq.identity`), since a PULL does not
say which connection a message came from; the receiver knows links by that id and its own
connections by their incarnation. Message shapes on the PULL:

- ``[link, frame]``: one frame of payload on the sender's connection.
- ``[link, "", "open", ref]``: the first message of a PUSH; ``ref`` is empty when it dialed on
  its own, or the incarnation of the receiver's PUSH it answers.
- ``[link, "", "paired", inc]``: "I pair my PUSH ``link`` with yours of incarnation ``inc``"
  (both dialed at once, below). Sent on the offered PUSH itself, so it follows its open.
- ``[link, "", "gone", inc]``: "your connection whose PUSH has incarnation ``inc`` is gone";
  with ``inc`` empty: "my PUSH ``link`` is closed" (a connection closed before it was paired).
- ``[link, "", "probe", nonce]``: ``p2pkv probe`` asks who we are; answered with
  ``identity`` over a notice PUSH to ``link``'s address, nothing else (no connection, logged
  at DEBUG only; :mod:`p2pkv_zmq.probe_wire`).
- anything else (one part, other shapes, a first frame that is not a canonical link id) is
  malformed: dropped, counted in ``dropped_messages``, logged once per sender id.

``paired`` and ``gone`` are obeyed from any sender that names an incarnation of ours: the
64-bit incarnation (random, sent only to the peer it was dialed to, encrypted under CURVE) is
what authenticates them, as it did when they came back on our own dialing socket.

- Accepting: a PUSH that opened fresh is remembered until its first payload frame, then a
  connection is created (dialing back, answering that PUSH) and returned by ``poll`` with the
  frame buffered. An open answering one of our PUSHes completes that connection (or is told
  "gone" if we retired it).
- Both dialed at once: a fresh open while our own dial to that address is unanswered is
  offered our connection ("paired" on our PUSH); its frames are held until the peer makes the
  same offer, and then the two dials are one connection on both sides (a side that gets the
  offer without having offered, e.g. it keyed our address under another spelling, accepts it
  and offers back at once). If the peer answers our dial instead (the fresh open was a PUSH it
  had already closed), the offer lapses, the held frames are dropped and that PUSH is told
  "gone". So frames never reach a connection the peer does not consider the same one.
- An older connection to the same address is left alone: if the peer restarted or re-dialed,
  it dies by itself (disconnect or "gone"); frames arrive over TCP streams that are not
  ordered with each other, so arrival order cannot tell old from new.
- Payload or an open from a PUSH whose connection ended, or one that never opened to us (a
  PUSH that reconnected by itself to a restarted us), is dropped and its sender told "gone",
  so stale frames never enter a session.

Telling a peer link "gone" goes over a PUSH of ours to that address when one exists, else over
a notice PUSH dialed for that one message (``LINGER`` ``_NOTICE_LINGER_MS``, then libzmq drops
it). Notices are rate-limited (``_NOTICE_RATE`` per second, bursts of as many) and each link
is told at most once per ``_RETELL_INTERVAL`` (a bounded memory): a "gone" that went out can
still be lost (queued to a peer paused past the heartbeat timeout), and a link that keeps
sending after it was told is told again. A message that fails validation never makes us dial.
Our own close sends "gone" on the connection's PUSH, which lingers as long to deliver it.

Liveness: a connection dies when its PUSH disconnects (the peer closed its listener, crashed,
or missed heartbeats; the peer's half is then told "gone" as above), gets "gone", or its dial
fails: the first refused TCP connect (libzmq retries; we do not: nothing listens, or a peer
that just dialed us is gone), a failed handshake (named: a CURVE mismatch, a key the peer does
not allow), one not done within ``handshake_timeout``, or no connection within
``connect_timeout``. A failed dial is remembered for ``DIAL_BACKOFF`` and a host name that does
not resolve fails at ``connect`` (:mod:`p2pkv_zmq.dialing`). ``poll`` waits on the PULL only;
the monitors, ZAP and the deadlines are swept every ``_SWEEP_INTERVAL`` (10 ms), so a death
shows within that of libzmq reporting it; ``close_reason`` says why. An idle hub (no deadline
due) waits on every socket at once instead, and wakes only for one of them. Only PUSH sockets send
ZMTP heartbeats (why: :mod:`p2pkv_zmq.sockets`).

Hostile bytes on the listening port: the PULL has a ZAP domain even without CURVE (libzmq then
refuses ZMTP 1.0/2.0 peers, which any stray bytes pass for, at once) and
``ZMQ_HANDSHAKE_IVL`` = ``handshake_timeout`` (a greeting or handshake cut short is closed by
libzmq); a connection past its handshake that sends no well-formed link message within the
same time is shut down by the gate (:mod:`p2pkv_zmq.gate`). Warnings are logged once per key
and rate-limited in all (``_LOG_BURST`` per ``_LOG_WINDOW``, then a summary line), so
hostile input cannot flood the log.

Memories of retired ids, pending opens, told links and logged refusals are bounded (oldest
forgotten).
"""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import zmq
from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import ControlConnection
from p2pkv.errors import ConfigError, ConnectionClosed, ResourceUnavailable
from p2pkv.logs import module_logger
from p2pkv.ratelimit import LogLimiter, TokenBucket
from zmq.utils.monitor import parse_monitor_message

from p2pkv_zmq.connection import LinkLimits, PeerAddress, ZmqConnection
from p2pkv_zmq.dialing import (
    FOREIGN_PEER,
    DialFailed,
    DialFailures,
    foreign_dialer_reason,
    foreign_listener_reason,
    handshake_reason,
    protocol_failure,
    refused_reason,
    resolve,
)
from p2pkv_zmq.gate import InboundGate
from p2pkv_zmq.identity import (
    MAX_LINK_ID_BYTES,
    canonical_address,
    link_id,
    new_incarnation,
    parse_link_id,
    tcp_url,
)
from p2pkv_zmq.listening import ListenPlan
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.probe_wire import IDENTITY, PROBE, identity_answer, valid_nonce
from p2pkv_zmq.security import CurveKeys
from p2pkv_zmq.sockets import SocketFactory
from p2pkv_zmq.zap import ZapHandler

__all__ = ["ZmqHub"]

log = module_logger(__name__)

_NOBLOCK = zmq.NOBLOCK
_RCVTIMEO = zmq.RCVTIMEO
_OPEN = b"open"
_GONE = b"gone"
_PAIRED = b"paired"
_PAYLOAD = b""  # what _verb says of [link, frame]
_VERBS = (_OPEN, _PAIRED, _GONE, PROBE)
_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_LINK_EVENTS = (  # a refused TCP connect (CONNECT_RETRIED) is fatal: fail fast, say why
    zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED
    | _HANDSHAKE_FAILED
)
_LISTENER_EVENTS = (
    zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED  # for the gate
    | zmq.EVENT_HANDSHAKE_SUCCEEDED | _HANDSHAKE_FAILED  # outcomes, for the gate's count
)
_SRCFD = zmq.SRCFD
_MAX_MESSAGES_PER_POLL = 4096
_SWEEP_INTERVAL = 0.01  # seconds between checks of connection sockets and deadlines
_SWEEP_MS = 10  # the longest single wait on the PULL, so sweeps stay on time
_MEMORY = 4096  # entries in each bounded memory
_MAX_HELD_FRAMES = 10_000  # frames held for an offered pairing before giving up on it
_NOTICE_RATE = 20.0  # notice dials per second (and the largest burst)
_NOTICE_LINGER_MS = 500  # how long a closed PUSH keeps trying to deliver its last message
_LOG_BURST = 20  # warnings logged at once, and per _LOG_WINDOW on average ...
_LOG_WINDOW = 10.0  # ... beyond that, one "suppressed K" line per this many seconds
_RETELL_INTERVAL = 1.0
"""Seconds before a peer link that keeps sending after it was told "gone" is told again. A
"gone" that went out may still be lost: one queued to a peer paused past the heartbeat
timeout is dropped with the dead TCP connection, and the resumed peer would otherwise keep
its stale connection (and session) forever."""
_EMPTY: Sequence[ControlConnection] = ()


@dataclass(eq=False)
class _Opened:
    """A peer PUSH that opened to us and is not part of a connection yet."""

    address: str
    offered: ZmqConnection | None = None
    """Our unanswered dial we offered to pair it with (both dialed at once)."""
    frames: list[bytes] = field(default_factory=list)
    """Frames held until the peer pairs too."""


class ZmqHub:
    """The routing and link state of one listening ``zmq`` control transport: owned by a
    :class:`~p2pkv_zmq.transport.ZmqControlTransport`, which builds it with :meth:`open`
    and delegates the ``ControlTransport`` calls to it."""

    batching = False
    """Set by ``batch_sends``: frames wait in their connection for ``flush``/``poll``."""

    def __init__(
        self, plan: ListenPlan, options: ZmqOptions, keys: CurveKeys | None, max_frame_bytes: int
    ) -> None:
        self._limits = LinkLimits(max_frame_bytes, options.max_queued_frames)
        self._plan = plan
        self._options = options
        self._keys = keys
        self._sockets = SocketFactory(options, keys, max_frame_bytes)
        self._sweeper = zmq.Poller()  # every socket but the PULL, checked periodically
        self._everything = zmq.Poller()  # every socket, the PULL too: the idle wait
        self._wake_in, self._wake_out = socket.socketpair()  # interrupt() ends an idle wait
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self._everything.register(self._wake_in.fileno(), zmq.POLLIN)
        self._rcvtimeo = -1  # the PULL's current receive timeout (ms)
        self._listener_ready = zmq.Poller()  # the PULL alone: "is a message waiting?"
        self._listener_fd = -1  # the PULL's ZMQ_FD, for waits under a millisecond
        self._handlers: dict[zmq.Socket[bytes], Callable[[], None]] = {}
        self._next_sweep = 0.0
        self._listener: zmq.Socket[bytes] | None = None
        self._listener_monitor: zmq.Socket[bytes] | None = None
        self._zap: ZapHandler | None = None
        self._local_address = ""
        self._by_address: dict[str, ZmqConnection] = {}
        self._by_link: dict[bytes, ZmqConnection] = {}  # the peer's PUSH -> our connection
        self._by_incarnation: dict[bytes, ZmqConnection] = {}
        self._connecting: set[ZmqConnection] = set()
        self._pending: OrderedDict[bytes, _Opened] = OrderedDict()  # peer PUSHes not paired
        self._retired: OrderedDict[bytes, None] = OrderedDict()  # links and our incarnations
        self._told: OrderedDict[bytes, float] = OrderedDict()
        """Peer links told "gone", with when (monotonic): told again only after
        ``_RETELL_INTERVAL`` if they keep sending (the first notice may have been lost)."""
        now = time.monotonic()
        self._notices = TokenBucket(_NOTICE_RATE, _NOTICE_RATE, now)
        self._logged: OrderedDict[Hashable, None] = OrderedDict()
        self._log_limit = LogLimiter(log, _LOG_BURST, _LOG_WINDOW, now, "zmq control transport "
                                     "warnings (a flood of hostile or failing connections?)")
        self._gate = InboundGate(options.handshake_timeout, self._on_gate_close)
        self._handshakes = 0
        """Handshake outcomes the listener reported so far (see :mod:`p2pkv_zmq.gate`)."""
        self._dial_failures = DialFailures()
        self._new: list[ZmqConnection] = []
        self._unflushed: list[ZmqConnection] = []
        """Connections with frames queued since the last flush (possibly repeated)."""
        self._closed = False
        self.counters = {"refused_handshakes": 0, "dropped_messages": 0, "accepted": 0,
                         "refused_accepts": 0, "inbound_timeouts": 0}

    # -- construction ---------------------------------------------------------------------

    @property
    def silence_timeout(self) -> float:
        """How long our peers tolerate hearing nothing from us (no PONG, no frame): the
        shorter of the TTL we announce and the heartbeat timeout (peers are configured alike)."""
        return min(self._options.heartbeat_ttl, self._options.heartbeat_timeout)

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
        plan, keys, sockets = self._plan, self._keys, self._sockets
        if keys is not None:  # before the listener exists, or libzmq admits everyone
            self._zap = ZapHandler(sockets.context, keys.allowed, self._on_zap_refusal)
            self._watch(self._zap.socket, self._zap.serve)
        listener = self._listener = sockets.listener(plan)
        self._listener_ready.register(listener, zmq.POLLIN)
        self._everything.register(listener, zmq.POLLIN)
        self._listener_fd = int(listener.getsockopt(zmq.FD))
        self._listener_monitor = sockets.monitor(listener, _LISTENER_EVENTS)
        self._watch(self._listener_monitor, self._on_listener_event)
        endpoint = sockets.bind(listener, plan)
        port = plan.advertise_port or int(endpoint.rsplit(":", 1)[1])
        self._local_address = format_address(plan.advertise_host, port)
        log.info("zmq control transport listening on %s as %s (%s)", endpoint,
                 self._local_address, "CURVE" if keys else "no authentication")

    def _watch(self, sock: zmq.Socket[bytes], handler: Callable[[], None]) -> None:
        self._sweeper.register(sock, zmq.POLLIN)
        self._everything.register(sock, zmq.POLLIN)
        self._handlers[sock] = handler

    def _unwatch(self, sock: zmq.Socket[bytes]) -> None:
        self._sweeper.unregister(sock)
        self._everything.unregister(sock)
        del self._handlers[sock]

    # -- the ControlTransport calls --------------------------------------------------------

    @property
    def local_address(self) -> str:
        return self._local_address

    def connect(self, address: str) -> ControlConnection:
        """The live connection to ``address``, else a new dial. A peer that dialed us is
        dialed back at once. Otherwise a host name is resolved here, once (blocking for the
        system resolver; IP literals skip it), and an address whose dial failed within
        ``DIAL_BACKOFF`` (1 s), or whose name does not resolve, gets a dead connection at once:
        ``close_reason`` says why ("no such host ...", "connection refused: ..."). A dial that
        fails later (refused, a failed or stalled handshake, ``connect_timeout``) dies on the
        poll that sees it, with its reason, and is remembered as well."""
        if self._closed:
            raise ConnectionClosed("the zmq control transport is closed")
        key = canonical_address(address)
        conn = self._by_address.get(key)
        if conn is not None:
            return conn
        answering = self._take_pending(key)  # the peer dialed us: it listens, dial it back
        peer = PeerAddress(key, address)
        if answering is not None:
            conn = self._dial(peer, answering, tcp_url(*parse_address(key)))
            self._confirm(conn, answering)
            return conn
        host, port = parse_address(key)
        now = time.monotonic()
        reason = self._dial_failures.recent(key, now)
        if reason is None:
            try:
                return self._dial(peer, None, tcp_url(resolve(host), port))
            except DialFailed as exc:
                reason = str(exc)
                self._dial_failures.record(key, reason, now)
                self._log_once(("dial", key, reason), "cannot dial %s: %s", key, reason)
        return ZmqConnection.failed(self, self._limits, peer, reason=reason)

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        """Frames (the hot path) are waited for with a plain receive on the PULL; the other
        sockets (connection monitors, ZAP, the PULL's monitor) and connect deadlines are swept
        every ``_SWEEP_INTERVAL``, so a poll costs the same with one peer or hundreds, and
        about what a raw pyzmq receive costs. libzmq waits in whole milliseconds; what is left
        below one is waited on the PULL's descriptor (``ZMQ_FD``, with ``select``), so a
        short ``timeout`` sleeps instead of spinning (never more than ``timeout``).

        Idle waits: while nothing is due (no dial connecting, no inbound connection before
        the gate's deadline), a wait of ``_SWEEP_INTERVAL`` or more is one wait on every
        socket at once, so an idle transport wakes only when a socket
        has something or ``timeout`` ends, not every ``_SWEEP_INTERVAL``."""
        if self._closed:
            return _EMPTY
        if self._unflushed:
            self.flush()
        now = time.monotonic()
        deadline = now + timeout
        while True:
            swept = now >= self._next_sweep and self._sweep(now)
            if not swept and deadline - now >= _SWEEP_INTERVAL and self._nothing_due():
                ready = self._everything.poll(int((deadline - now) * 1000))
                now = time.monotonic()
                swept = self._sweep(now, ready) | self._interrupted(ready)
            wait_ms = 0 if swept else min(int((deadline - now) * 1000), _SWEEP_MS)
            if self._read_listener(wait_ms) or swept:
                break
            now = time.monotonic()
            if now >= deadline:
                break
            if wait_ms <= 0:  # under a millisecond left: libzmq cannot wait that short
                select.select((self._listener_fd,), (), (), deadline - now)
                now = time.monotonic()
        new = self._new
        if not new:
            return _EMPTY
        self._new = []
        return new

    def batch_sends(self) -> bool:
        """From now on, ``send`` queues frames for :meth:`flush` (or the next ``poll``)."""
        self.batching = True
        return True

    def queued(self, conn: ZmqConnection) -> None:
        """``conn`` has frames for the next :meth:`flush`."""
        self._unflushed.append(conn)

    def flush(self) -> None:
        """Hand every connection's queued frames to libzmq (see
        :mod:`p2pkv_zmq.connection`); a connection whose libzmq queue is full keeps the rest
        for the next flush. Never blocks, never raises."""
        unflushed = self._unflushed
        if not unflushed:
            return
        self._unflushed = []
        for conn in unflushed:
            conn.push()  # one that keeps frames queues itself again

    def interrupt(self) -> None:
        """End an idle wait of ``poll`` now, or the next one at its start (any thread; see
        ``ControlTransport.interrupt``). A wait with a deadline due is at most
        ``_SWEEP_INTERVAL`` long and not interrupted."""
        try:
            self._wake_out.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def _interrupted(self, ready: list[tuple[Any, int]]) -> bool:
        """Whether ``ready`` holds an interrupt; consumes every pending one."""
        fd = self._wake_in.fileno()
        if not any(item == fd for item, _ in ready):
            return False
        with contextlib.suppress(BlockingIOError):
            while self._wake_in.recv(4096):
                pass
        return True

    def close(self) -> None:
        """Close every socket. Blocks at most ``_NOTICE_LINGER_MS`` for "gone" notices still
        undelivered (libzmq's context termination waits for lingering sockets)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        self._wake_in.close()
        self._wake_out.close()
        for conn in list(self._by_incarnation.values()):
            self.retire(conn, "transport closed", notify=False)
        for sock in (self._listener_monitor, self._zap.socket if self._zap else None):
            if sock is not None:
                sock.close(0)
        if self._listener is not None:
            self._listener.close(0)
        self._sockets.close()

    def stats(self) -> dict[str, int]:
        """Counters: refused handshakes, dropped messages, accepted connections, live ones."""
        return {**self.counters, "connections": len(self._by_incarnation)}

    # -- connections ----------------------------------------------------------------------

    def _dial(self, peer: PeerAddress, answering: bytes | None, url: str) -> ZmqConnection:
        """A new connection to ``peer`` dialing ``url`` (``answering``: the peer's fresh PUSH
        it answers). ``ResourceUnavailable`` when libzmq refuses the dial (out of sockets or
        descriptors); ``ConfigError`` for an address libzmq cannot dial."""
        incarnation = new_incarnation()
        link = link_id(self._local_address, incarnation)
        ref = b"" if answering is None else answering.rpartition(b"#")[2]
        push, monitor, queued = self._sockets.dial(peer.key, url, [link, b"", _OPEN, ref],
                                                   _LINK_EVENTS)
        deadline = time.monotonic() + self._options.connect_timeout
        conn = ZmqConnection(self, self._limits, peer, out=push, monitor=monitor,
                             incarnation=incarnation, link=link, deadline=deadline)
        self._by_address[peer.key] = conn
        self._by_incarnation[incarnation] = conn
        self._connecting.add(conn)
        self._watch(monitor, partial(self._on_link_event, conn))
        log.debug("dialing %s (%s)", peer.key, "answering" if answering else "fresh")
        if not queued:
            self.retire(conn, "could not open the link: libzmq had no pipe to the peer right "
                        "after connecting (handshake refused?)", notify=False)
        return conn

    def _confirm(self, conn: ZmqConnection, link: bytes) -> None:
        """The peer's PUSH ``link`` carries the peer's half of ``conn``; frames held for it
        are delivered, other offers of ``conn`` lapse."""
        conn.remote_link = link
        self._by_link[link] = conn
        opened = self._pending.pop(link, None)
        if opened is not None:
            conn.inbox.extend(opened.frames)
        self._withdraw_offers(conn)

    def _withdraw_offers(self, conn: ZmqConnection) -> None:
        for link in [k for k, o in self._pending.items() if o.offered is conn]:
            del self._pending[link]
            _remember(self._retired, link)
            self._tell_gone(link, via=conn)

    def _accept(self, link: bytes, address: str, frame: bytes) -> None:
        """The first frame of the fresh peer PUSH ``link``: a new connection dialing back,
        for the next ``poll`` to return with ``frame`` buffered (the newest connection to an
        address is what ``connect`` returns). Out of sockets, or with an address libzmq
        cannot dial, the PUSH is refused: told "gone", counted in ``refused_accepts``."""
        try:
            conn = self._dial(PeerAddress(address, address), link,
                              tcp_url(*parse_address(address)))
        except (ResourceUnavailable, ConfigError) as exc:
            _remember(self._retired, link)
            self.counters["refused_accepts"] += 1
            self._tell_gone(link)
            self._log_once(("accept",), "refused connections from peers: %s (a flood of "
                           "connections? counted in refused_accepts)", exc)
            return
        self._confirm(conn, link)
        self._new.append(conn)
        self.counters["accepted"] += 1
        conn.inbox.append(frame)

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn`` (idempotent): forget its ids, release its sockets. ``notify``: tell
        the peer on the connection's own PUSH (which lingers to deliver it); for a PUSH that
        can no longer reach the peer, callers tell its half with ``_tell_gone`` instead."""
        if conn.close_reason is not None:
            return
        conn.close_reason = reason
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
        link = conn.remote_link
        if link is not None:
            del self._by_link[link]
            _remember(self._retired, link)
        push, monitor = conn.out, conn.monitor
        conn.out = conn.monitor = None
        if push is not None and monitor is not None:
            self._unwatch(monitor)
            push.disable_monitor()
            monitor.close(0)
            if notify:
                target = b"" if link is None else link.rpartition(b"#")[2]
                if self._send_link(push, conn.link, _GONE, target) and link is not None:
                    _remember(self._told, link, time.monotonic())
                push.close(_NOTICE_LINGER_MS)
            else:
                push.close(0)
        log.debug("connection to %s ended: %s", conn.key, reason)

    def _take_pending(self, address: str) -> bytes | None:
        """The newest fresh PUSH of ``address`` that has not sent a frame yet, if any."""
        for link, opened in reversed(self._pending.items()):
            if opened.address == address and opened.offered is None:
                del self._pending[link]
                return link
        return None

    # -- outbound link messages -----------------------------------------------------------

    def _send_link(self, push: zmq.Socket[bytes], link: bytes, verb: bytes, arg: bytes) -> bool:
        """``[link, "", verb, arg]`` on ``push``, never blocking; False if it did not fit (the
        peer's heartbeats, timeouts and later frames still end what it was about)."""
        try:
            push.send_multipart([link, b"", verb, arg], _NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _tell_gone(self, link: bytes, via: ZmqConnection | None = None) -> None:
        """Tell the peer PUSH ``link`` (a valid link id) that its connection is gone, once:
        over ``via`` or our connection to its address, else over a notice PUSH (rate-limited;
        skipped, and logged once, beyond the rate). Only a message that went out counts as
        told, so the link's next frame tries again."""
        told = self._told.get(link)
        if told is not None and time.monotonic() - told < _RETELL_INTERVAL:
            return
        address, incarnation = link.rsplit(b"#", 1)
        key = address.decode("ascii")
        conn = via if via is not None else self._by_address.get(key)
        if conn is not None and conn.out is not None:
            if self._send_link(conn.out, conn.link, _GONE, incarnation):
                _remember(self._told, link, time.monotonic())
            return
        if self._notify(key, _GONE, incarnation):
            _remember(self._told, link, time.monotonic())

    def _answer_probe(self, address: str, nonce: bytes) -> None:
        """Tell the prober at ``address`` who we are (``identity``), over a notice PUSH."""
        if valid_nonce(nonce):
            answered = self._notify(address, IDENTITY,
                                    identity_answer(nonce, curve=self._keys is not None))
            log.debug("probe from %s: %s", address, "answered" if answered else "not answered")

    def _notify(self, key: str, verb: bytes, arg: bytes) -> bool:
        """``[our link, "", verb, arg]`` to ``key`` over a notice PUSH dialed for it
        (rate-limited; skipped, and logged once, beyond the rate); True if it went out."""
        if not self._notices.take(time.monotonic()):
            self._log_once(("notice-rate",), "not telling every stale peer connection it is "
                           "gone: more than %s notices a second (a flood of stale frames?)",
                           _NOTICE_RATE)
            return False
        try:
            push = self._sockets.push(key)
        except ResourceUnavailable:
            return False  # out of sockets: the peer's own timeouts end its connection
        sent = False
        try:
            push.connect(tcp_url(*parse_address(key)))
            sent = self._send_link(push, link_id(self._local_address, new_incarnation()), verb,
                                   arg)
        except zmq.ZMQError:
            pass  # an address libzmq cannot dial: nobody there to tell
        push.close(_NOTICE_LINGER_MS)
        return sent

    # -- inbound --------------------------------------------------------------------------

    def _read_listener(self, wait_ms: int) -> bool:
        """Receive what the PULL holds, waiting up to ``wait_ms`` for the first message, at
        most ``_MAX_MESSAGES_PER_POLL`` (fairness: the rest waits for the next poll); True if
        anything came.

        Costs are pyzmq's, per call: a blocking receive with a timeout for the wait; after the
        first message a one-socket zero-timeout poll asks for more (cheapest when there is
        none: a ``zmq.Again`` costs about 2.5x that), and a burst is drained until one
        ``zmq.Again`` (cheaper than a poll per message)."""
        part = self._first_message(wait_ms)
        if part is None:
            return False
        listener = self._listener
        assert listener is not None
        recv, more = listener.recv, self._listener_ready.poll
        by_link = self._by_link
        count = 1
        while True:  # parts as frames: ``Frame.more`` costs far less than a RCVMORE getsockopt
            link = part.bytes
            if not part.more:  # one part: no link id before it
                self._drop(link, "a message of one part (not a p2pkv zmq peer?)", notify=None)
            else:
                part = recv(_NOBLOCK, copy=False)
                if part.more:
                    self._on_link_message(link, part.bytes)
                else:
                    conn = by_link.get(link)
                    if conn is not None:
                        conn.inbox.append(part.bytes)
                    else:
                        self._on_unrouted([link, part.bytes])
            if count == _MAX_MESSAGES_PER_POLL:
                return True
            if count == 1 and not more(0):
                return True
            try:
                part = recv(_NOBLOCK, copy=False)
            except zmq.Again:
                return True
            count += 1

    def _first_message(self, wait_ms: int) -> zmq.Frame | None:
        """The first part of a message from the PULL, waiting up to ``wait_ms`` (a receive
        with a timeout); with ``wait_ms`` <= 0 only if one is waiting (a zero-timeout poll,
        since libzmq cannot wait shorter than a millisecond); None if none came."""
        listener = self._listener
        assert listener is not None
        if wait_ms <= 0:
            return listener.recv(_NOBLOCK, copy=False) if self._listener_ready.poll(0) else None
        if wait_ms != self._rcvtimeo:  # mostly _SWEEP_MS, so rarely re-set
            listener.setsockopt(_RCVTIMEO, wait_ms)
            self._rcvtimeo = wait_ms
        try:
            return listener.recv(copy=False)
        except zmq.Again:
            return None

    def _on_link_message(self, link: bytes, first: bytes) -> None:
        """A message of three parts or more, the rest still to read: link messages (rare).
        Read as frames, which name the TCP connection they came over (``ZMQ_SRCFD``)."""
        assert self._listener is not None
        rest = self._listener.recv_multipart(_NOBLOCK, copy=False)
        self._on_unrouted([link, first, *(frame.bytes for frame in rest)],
                          fd=rest[-1].get(_SRCFD))

    def _on_unrouted(self, parts: list[bytes], fd: int | None = None) -> None:
        """A message that is not payload of a paired connection; ``fd``: the descriptor of
        the TCP connection a link message came over, which a well-formed one proves to the
        gate (every dialing socket of a p2pkv peer starts with one: open, paired, gone)."""
        link = parts[0]
        verb = _verb(parts)
        if verb is None:
            self._drop(link, "malformed message (not a p2pkv zmq peer?)", notify=None)
            return
        parsed = parse_link_id(link)
        if parsed is None:
            self._drop(link, "malformed link id (not a p2pkv zmq peer?)", notify=None)
            return
        if fd is not None:
            self._admit(fd)
        if verb == PROBE:
            self._answer_probe(parsed[0], parts[3])
        elif verb in (_PAIRED, _GONE):
            self._on_notice(link, verb, parts[3])
        elif link in self._retired:  # its connection ended; the peer may not know yet
            # Normal at every close (frames in flight cross our close): not worth a warning.
            self._drop(link, "frames for a connection that has ended", notify=link,
                       level=logging.DEBUG)
        elif link in self._by_link:
            pass  # the open of an answered PUSH came after its pairing
        elif verb == _OPEN:
            self._on_open(link, parsed[0], parts[3])
        else:
            self._on_early_frame(link, parsed[0], parts[1])

    def _on_early_frame(self, link: bytes, address: str, frame: bytes) -> None:
        """Payload from the peer PUSH ``link`` of ``address`` that is in no connection of ours:
        the first frame of a fresh PUSH is accepted, a PUSH we offered a pairing has its frames
        held (up to ``_MAX_HELD_FRAMES``, then it is retired), and any other is told "gone"."""
        opened = self._pending.get(link)
        if opened is None:
            self._drop(link, "frames from a peer connection that never opened to this "
                       "transport (a stale reconnect after a restart?)", notify=link)
        elif opened.offered is None:
            del self._pending[link]
            self._accept(link, address, frame)
        elif len(opened.frames) < _MAX_HELD_FRAMES:
            opened.frames.append(frame)  # until the peer pairs too
        else:
            del self._pending[link]
            _remember(self._retired, link)
            self._drop(link, "too many frames before the peer confirmed the pairing",
                       notify=link)

    def _on_open(self, link: bytes, address: str, ref: bytes) -> None:
        if ref:  # the peer answers one of our PUSHes
            conn = self._by_incarnation.get(ref)
            if conn is None:
                self._tell_gone(link)  # we already retired that connection
            elif conn.remote_link is None:
                if conn.key != address:  # matched by incarnation, so still one connection
                    self._log_once(("alias", conn.key, address),
                                   "peer dialed as %s presents itself as %s; dial the address "
                                   "it advertises, or set its 'advertise' option", conn.key,
                                   address)
                self._confirm(conn, link)
            else:
                self._tell_gone(link, via=conn)
                self.retire(conn, "the peer replaced its end of the connection")
            return
        conn = self._by_address.get(address)
        if conn is not None and conn.remote_link is None and conn.out is not None:
            self._pending[link] = _Opened(address, offered=conn)  # we dialed each other at once
            self._send_link(conn.out, conn.link, _PAIRED, link.rpartition(b"#")[2])
        else:  # a completed connection to that address stays (see the module docstring)
            self._pending[link] = _Opened(address)
        while len(self._pending) > _MEMORY:
            self._pending.popitem(last=False)

    def _on_notice(self, link: bytes, verb: bytes, incarnation: bytes) -> None:
        """``paired`` or ``gone`` from the peer PUSH ``link`` (a valid link id)."""
        if not incarnation:  # "gone": the sender's own PUSH closed before it was paired
            if verb == _GONE:
                self._pending.pop(link, None)
                _remember(self._retired, link)
                _remember(self._told, link, time.monotonic())
                conn = self._by_link.get(link)
                if conn is not None:
                    self.retire(conn, "closed by the peer", notify=False)
            else:
                self._drop(link, "malformed pairing (no incarnation)", notify=None)
            return
        conn = self._by_incarnation.get(incarnation)
        if conn is None:
            if incarnation not in self._retired:
                self._drop(link, "a link message for a connection this transport never had",
                           notify=None)
            return
        if verb == _GONE:
            if conn.remote_link is not None:
                _remember(self._told, conn.remote_link, time.monotonic())  # it knows
            self.retire(conn, "closed by the peer", notify=False)
        elif link in self._by_link:
            pass  # paired with another connection of ours: the offer lapses by itself
        elif conn.remote_link is None and link not in self._retired:
            offer = self._pending.get(link)
            self._confirm(conn, link)
            if (offer is None or offer.offered is not conn) and conn.out is not None:
                # We had not offered ours (its open came first on this stream): pair back.
                self._send_link(conn.out, conn.link, _PAIRED, link.rpartition(b"#")[2])
        elif conn.remote_link != link:
            self._tell_gone(link, via=conn)  # ours is paired otherwise: the offer lapses

    def _drop(
        self, link: bytes, why: str, *, notify: bytes | None, level: int = logging.WARNING
    ) -> None:
        """Count and log (once per sender id) a dropped message; ``notify``: a valid link id
        to tell "gone"."""
        self.counters["dropped_messages"] += 1
        if notify is not None:
            self._tell_gone(notify)
        self._log_once(("drop", link[:MAX_LINK_ID_BYTES]), "dropped a message from %r: %s",
                       link[:64], why, level=level)

    # -- events ---------------------------------------------------------------------------

    def _on_link_event(self, conn: ZmqConnection) -> None:
        while conn.monitor is not None:
            try:
                event = parse_monitor_message(conn.monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            kind = event["event"]
            if kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._connecting.discard(conn)
            elif kind == zmq.EVENT_DISCONNECTED and conn in self._connecting:
                self._dial_failed(conn, foreign_listener_reason(conn.key))  # no outcome came
            elif kind == zmq.EVENT_DISCONNECTED:  # after the handshake (a failure comes first)
                link = conn.remote_link
                self.retire(conn, "disconnected (peer closed, crashed or silent)", notify=False)
                if link is not None:  # its half may live on (say, it refused our frame size)
                    self._tell_gone(link)
            elif kind == zmq.EVENT_CONNECT_RETRIED:  # the TCP connect failed
                dialed_us = conn.remote_link is not None
                self._dial_failed(conn, refused_reason(conn.key, dialed_us=dialed_us))
            elif kind & _HANDSHAKE_FAILED:
                self._dial_failed(conn, handshake_reason(
                    conn.key, kind, int(event["value"]), curve=self._keys is not None,
                    timeout=self._options.handshake_timeout))

    def _dial_failed(self, conn: ZmqConnection, reason: str) -> None:
        """``conn`` died before its handshake completed: retired with ``reason``, which the
        next dials to its address get at once for ``DIAL_BACKOFF``; logged once per address
        and cause."""
        self._dial_failures.record(conn.key, reason, time.monotonic())
        self._log_once(("dial", conn.key, reason), "connection to %s failed: %s", conn.key,
                       reason)
        self.retire(conn, reason, notify=False)

    def _on_listener_event(self) -> None:
        """Drain the listener's monitor: accepted and ended TCP connections (by descriptor)
        for the gate, refused handshakes for the counters and the log."""
        assert self._listener_monitor is not None
        while True:
            try:
                event = parse_monitor_message(self._listener_monitor.recv_multipart(_NOBLOCK))
            except zmq.Again:
                return
            kind, value = event["event"], int(event["value"])
            if kind == zmq.EVENT_ACCEPTED:
                self._gate.accepted(value, time.monotonic(), self._handshakes)
            elif kind == zmq.EVENT_DISCONNECTED:
                refused = self._gate.ended(value, self._handshakes)
                if refused is not None:
                    self.counters["refused_handshakes"] += 1
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
            self._log_once(("listen", "ended"), "an inbound connection ended in its zmq "
                           "handshake (%s): a TCP probe, a client that left, or a zmq peer of "
                           "another kind; %s", os.strerror(value), FOREIGN_PEER,
                           level=logging.INFO)
        elif kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
            self.counters["refused_handshakes"] += 1
            self._log_once(("listen", value), "refused an inbound connection: security "
                           "handshake failed: %s", protocol_failure(value))

    def _admit(self, fd: int) -> None:
        """A well-formed link message came over the inbound TCP connection ``fd``. libzmq
        reported its accept before reading from it, so the monitor is drained first: the gate
        then knows the connection, and lets it be."""
        self._on_listener_event()
        self._gate.admit(fd)

    def _on_gate_close(self, peer: str) -> None:
        self.counters["inbound_timeouts"] += 1
        self._log_once(("gate", peer.rpartition(":")[0]), "closed an inbound connection from "
                       "%s: no well-formed p2pkv message within handshake_timeout %g s (not a "
                       "p2pkv zmq peer?)", peer, self._gate.timeout)

    def _on_zap_refusal(self, host: str, client: str) -> None:
        self.counters["refused_handshakes"] += 1
        self._log_once(("zap", host, client),
                       "refused a connection from %s: client key %s is not in "
                       "allowed_client_keys", host, client)

    def _sweep(self, now: float, ready: list[tuple[Any, int]] | None = None) -> bool:
        """Handle every watched socket with something to read (``ready``: what a poll of
        every socket just found, the PULL too), then the deadlines; True if any socket had
        something. The gate closes a connection only once it was due at the previous sweep:
        a read of the PULL came after its deadline, so a first message waiting there (say
        after a long pause between polls) admits it first."""
        previous = self._next_sweep - _SWEEP_INTERVAL
        self._next_sweep = now + _SWEEP_INTERVAL
        if ready is None:
            ready = self._sweeper.poll(0)
        for sock, _ in ready:
            handler = self._handlers.get(sock)
            if handler is not None:  # None: unwatched by an earlier handler
                handler()
        if self._connecting:
            self._expire_connects(now)
        if self._gate.pending:
            self._gate.expire(previous)
        self._log_limit.flush(now)
        return bool(ready)

    def _nothing_due(self) -> bool:
        """No deadline a sweep must keep: no dial connecting, no inbound connection waiting
        for its first message (the log limiter's summary line may come late)."""
        return not self._connecting and not self._gate.pending

    def _expire_connects(self, now: float) -> None:
        timeout = self._options.connect_timeout
        for conn in [c for c in self._connecting if c.deadline <= now]:
            self._dial_failed(conn, f"not connected within connect_timeout ({timeout:g} s): "
                              f"no answer from {conn.key}")

    def _log_once(
        self, key: Hashable, msg: str, *args: object, level: int = logging.WARNING
    ) -> None:
        """Log once per ``key`` (per peer or cause, never per frame or reconnect attempt),
        and at most ``_LOG_BURST`` lines per ``_LOG_WINDOW`` in all, the rest counted in one
        summary line: keys a hostile peer chooses (link ids, claimed addresses, its host)
        cannot flood the log."""
        if key in self._logged:
            return
        _remember(self._logged, key)
        self._log_limit.log(time.monotonic(), level, msg, *args)


def _verb(parts: list[bytes]) -> bytes | None:
    """What a message on the PULL is (see the module docstring): ``_PAYLOAD`` for
    ``[link, frame]``, the verb of ``[link, "", verb, arg]``, None for anything else."""
    if len(parts) == 2:
        return _PAYLOAD
    if len(parts) == 4 and parts[1] == b"" and parts[2] in _VERBS:
        return parts[2]
    return None


def _remember(memory: OrderedDict[Any, Any], key: Hashable, value: Any = None) -> None:
    """Record ``key`` (with ``value``) in a bounded memory, newest last; the oldest entry
    goes once it holds more than ``_MEMORY``."""
    memory[key] = value
    memory.move_to_end(key)
    if len(memory) > _MEMORY:
        memory.popitem(last=False)

