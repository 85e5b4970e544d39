"""The socket factory of one ``zmq`` control transport: creates and tunes every socket in the
transport's own ``zmq.Context`` and turns libzmq's refusals into p2pkv errors; knows nothing
of links or connections (:mod:`p2pkv_zmq.hub` does).

Every socket gets ``LINGER`` 0 (a caller that wants a last message delivered closes it with a
linger) and ``IPV6`` for an IPv6 peer or bind address. A monitor gets a fresh
``inproc://p2pkv-monitor-<n>`` every time (libzmq frees inproc names asynchronously).

Only PUSH sockets send ZMTP heartbeats: the PULL answers PINGs, and libzmq drops an inbound TCP
connection that stays silent past the TTL its peer's PINGs carry. The listener runs no
heartbeat timer of its own: in libzmq 4.3.5 that timer fires on a connection whose input
stopped (pipe full) after its peer hung up, and aborts the process (``!_io_error``,
stream_engine_base.cpp:310), so any client could kill us by overfilling its pipe and
resetting.
"""

from __future__ import annotations

import errno
import itertools
import os
import resource
from typing import NamedTuple

import zmq
from p2pkv.addressing import format_address, parse_address
from p2pkv.errors import ConfigError, P2PKVError, ResourceUnavailable

from p2pkv_zmq.identity import is_ipv6_literal, tcp_url
from p2pkv_zmq.listening import ListenPlan
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.security import CurveKeys
from p2pkv_zmq.socket_cap import socket_cap

_DESCRIPTOR_MARGIN = 16
"""Descriptors below the process limit at which running out counts as the process's limit."""

__all__ = ["LinkSockets", "SocketFactory", "no_socket_left"]

_ZAP_DOMAIN = b"p2pkv"

Socket = zmq.Socket[bytes]


class LinkSockets(NamedTuple):
    """What :meth:`SocketFactory.dial` made: a connected PUSH and its monitor."""

    push: Socket
    monitor: Socket
    queued: bool
    """False if the first message did not fit: libzmq had no pipe to the peer at once."""


class SocketFactory:
    """Owns the transport's context (closed by :meth:`close`); the sockets it makes belong to
    the caller, which closes them before it closes the factory."""

    def __init__(self, options: ZmqOptions, keys: CurveKeys | None, max_frame_bytes: int) -> None:
        self._options = options
        self._keys = keys
        self._max_frame_bytes = max_frame_bytes
        self.context: zmq.Context[Socket] = zmq.Context(io_threads=1)
        self.cap = socket_cap(options.max_sockets, self.context.get(zmq.SOCKET_LIMIT))
        """The context's ``ZMQ_MAX_SOCKETS`` and where it came from (set before any socket)."""
        self.context.max_sockets = self.cap.value
        self._monitor_seq = itertools.count()
        self._dial_options = (
            (zmq.HEARTBEAT_IVL, _ms(options.heartbeat_interval)),
            (zmq.HEARTBEAT_TIMEOUT, _ms(options.heartbeat_timeout)),
            (zmq.HEARTBEAT_TTL, _ms(options.heartbeat_ttl)),
            (zmq.HANDSHAKE_IVL, _ms(options.handshake_timeout)),
            (zmq.SNDHWM, options.max_queued_frames + 1),  # + the first message
        )
        """What :meth:`dial` sets on each PUSH (``setsockopt`` costs a tenth of pyzmq's
        attribute form, which a flood of dials pays per dial)."""

    def listener(self, plan: ListenPlan) -> Socket:
        """The PULL every peer's frames come in on, not bound yet (see :meth:`bind`): frames
        up to ``max_frame_bytes``, ``ZMQ_HANDSHAKE_IVL`` = ``handshake_timeout``, the ZAP
        domain, and CURVE server if we have keys."""
        listener: Socket = self.context.socket(zmq.PULL)
        _tune(listener, ipv6=plan.ipv6)
        listener.maxmsgsize = self._max_frame_bytes
        listener.handshake_ivl = _ms(self._options.handshake_timeout)
        # With a ZAP domain libzmq refuses ZMTP 1.0/2.0 peers at once, whose "greeting" any
        # stray bytes pass for; without CURVE no ZAP handler is bound and NULL peers are
        # admitted without asking one.
        listener.zap_domain = _ZAP_DOMAIN
        if self._keys is not None:
            listener.curve_server = True
            listener.curve_secretkey = self._keys.server_secret
        return listener

    def bind(self, listener: Socket, plan: ListenPlan) -> str:
        """Bind ``listener`` where ``plan`` says; the endpoint it got. ``ConfigError`` that
        names the setting to change when libzmq cannot bind there."""
        try:
            listener.bind(tcp_url(plan.bind_host, plan.port or "*"))
        except zmq.ZMQError as exc:
            raise _bind_error(plan, exc) from exc
        return listener.getsockopt_string(zmq.LAST_ENDPOINT)

    def push(self, key: str) -> Socket:
        """A PUSH socket for the peer ``key``, CURVE client if we have keys; not connected yet.
        ``ResourceUnavailable`` when libzmq has no socket left (ZMQ_MAX_SOCKETS or
        descriptors)."""
        try:
            push: Socket = self.context.socket(zmq.PUSH)
        except zmq.ZMQError as exc:
            raise _out_of_sockets(self.context, key, exc) from exc
        _tune(push, ipv6=is_ipv6_literal(parse_address(key)[0]))
        keys = self._keys
        if keys is not None:
            push.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
            push.setsockopt(zmq.CURVE_PUBLICKEY, keys.client_public)
            push.setsockopt(zmq.CURVE_SECRETKEY, keys.client_secret)
        return push

    def dial(self, key: str, url: str, first: list[bytes], events: int) -> LinkSockets:
        """A :meth:`push` of ``key`` with the heartbeats and handshake timeout of the options
        and room for ``max_queued_frames`` after ``first``, monitored for ``events``,
        connected to ``url``, with the message ``first`` queued. ``ResourceUnavailable`` when
        libzmq refuses the dial (out of sockets or descriptors), ``ConfigError`` for an
        address it cannot dial; nothing is left open then."""
        push = self.push(key)
        monitor: Socket | None = None
        try:
            for option, value in self._dial_options:
                push.setsockopt(option, value)
            monitor = self.monitor(push, events)
            push.connect(url)
            try:
                push.send_multipart(first, zmq.NOBLOCK)
                queued = True
            except zmq.Again:  # no pipe to the peer any more (seen once in CI, intruder test)
                queued = False
        except zmq.ZMQError as exc:
            if monitor is not None:
                monitor.close(0)
            push.close(0)
            raise _dial_error(self.context, key, exc) from exc
        return LinkSockets(push, monitor, queued)

    def monitor(self, sock: Socket, events: int) -> Socket:
        """A PAIR receiving ``events`` of ``sock``, on an endpoint never used before."""
        endpoint = f"inproc://p2pkv-monitor-{next(self._monitor_seq)}"
        monitor: Socket = sock.get_monitor_socket(events, endpoint)
        monitor.setsockopt(zmq.LINGER, 0)
        return monitor

    def close(self) -> None:
        """Terminate the context: blocks while a socket closed with a linger still delivers."""
        self.context.term()


def _tune(sock: Socket, *, ipv6: bool) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    if ipv6:
        sock.setsockopt(zmq.IPV6, 1)


def _bind_error(plan: ListenPlan, exc: zmq.ZMQError) -> ConfigError:
    where = format_address(plan.bind_host, plan.port)
    if exc.errno == zmq.EADDRINUSE:
        return ConfigError(
            f"zmq control port {plan.port} is already in use on {plan.bind_host} "
            f"(port = base port {plan.port - plan.dp_rank} + data-parallel rank offset "
            f"{plan.dp_rank}); stop the process holding it, or choose another base port "
            f"with {plan.port_setting}"
        )
    return ConfigError(f"cannot listen on {where}: {exc.strerror}; check {plan.host_setting}")


def _dial_error(context: zmq.Context[Socket], key: str, exc: zmq.ZMQError) -> P2PKVError:
    """A dial libzmq refused: out of a resource (sockets, descriptors, memory: runtime), or
    an endpoint it cannot use (the address: config)."""
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return _out_of_sockets(context, key, exc)
    if exc.errno in (errno.ENOMEM, errno.ENOBUFS):
        return ResourceUnavailable(
            f"cannot dial zmq peer {key}: {exc}; lower the tier's "
            "peers.max_dialed or restrict peers.allow"
        )
    return ConfigError(f"cannot dial zmq peer {key}: {exc}; check the address")


def _out_of_sockets(
    context: zmq.Context[Socket], key: str, exc: zmq.ZMQError
) -> ResourceUnavailable:
    """No zmq socket left: :func:`no_socket_left` with the context's socket cap."""
    return no_socket_left(key, exc, context.get(zmq.MAX_SOCKETS))


def no_socket_left(
    key: str, exc: OSError | zmq.ZMQError, max_sockets: int | None = None
) -> ResourceUnavailable:
    """The error of a dial to ``key`` that got no socket (``exc``: EMFILE or ENFILE). It
    names the limit really hit, and its fix: the process's descriptor limit (with the count
    open), or the zmq context's cap ``max_sockets`` (None: a plain socket, never capped)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: cannot tell which
        used = soft
    if max_sockets is not None and used < soft - _DESCRIPTOR_MARGIN:
        limit = (
            f"the zmq context's socket cap (ZMQ_MAX_SOCKETS = {max_sockets}, 3 per "
            "session, dialed or accepted): lower the tier's peers.max_dialed, restrict "
            "peers.allow, or raise control_options.max_sockets (unset: derived from the "
            "descriptor limit)"
        )
    else:
        limit = (
            f"the process's descriptor limit (ulimit -n = {soft}, {used} open): raise "
            "it, or lower the tier's peers.max_dialed"
        )
    return ResourceUnavailable(f"cannot dial zmq peer {key}: no socket left ({exc}); {limit}")


def _ms(seconds: float) -> int:
    return max(1, round(seconds * 1000))
