"""Reach checks: during a flood of dials that reach nothing, a fresh dial tries a plain
TCP connect first, and gets its zmq sockets only once that connect succeeds.

Why: a zmq dial builds a PUSH, its monitor and their options. Over its life a refused or
black-holed dial cost the driver thread 230-390 µs, a check 100-170 µs (docs/scale.md,
``floods5``). A flood of names that refuse or never answer (issue 48) paid a dial per name
the tier let through. A check costs one non-blocking socket. A refused name ends there,
and a black-holed one holds one descriptor, and no zmq socket, until ``connect_timeout``
or its eviction.

- **When.** Fresh dials that end before their TCP connection is up (refused, unreachable,
  timed out, or closed by the tier while dialing) are counted. While :data:`FLOOD_DIALS`
  or more ended so within about the last second (:data:`FLOOD_WINDOW`), dials are checked
  first. So are dials while :data:`BURST_DIALS` or more fresh dials are still unconnected
  at once: a flood's first burst (the tier lets 64 out together) shows there, before any
  of its dials has failed. Otherwise a dial is zmq's alone, as before: it progresses in
  libzmq's I/O thread whether or not the hub is polled, and its first frames leave with no
  extra wait.
- **Why a burst.** A healthy peer connects within a round trip, so dials that a tier's
  requests make one at a time are never eight unconnected at once. A burst is a flood, a
  pre-connect of many warm peers, or a startup storm. Its healthy dials pay a check each:
  up to one sweep (10 ms) before the zmq dial, once per address (then remembered). Warm
  and storm dials carry no request, so no user waits on that sweep.
- The check's connection is reset (``SO_LINGER`` 0) once it is up. The peer's listener
  sees a client that left in its handshake: logged once at INFO there, counted nowhere.
- Addresses whose check succeeded are remembered (the newest ``_MEMORY``). Dials to them
  skip the check, so a healthy peer pays one check per hub, not one per reconnect. A dial
  that fails forgets its address (the hub calls :meth:`ReachChecks.forget`).
- What it costs a healthy peer's first dial during a flood: its zmq dial starts at the
  sweep that sees the check connect (within 10 ms of it), or at once when the hub waits
  idle; it progresses only while the hub is polled. Frames sent meanwhile wait in the
  connection. From the check's connect on, the dial counts as ``"connected"``: a dial
  making progress, which the tier never evicts for a newer one.

Threading: the hub's driver thread only. A check's socket is this module's own: it closes it
when the check ends or :meth:`ReachChecks.drop` is called.
"""

from __future__ import annotations

import errno
import os
import socket
import struct
from collections import OrderedDict
from collections.abc import Callable
from functools import partial

from p2pkv_zmq.connection import DIALING, ZmqConnection
from p2pkv_zmq.dialing import refused_reason
from p2pkv_zmq.identity import is_ipv6_literal
from p2pkv_zmq.poller import Readiness
from p2pkv_zmq.sockets import no_socket_left

__all__ = ["ReachChecks"]

_MEMORY = 4096  # addresses remembered as reached at most (oldest forgotten)
FLOOD_DIALS = 8
"""Fruitless dials within :data:`FLOOD_WINDOW` from which fresh dials are checked first.
A dead peer is dialed about once a second at most (``DIAL_BACKOFF``): eight dead
addresses a second is a flood, or a fleet losing many pods at once."""
BURST_DIALS = 8
"""Fresh dials unconnected at once from which further fresh dials are checked first."""
FLOOD_WINDOW = 1.0
"""Seconds a fruitless dial counts for (one to two: two consecutive windows are summed)."""
_STARTED = {0, errno.EINPROGRESS, errno.EAGAIN}
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close sends RST, leaves no TIME_WAIT
_OUT_OF_DESCRIPTORS = {errno.EMFILE, errno.ENFILE}

Reached = Callable[[ZmqConnection, str], None]
"""``on_reached(conn, url)``: the check of ``conn`` connected; dial ``url`` now."""
Failed = Callable[[ZmqConnection, str], None]
"""``on_failed(conn, reason)``: the check of ``conn`` failed (refused, unreachable)."""


class ReachChecks:
    """The pending checks of one hub, watched in its ``readiness`` set, and the addresses
    reached lately (see the module docstring)."""

    def __init__(self, readiness: Readiness, on_reached: Reached, on_failed: Failed) -> None:
        self._readiness = readiness
        self._on_reached = on_reached
        self._on_failed = on_failed
        self._pending: dict[ZmqConnection, tuple[socket.socket, str]] = {}
        self._reached: OrderedDict[str, None] = OrderedDict()
        self._window = 0.0  # when the current window of fruitless dials began
        self._fruitless = 0  # fruitless dials in the current window ...
        self._before = 0  # ... and in the one before it
        self._unconnected: set[ZmqConnection] = set()
        """Fresh dials not known to be connected (pruned once :data:`BURST_DIALS` are)."""
        self.started = 0
        """Checks started so far (each a plain socket, never a zmq one)."""

    def __len__(self) -> int:
        return len(self._pending)

    def wanted(self, key: str, now: float) -> bool:
        """Whether a fresh dial to ``key`` is checked first: during a flood of fruitless
        dials or a burst of unconnected ones, unless a check of ``key`` succeeded lately."""
        if key in self._reached:
            return False
        self._roll(now)
        return self._fruitless + self._before >= FLOOD_DIALS or self._burst()

    def dialing(self, conn: ZmqConnection) -> None:
        """``conn`` is a fresh dial, unconnected until its progress says otherwise."""
        self._unconnected.add(conn)

    def _burst(self) -> bool:
        """:data:`BURST_DIALS` or more fresh dials are alive and unconnected."""
        unconnected = self._unconnected
        if len(unconnected) < BURST_DIALS:
            return False
        for conn in [c for c in unconnected if c.progress != DIALING or not c.alive]:
            unconnected.discard(conn)
        return len(unconnected) >= BURST_DIALS

    def fruitless(self, now: float) -> None:
        """A fresh dial ended before its TCP connection was up."""
        self._roll(now)
        self._fruitless += 1

    def _roll(self, now: float) -> None:
        elapsed = now - self._window
        if elapsed >= FLOOD_WINDOW:
            self._before = self._fruitless if elapsed < 2 * FLOOD_WINDOW else 0
            self._fruitless = 0
            self._window = now

    def forget(self, key: str) -> None:
        """A dial to ``key`` failed: check it again next time."""
        self._reached.pop(key, None)

    def start(self, conn: ZmqConnection, host: str, port: int, url: str) -> str | None:
        """Start checking ``host``:``port`` (an IP literal) for ``conn``; ``url`` is what
        ``on_reached`` then dials. None while the check runs, else why it failed at once.
        ``ResourceUnavailable`` when the process has no descriptor left."""
        family = socket.AF_INET6 if is_ipv6_literal(host) else socket.AF_INET
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError as exc:
            if exc.errno in _OUT_OF_DESCRIPTORS:
                raise no_socket_left(conn.key, exc) from None
            return _reason(conn.key, exc.errno or errno.EIO)
        self.started += 1
        sock.setblocking(False)
        code = sock.connect_ex((host, port))
        if code not in _STARTED:
            sock.close()
            return _reason(conn.key, code)
        self._pending[conn] = (sock, url)
        self._readiness.watch_writable(sock.fileno(), partial(self._on_writable, conn))
        return None

    def drop(self, conn: ZmqConnection) -> None:
        """End the check of ``conn``, if one runs (``conn`` was retired)."""
        self._unconnected.discard(conn)
        entry = self._pending.pop(conn, None)
        if entry is not None:
            self._close(entry[0])

    def close(self) -> None:
        """End every check (the hub closes)."""
        for sock, _ in self._pending.values():
            self._close(sock)
        self._pending.clear()
        self._unconnected.clear()

    def _on_writable(self, conn: ZmqConnection) -> None:
        entry = self._pending.pop(conn, None)
        if entry is None:
            return
        sock, url = entry
        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        self._close(sock)
        if code:
            self._on_failed(conn, _reason(conn.key, code))
            return
        self._reached.pop(conn.key, None)
        self._reached[conn.key] = None
        if len(self._reached) > _MEMORY:
            self._reached.popitem(last=False)
        self._on_reached(conn, url)

    def _close(self, sock: socket.socket) -> None:
        self._readiness.unwatch_fd(sock.fileno())
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)
        sock.close()


def _reason(key: str, code: int) -> str:
    """Why a check of ``key`` failed with ``errno`` ``code``, in the words a zmq dial's
    failure would have."""
    if code == errno.ECONNREFUSED:
        return refused_reason(key, dialed_us=False)
    return f"cannot connect to {key}: {os.strerror(code)} (no route to it?)"
