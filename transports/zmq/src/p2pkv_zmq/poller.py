"""The event loop of one ``zmq`` hub: the PULL read on the hot path, the other sockets and
the timers swept, and the idle wait.

- **Frames** (the hot path) are waited for with a plain receive on the PULL: about what a raw
  pyzmq receive costs. A message of a paired link goes straight into its connection's inbox;
  anything else goes to the hub (``on_unrouted``).
- **The sweep**, every :data:`SWEEP_INTERVAL` (10 ms): the sockets that have something to read
  (connection monitors, the listener's monitor, ZAP) and the timers that are due. A
  :class:`Readiness` set (epoll over each socket's ``ZMQ_FD``) names the ready sockets, so a
  sweep visits only those, however many connections are open. The timers are the hub's
  (``on_sweep``; connect deadlines come in order, so they need no search). Heartbeats and
  silence checks are libzmq's: its I/O thread keeps them on its own timers.
- **The idle wait.** While no timer is due within the wait, a wait of
  :data:`SWEEP_INTERVAL` or more is one epoll on every socket at once, the PULL and an
  interrupt pipe too. An idle transport then wakes only when a socket has something, a timer
  falls due or ``interrupt`` is called.

``ZMQ_FD`` is not a plain readable descriptor: it signals that the socket has commands to
process, and reading the socket (or asking ``ZMQ_EVENTS``) clears it. Every handler therefore
reads its socket until ``zmq.Again``; a newly watched socket is visited at the next sweep
whatever epoll says (its first events may have been noticed before it was watched); and
before an idle wait the PULL is asked for ``ZMQ_EVENTS`` first.

Threading: the driver thread only, except :meth:`Poller.interrupt` (any thread).
"""

from __future__ import annotations

import contextlib
import select
import socket
import time
from collections.abc import Callable
from typing import Any

import zmq

from p2pkv_zmq.connection import ZmqConnection

__all__ = ["MAX_MESSAGES_PER_POLL", "SWEEP_INTERVAL", "Poller", "Readiness"]

SWEEP_INTERVAL = 0.01
"""Seconds between sweeps of the sockets other than the PULL, and of the timers."""
_SWEEP_MS = 10  # the longest single wait on the PULL, so sweeps stay on time
MAX_MESSAGES_PER_POLL = 4096
"""Messages one ``poll`` reads at most (fairness: the rest waits for the next poll)."""
_NOBLOCK = zmq.NOBLOCK
_RCVTIMEO = zmq.RCVTIMEO
_SRCFD = zmq.SRCFD
_FD_SETSIZE = 1024
"""The descriptors ``select`` takes are below this (glibc's ``FD_SETSIZE``)."""

Handler = Callable[[], None]


class Readiness:
    """The sockets a hub watches, and which of them have something to read (epoll over
    their ``ZMQ_FD``; ``select.poll`` where epoll is missing).

    ``work`` counts what sweeps examined: descriptors reported ready and handlers run. A
    sweep of an idle hub examines nothing, whatever the number of watched sockets.
    """

    def __init__(self) -> None:
        self._epoll: Any = select.epoll() if hasattr(select, "epoll") else None
        self._poll: Any = None if self._epoll is not None else select.poll()
        self._handlers: dict[int, Handler] = {}
        self._fds: dict[zmq.Socket[bytes], int] = {}
        self._fresh: list[Handler] = []
        """Handlers of sockets watched since the last dispatch: run once whatever epoll says."""
        self.work = 0

    def watch(self, sock: zmq.Socket[bytes], handler: Handler) -> None:
        """Call ``handler`` whenever ``sock`` may have something to read; it must read until
        ``zmq.Again``."""
        fd = int(sock.getsockopt(zmq.FD))
        self._fds[sock] = fd
        self.watch_fd(fd, handler)
        self._fresh.append(handler)

    def watch_fd(self, fd: int, handler: Handler | None) -> None:
        """Report the plain descriptor ``fd`` (``handler`` None: only to end an idle wait)."""
        if handler is not None:
            self._handlers[fd] = handler
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLIN)
        else:
            self._poll.register(fd, select.POLLIN)

    def watch_writable(self, fd: int, handler: Handler) -> None:
        """Call ``handler`` once the plain descriptor ``fd`` is writable or failed (a TCP
        connect that ended); it must :meth:`unwatch_fd` it."""
        self._handlers[fd] = handler
        if self._epoll is not None:
            self._epoll.register(fd, select.EPOLLOUT)
        else:
            self._poll.register(fd, select.POLLOUT)

    def unwatch_fd(self, fd: int) -> None:
        """Stop watching the plain descriptor ``fd``; call it before closing it."""
        self._handlers.pop(fd, None)
        with contextlib.suppress(OSError, KeyError):
            (self._epoll or self._poll).unregister(fd)

    def unwatch(self, sock: zmq.Socket[bytes]) -> None:
        """Stop watching ``sock``; call it before closing ``sock`` (libzmq closes the
        descriptor)."""
        fd = self._fds.pop(sock)
        del self._handlers[fd]
        with contextlib.suppress(OSError, KeyError):
            (self._epoll or self._poll).unregister(fd)

    def wait(self, timeout: float) -> list[tuple[int, int]]:
        """The descriptors ready within ``timeout`` seconds (0: none waited for)."""
        if self._epoll is not None:
            return list(self._epoll.poll(timeout))
        return list(self._poll.poll(int(timeout * 1000)))

    def dispatch(self, ready: list[tuple[int, int]]) -> bool:
        """Run the handlers of ``ready`` and of newly watched sockets; True if a watched
        socket was ready."""
        fresh = self._fresh
        if fresh:
            self._fresh = []
            self.work += len(fresh)
            for handler in fresh:
                handler()
        hit = False
        handlers = self._handlers
        self.work += len(ready)
        for fd, _ in ready:
            ready_handler = handlers.get(fd)
            if ready_handler is not None:  # None: unwatched by an earlier handler, or plain
                ready_handler()
                hit = True
        return hit

    def close(self) -> None:
        if self._epoll is not None:
            self._epoll.close()


class Poller:
    """The event loop of one hub (see the module docstring).

    ``routes`` is the hub's table of paired peer links (read on every message), ``news(conn)``
    notes a connection that got frames, ``on_unrouted(parts, fd)`` takes every other message
    (``fd``: the TCP connection a message of three parts or more came over, ``ZMQ_SRCFD``),
    ``on_sweep(now, previous)`` runs the hub's timers (``previous``: when the last sweep was
    due) and returns the entries it examined, ``next_due()`` says when the next one falls due.
    The sockets to sweep are watched in ``readiness`` (the hub's monitors watch theirs).
    """

    def __init__(
        self,
        readiness: Readiness,
        listener: zmq.Socket[bytes],
        routes: dict[bytes, ZmqConnection],
        news: Callable[[ZmqConnection], None],
        on_unrouted: Callable[[list[bytes], int | None], None],
        timers: tuple[Callable[[float, float], int], Callable[[], float | None]],
    ) -> None:
        self.readiness = readiness
        self._listener = listener
        self._routes = routes
        self._news = news
        self._on_unrouted = on_unrouted
        self._on_sweep, self._next_due = timers
        self._listener_ready = zmq.Poller()  # the PULL alone: "is a message waiting?"
        self._listener_ready.register(listener, zmq.POLLIN)
        self._listener_fd = int(listener.getsockopt(zmq.FD))
        self.readiness.watch_fd(self._listener_fd, None)
        self._wake_in, self._wake_out = socket.socketpair()  # interrupt() ends an idle wait
        for end in (self._wake_in, self._wake_out):
            end.setblocking(False)
        self.readiness.watch_fd(self._wake_in.fileno(), None)
        self._rcvtimeo = -1  # the PULL's current receive timeout (ms)
        self._next_sweep = 0.0
        self.sweeps = 0
        """Sweeps so far (with ``readiness.work``: the work per sweep)."""

    def poll(self, timeout: float) -> None:
        """Read what comes within ``timeout`` seconds, sweeping on time. libzmq waits in
        whole milliseconds; what is left below one is waited on the PULL's descriptor
        (:meth:`_short_wait`), so a short ``timeout`` sleeps instead of spinning. Returns after the
        first burst of messages or sweep that found something, or at ``timeout``."""
        now = time.monotonic()
        deadline = now + timeout
        while True:
            swept = now >= self._next_sweep and self._sweep(now)
            if not swept and deadline - now >= SWEEP_INTERVAL:
                swept = self._idle(now, deadline)
                now = time.monotonic()
            wait_ms = 0 if swept else min(int((deadline - now) * 1000), _SWEEP_MS)
            if self._read_listener(wait_ms) or swept:
                return
            now = time.monotonic()
            if now >= deadline:
                return
            if wait_ms <= 0:  # under a millisecond left: libzmq cannot wait that short
                self._short_wait(deadline - now)
                now = time.monotonic()

    def _short_wait(self, seconds: float) -> None:
        """Wait ``seconds`` (under a millisecond) on the PULL's descriptor: ``select``, whose
        timeout has microseconds, for a descriptor below ``FD_SETSIZE``; a plain sleep for
        one above it (``select`` refuses those: a process with many sockets), after which
        the next read finds what came."""
        if self._listener_fd < _FD_SETSIZE:
            select.select((self._listener_fd,), (), (), seconds)
        else:
            time.sleep(seconds)

    def interrupt(self) -> None:
        """End an idle wait now, or the next one at its start (any thread). A wait with a
        timer due is at most :data:`SWEEP_INTERVAL` long and not interrupted."""
        try:
            self._wake_out.send(b"\0")
        except OSError:  # full (a wake is pending anyway) or closed
            pass

    def close(self) -> None:
        """Close the interrupt pipe (the readiness set is its owner's to close)."""
        self._wake_in.close()
        self._wake_out.close()

    # -- the sweep and the idle wait ------------------------------------------------------------

    def _sweep(self, now: float, ready: list[tuple[int, int]] | None = None) -> bool:
        """Handle the watched sockets that are ready (``ready``: what an idle wait just
        found), then the timers; True if a watched socket was ready."""
        previous = self._next_sweep - SWEEP_INTERVAL
        self._next_sweep = now + SWEEP_INTERVAL
        readiness = self.readiness
        hit = readiness.dispatch(readiness.wait(0) if ready is None else ready)
        readiness.work += self._on_sweep(now, previous)
        self.sweeps += 1
        return hit

    def _idle(self, now: float, deadline: float) -> bool:
        """Wait on every socket at once until ``deadline`` or the next timer, whichever is
        first (if that is a sweep interval away or more); True if something came."""
        while True:
            due = self._next_due()
            until = deadline if due is None else min(deadline, due)
            if until - now < SWEEP_INTERVAL:
                return False
            if self._take_wake() or self._has_message():
                return True
            ready = self.readiness.wait(until - now)
            now = time.monotonic()
            if self._sweep(now, ready) or self._take_wake():
                return True
            if not ready:
                return False
            # Only the PULL's descriptor (or a stale one): is a message there? Loop to ask.

    def _take_wake(self) -> bool:
        """Whether ``interrupt`` was called since the last idle wait; consumes it."""
        woken = False
        with contextlib.suppress(BlockingIOError):
            while self._wake_in.recv(4096):
                woken = True
        return woken

    def _has_message(self) -> bool:
        """Whether the PULL holds a message (asking also clears its descriptor)."""
        return bool(int(self._listener.getsockopt(zmq.EVENTS)) & zmq.POLLIN)

    # -- the PULL -------------------------------------------------------------------------------

    def _read_listener(self, wait_ms: int) -> bool:
        """Receive what the PULL holds, waiting up to ``wait_ms`` for the first message, at
        most :data:`MAX_MESSAGES_PER_POLL`; True if anything came.

        Costs are pyzmq's, per call: a blocking receive with a timeout for the wait; after the
        first message a one-socket zero-timeout poll asks for more (cheapest when there is
        none: a ``zmq.Again`` costs about 2.5x that), and a burst is drained until one
        ``zmq.Again`` (cheaper than a poll per message)."""
        part = self._first_message(wait_ms)
        if part is None:
            return False
        recv, more = self._listener.recv, self._listener_ready.poll
        routes, news = self._routes, self._news
        count = 1
        while True:  # parts as frames: ``Frame.more`` costs far less than a RCVMORE getsockopt
            link = part.bytes
            if not part.more:  # one part: no link id before it
                self._on_unrouted([link], None)
            else:
                part = recv(_NOBLOCK, copy=False)
                if part.more:
                    self._on_link_message(link, part.bytes)
                else:
                    conn = routes.get(link)
                    if conn is None:
                        self._on_unrouted([link, part.bytes], None)
                    else:
                        conn.inbox.append(part.bytes)
                        if not conn.listed:
                            news(conn)
            if count == MAX_MESSAGES_PER_POLL:
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
        rest = self._listener.recv_multipart(_NOBLOCK, copy=False)
        self._on_unrouted([link, first, *(frame.bytes for frame in rest)], rest[-1].get(_SRCFD))
