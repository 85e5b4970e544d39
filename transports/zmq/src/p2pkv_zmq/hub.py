"""The hub of one ``zmq`` control transport: a facade over four roles, and the sockets of
its connections.

- :class:`~p2pkv_zmq.pairing.LinkPairing`: the link-pairing protocol (its rules and wire
  shapes are stated there), with no I/O. The hub is its :class:`~p2pkv_zmq.pairing.LinkPort`.
- :class:`~p2pkv_zmq.poller.Poller`: the event loop. The PULL is read on the hot path; the
  other sockets and the timers are swept every 10 ms, visiting only what is ready or due.
- :class:`~p2pkv_zmq.monitors.SocketMonitors`: what libzmq reports about our sockets (dial
  progress and failures, disconnects, the listener's gate, ZAP refusals).
- :class:`~p2pkv_zmq.dials.LinkDials`: a new dial's sockets and connection, after a reach
  check during a flood of dials that reach nothing (:mod:`p2pkv_zmq.reach`).

Sockets (all in the transport's own ``zmq.Context``, all used only from the driver thread):
one PULL bound at our address (every peer's frames come in here), one PUSH per connection
dialing the peer's PULL (our frames go out there), one monitor PAIR per PUSH and one for the
PULL, the ZAP handler with CURVE, and short-lived notice PUSH sockets (below). No socket of
ours is a ROUTER: libzmq 4.3.5 files a ROUTER's inbound connections under the routing id each
client announces, and a client reusing or squatting ids made it keep dead connections or
abort. A PULL has no ids at all.

Telling a peer link "gone" goes over a PUSH of ours to that address when one exists, else over
a notice PUSH dialed for that one message (``LINGER`` ``_NOTICE_LINGER_MS``, then libzmq drops
it). Notices are rate-limited (``_NOTICE_RATE`` per second, bursts of as many). A message that
fails validation never makes us dial. Our own close sends "gone" on the connection's PUSH,
which lingers as long to deliver it; a dial that never connected closes at once (its peer
never saw it, and a flood of such dials would keep ``max_sockets`` full).

``p2pkv probe`` sends ``[link, "", "probe", nonce]`` (:mod:`p2pkv_zmq.probe_wire`): the hub
answers ``identity`` over a notice PUSH to ``link``'s address (same rate limit), opens no
connection and logs at DEBUG only.

Liveness: a connection dies when its PUSH disconnects (the peer closed its listener, crashed,
or missed heartbeats; the peer's half is then told "gone"), gets "gone", or its dial fails:
the first refused TCP connect (libzmq retries; we do not: nothing listens, or a peer that just
dialed us is gone), a failed handshake (named: a CURVE mismatch, a key the peer does not
allow), one not done within ``handshake_timeout``, or no connection within
``connect_timeout``. A failed dial is remembered (:mod:`p2pkv_zmq.dialing`), and a host name
that does not resolve fails at ``connect``. During a flood of dials that reach nothing, a
fresh dial checks TCP reach before it gets sockets (:mod:`p2pkv_zmq.reach`). A death shows
within a sweep of libzmq reporting it; ``close_reason`` says why. Only PUSH sockets send
ZMTP heartbeats (why: :mod:`p2pkv_zmq.sockets`).

Hostile bytes on the listening port: the PULL has a ZAP domain even without CURVE (libzmq then
refuses ZMTP 1.0/2.0 peers, which any stray bytes pass for, at once) and
``ZMQ_HANDSHAKE_IVL`` = ``handshake_timeout`` (a greeting or handshake cut short is closed by
libzmq); a connection past its handshake that sends no well-formed link message within the
same time is shut down by the gate (:mod:`p2pkv_zmq.gate`). Warnings are logged once per key
and rate-limited in all (``_LOG_BURST`` per ``_LOG_WINDOW``, then a summary line), so
hostile input cannot flood the log.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Hashable, Sequence

import zmq
from p2pkv.addressing import format_address, parse_address
from p2pkv.contracts import ControlConnection, SessionRoom
from p2pkv.errors import ConfigError, ConnectionClosed, ResourceUnavailable
from p2pkv.logs import module_logger
from p2pkv.ratelimit import LogLimiter, TokenBucket

from p2pkv_zmq.connection import DIALING, LinkLimits, PeerAddress, ZmqConnection
from p2pkv_zmq.dialing import DialFailed, DialFailures, resolve
from p2pkv_zmq.dials import LinkDials
from p2pkv_zmq.identity import (
    MAX_LINK_ID_BYTES,
    canonical_address,
    link_id,
    new_incarnation,
    tcp_url,
)
from p2pkv_zmq.listening import ListenPlan
from p2pkv_zmq.monitors import LISTENER_EVENTS, SocketMonitors
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.pairing import GONE, MEMORY, LinkPairing, classify
from p2pkv_zmq.poller import Poller, Readiness
from p2pkv_zmq.probe_wire import IDENTITY, identity_answer, probe_request
from p2pkv_zmq.security import CurveKeys
from p2pkv_zmq.sockets import SocketFactory
from p2pkv_zmq.zap import ZapHandler

__all__ = ["ZmqHub"]

log = module_logger(__name__)

_NOBLOCK = zmq.NOBLOCK
_NOTICE_RATE = 20.0  # notice dials per second (and the largest burst)
_NOTICE_LINGER_MS = 500  # how long a closed PUSH keeps trying to deliver its last message
_LOG_BURST = 20  # warnings logged at once, and per _LOG_WINDOW on average ...
_LOG_WINDOW = 10.0  # ... beyond that, one "suppressed K" line per this many seconds
_EMPTY: Sequence[ControlConnection] = ()


class ZmqHub:
    """The hub of one listening ``zmq`` control transport (see the module docstring): owned
    by a :class:`~p2pkv_zmq.transport.ZmqControlTransport`, which builds it with :meth:`open`
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
        self.counters = {
            "refused_handshakes": 0,
            "dropped_messages": 0,
            "accepted": 0,
            "refused_accepts": 0,
            "inbound_timeouts": 0,
        }
        self.pairing = LinkPairing(self, self.counters)
        self.poller: Poller | None = None
        self._readiness: Readiness | None = None
        self.monitors: SocketMonitors | None = None
        self._dials: LinkDials | None = None
        self._listener: zmq.Socket[bytes] | None = None
        self._listener_monitor: zmq.Socket[bytes] | None = None
        self._zap: ZapHandler | None = None
        self._local_address = ""
        now = time.monotonic()
        self._notices = TokenBucket(_NOTICE_RATE, _NOTICE_RATE, now)
        self._logged: OrderedDict[Hashable, None] = OrderedDict()
        self._log_limit = LogLimiter(
            log,
            _LOG_BURST,
            _LOG_WINDOW,
            now,
            "zmq control transport warnings (a flood of hostile or failing connections?)",
        )
        self._dial_failures = DialFailures()
        self._unflushed: list[ZmqConnection] = []
        """Connections with frames queued since the last flush (possibly repeated)."""
        self._closed = False

    # -- construction ---------------------------------------------------------------------------

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
        readiness = self._readiness = Readiness()
        monitors = self.monitors = SocketMonitors(
            readiness,
            self,
            self._options,
            curve=keys is not None,
            counters=self.counters,
            log_once=self._log_once,
        )
        self._dials = LinkDials(
            self, sockets, self._options, self._limits, (self.pairing, monitors, readiness)
        )
        if keys is not None:  # before the listener exists, or libzmq admits everyone
            self._zap = ZapHandler(sockets.context, keys.allowed, monitors.on_zap_refusal)
            readiness.watch(self._zap.socket, self._zap.serve)
        listener = self._listener = sockets.listener(plan)
        self.poller = Poller(
            readiness,
            listener,
            self.pairing.routes,
            self.pairing.news,
            self._on_unrouted,
            (self._on_sweep, monitors.next_due),
        )
        self._listener_monitor = sockets.monitor(listener, LISTENER_EVENTS)
        monitors.watch_listener(self._listener_monitor)
        endpoint = sockets.bind(listener, plan)
        port = plan.advertise_port or int(endpoint.rsplit(":", 1)[1])
        self._local_address = format_address(plan.advertise_host, port)
        log.info(
            "zmq control transport listening on %s as %s (%s)",
            endpoint,
            self._local_address,
            "CURVE" if keys else "no authentication",
        )

    # -- the ControlTransport calls -------------------------------------------------------------

    @property
    def local_address(self) -> str:
        return self._local_address

    def connect(self, address: str) -> ControlConnection:
        """The live connection to ``address``, else a new dial. A peer that dialed us is
        dialed back at once. Otherwise a host name is resolved here, once (blocking for the
        system resolver; IP literals skip it), and an address whose dial failed recently
        (:class:`~p2pkv_zmq.dialing.DialFailures`), or whose name does not resolve, gets a
        dead connection at once: ``close_reason`` says why ("no such host ...", "connection
        refused: ..."). A dial that fails later (refused, a failed or stalled handshake,
        ``connect_timeout``) dies on the poll that sees it, with its reason, and is
        remembered as well. Repeated calls while a dial is pending return it: they cost no
        socket."""
        if self._closed:
            raise ConnectionClosed("the zmq control transport is closed")
        dials = self._dials
        assert dials is not None  # set once listening
        key = canonical_address(address)
        conn = self.pairing.connection_to(key)
        if conn is not None:
            return conn
        answering = self.pairing.answerable(key)  # the peer dialed us: it listens, dial back
        peer = PeerAddress(key, address)
        if answering is not None:
            conn = dials.dial(peer, answering, tcp_url(*parse_address(key)))
            self.pairing.confirm(conn, answering, time.monotonic())
            return conn
        host, port = parse_address(key)
        now = time.monotonic()
        reason = self._dial_failures.recent(key, now)
        if reason is None:
            try:
                return dials.fresh(peer, resolve(host), port, now)
            except DialFailed as exc:
                reason = str(exc)
                self._dial_failures.record(key, reason, now)
                self._log_once(("dial", key, reason), "cannot dial %s: %s", key, reason)
        conn = ZmqConnection.failed(self, self._limits, peer, reason=reason)
        self.pairing.news(conn)
        return conn

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        """Frames are waited for with a plain receive on the PULL; the other sockets and the
        timers are swept every 10 ms, visiting only those ready or due, so a poll costs the
        same with one peer or a thousand (:mod:`p2pkv_zmq.poller`). An idle transport waits
        on every socket at once and wakes only when one has something, a timer falls due or
        ``timeout`` ends."""
        if self._closed or self.poller is None:
            return _EMPTY
        if self._unflushed:
            self.flush()
        self.poller.poll(timeout)
        accepted = self.pairing.accepted
        if not accepted:
            return _EMPTY
        self.pairing.accepted = []
        return accepted

    def take_active(self) -> list[ZmqConnection] | None:
        """The connections that, since the previous call, received frames or stopped being
        alive, each listed once (``ControlTransport.take_active``). None only when news
        piled up far beyond the live connections (a caller that stopped calling): then visit
        every connection. Driver thread, after ``poll``."""
        return self.pairing.take_active()

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

    def forget_dial_failure(self, address: str) -> None:
        """The next dial to ``address`` is a real one, even within the
        :class:`~p2pkv_zmq.dialing.DialFailures` backoff of a failed one (the tier's
        pre-connect dials: ``ControlTransport.forget_dial_failure``)."""
        self._dial_failures.forget(canonical_address(address))

    def interrupt(self) -> None:
        """End an idle wait of ``poll`` now, or the next one at its start (any thread; see
        ``ControlTransport.interrupt``)."""
        if self.poller is not None:
            self.poller.interrupt()

    def close(self) -> None:
        """Close every socket. Blocks at most ``_NOTICE_LINGER_MS`` for "gone" notices still
        undelivered (libzmq's context termination waits for lingering sockets)."""
        if self._closed:
            return
        self.flush()
        self._closed = True
        for conn in self.pairing.live():
            self.retire(conn, "transport closed", notify=False)
        if self._dials is not None:
            self._dials.reach.close()
        if self.poller is not None:
            self.poller.close()
        if self._readiness is not None:
            self._readiness.close()
        for sock in (
            self._listener_monitor,
            self._zap.socket if self._zap else None,
            self._listener,
        ):
            if sock is not None:
                sock.close(0)
        self._sockets.close()

    def stats(self) -> dict[str, int]:
        """Counters: refused handshakes, dropped messages, accepted connections, live ones."""
        return {**self.counters, "connections": len(self.pairing)}

    def session_room(self) -> SessionRoom:
        """Sessions the context's socket cap holds in all (3 sockets each, after the
        transport's own), and those still free beside the live connections. Connections
        retired with a notice in flight hold their PUSH a little longer than counted."""
        total = self._sockets.cap.sessions
        return SessionRoom(max(0, total - len(self.pairing)), total)

    # -- connections (the LinkPort and MonitorOwner sides) -------------------------------------

    def dial_back(self, address: str, link: bytes) -> ZmqConnection | None:
        """Accept the fresh peer PUSH ``link`` by dialing ``address`` back. Out of sockets, or
        with an address libzmq cannot dial, None: counted in ``refused_accepts``."""
        try:
            assert self._dials is not None  # set once listening
            url = tcp_url(*parse_address(address))
            return self._dials.dial(PeerAddress(address, address), link, url)
        except (ResourceUnavailable, ConfigError) as exc:
            self.counters["refused_accepts"] += 1
            self._log_once(
                ("accept",),
                "refused connections from peers: %s (a flood of connections, or more "
                "peers than the zmq context holds at 3 sockets a session? its cap, %s, "
                "is %s; counted in refused_accepts)",
                exc,
                self._sockets.cap.value,
                self._sockets.cap.source,
            )
            return None

    def retire(self, conn: ZmqConnection, reason: str, *, notify: bool = True) -> None:
        """End ``conn`` (idempotent): forget its ids, release its sockets. ``notify``: tell
        the peer on the connection's own PUSH (which lingers to deliver it); for a PUSH that
        can no longer reach the peer, callers tell its half with ``tell_gone`` instead.
        Without ``notify`` the PUSH closes at once (``LINGER`` 0), so offers it withdraws
        are told "gone" by other ways (``pairing.tell_gone``), never queued on it. A fresh
        dial that never connected is never notified: its peer never saw it, and a lingering
        socket to a black-holed address would hold one of ``max_sockets`` for nothing."""
        if conn.close_reason is not None:
            return
        conn.close_reason = reason
        if self._dials is not None:
            self._dials.reach.drop(conn)
        now = time.monotonic()
        if conn.progress == DIALING and conn.remote_link is None:
            notify = False
            if self._dials is not None:
                self._dials.reach.fruitless(now)
        push, monitor = conn.out, conn.monitor
        if not notify:
            conn.out = None
        link = self.pairing.forget(conn, now)
        conn.out = conn.monitor = None
        if push is not None and monitor is not None:
            if self.monitors is not None:
                self.monitors.release(monitor)
            push.disable_monitor()
            monitor.close(0)
            if notify:
                target = b"" if link is None else link.rpartition(b"#")[2]
                if self._send(push, conn.link, GONE, target) and link is not None:
                    self.pairing.mark_told(link, now)
                push.close(_NOTICE_LINGER_MS)
            else:
                push.close(0)
        log.debug("connection to %s ended: %s", conn.key, reason)

    def dial_failed(self, conn: ZmqConnection, reason: str) -> None:
        """``conn`` died before its handshake completed: retired with ``reason``, which the
        next dials to its address get at once while it is remembered; logged once per
        address and cause."""
        self._dial_failures.record(conn.key, reason, time.monotonic())
        if self._dials is not None:
            self._dials.reach.forget(conn.key)
        self._log_once(("dial", conn.key, reason), "connection to %s failed: %s", conn.key, reason)
        self.retire(conn, reason, notify=False)

    def tell_gone(self, link: bytes) -> None:
        self.pairing.tell_gone(link, time.monotonic())

    def send_link(self, conn: ZmqConnection, verb: bytes, arg: bytes) -> bool:
        return conn.out is not None and self._send(conn.out, conn.link, verb, arg)

    def notice(self, address: str, incarnation: bytes) -> bool:
        """A "gone" for ``address``'s PUSH of ``incarnation`` over a PUSH dialed for it
        (rate-limited; skipped, and logged once, beyond the rate)."""
        return self._notify(address, GONE, incarnation)

    def _notify(self, address: str, verb: bytes, arg: bytes) -> bool:
        """``[our link, "", verb, arg]`` over a PUSH dialed to ``address`` for that one
        message (rate-limited: :meth:`notice`)."""
        if not self._notices.take(time.monotonic()):
            self._log_once(
                ("notice-rate",),
                "not telling every stale peer connection it is "
                "gone: more than %s notices a second (a flood of stale frames?)",
                _NOTICE_RATE,
            )
            return False
        try:
            push = self._sockets.push(address)
        except ResourceUnavailable:
            return False  # out of sockets: the peer's own timeouts end its connection
        try:
            push.connect(tcp_url(*parse_address(address)))
            sent = self._send(push, link_id(self._local_address, new_incarnation()), verb, arg)
        except zmq.ZMQError:
            sent = False  # an address libzmq cannot dial: nobody there to tell
        push.close(_NOTICE_LINGER_MS)
        return sent

    def dropped(self, link: bytes, why: str, level: int = logging.WARNING) -> None:
        """Count and log (once per sender id) a dropped message."""
        self.counters["dropped_messages"] += 1
        self._log_once(
            ("drop", link[:MAX_LINK_ID_BYTES]),
            "dropped a message from %r: %s",
            link[:64],
            why,
            level=level,
        )

    def warn_once(self, key: Hashable, msg: str, *args: object) -> None:
        self._log_once(key, msg, *args)

    # -- what the poller hands over -------------------------------------------------------------

    def _on_unrouted(self, parts: list[bytes], fd: int | None) -> None:
        """A message that is not payload of a paired connection; ``fd``: the descriptor of
        the TCP connection a link message came over, which a well-formed one proves to the
        gate (every dialing socket of a p2pkv peer starts with one: open, paired, gone)."""
        probe = probe_request(parts)
        kind = classify(parts) if probe is None else probe
        if isinstance(kind, str):
            self.dropped(parts[0], kind)
            return
        if fd is not None and self.monitors is not None:
            self.monitors.admit(fd)
        if probe is None:
            self.pairing.on_message(parts, kind[0], kind[1], time.monotonic())
        else:
            self._answer_probe(kind[1], parts[3])

    def _answer_probe(self, address: str, nonce: bytes) -> None:
        """Tell the prober at ``address`` who we are; no connection, DEBUG only."""
        answer = identity_answer(nonce, curve=self._keys is not None)
        sent = self._notify(address, IDENTITY, answer)
        log.debug("probe from %s: %s", address, "answered" if sent else "not answered")

    def _on_sweep(self, now: float, previous: float) -> int:
        assert self.monitors is not None
        examined = self.monitors.on_sweep(now, previous)
        self._log_limit.flush(now)
        return examined

    @staticmethod
    def _send(push: zmq.Socket[bytes], link: bytes, verb: bytes, arg: bytes) -> bool:
        """``[link, "", verb, arg]`` on ``push``, never blocking; False if it did not fit (the
        peer's heartbeats, timeouts and later frames still end what it was about)."""
        try:
            push.send_multipart([link, b"", verb, arg], _NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _log_once(
        self, key: Hashable, msg: str, *args: object, level: int = logging.WARNING
    ) -> None:
        """Log once per ``key`` (per peer or cause, never per frame or reconnect attempt),
        and at most ``_LOG_BURST`` lines per ``_LOG_WINDOW`` in all, the rest counted in one
        summary line: keys a hostile peer chooses (link ids, claimed addresses, its host)
        cannot flood the log."""
        if key in self._logged:
            return
        self._logged[key] = None
        if len(self._logged) > MEMORY:
            self._logged.popitem(last=False)
        self._log_limit.log(time.monotonic(), level, msg, *args)
