"""The socket cap of the ``zmq`` transport's context (``ZMQ_MAX_SOCKETS``), set or derived.

A session holds 3 zmq sockets (a PUSH, its monitor, libzmq's end of that monitor) and 5
descriptors (two TCP connections and 3 socket mailboxes), dialed or accepted alike. libzmq's
default cap, 1,023, fills at about 340 sessions, long before a raised ``ulimit -n`` does
(vLLM raises it to 65,535; pods often run with 1,048,576). So when ``control_options``
leaves ``max_sockets`` unset, the cap follows the process's soft ``RLIMIT_NOFILE``: the
sockets of the sessions whose descriptors fit the limit, after a reserve for the rest of
the process. The descriptor limit thus decides how many sessions fit, and the cap trips
first, while the engine still has descriptors left. The cap is never below libzmq's default
and never above its ``ZMQ_SOCKET_LIMIT``. An explicit ``max_sockets`` stays as set.

:func:`socket_cap` is the one computation: the transport sets it on its context, and
``p2pkv check-config`` budgets dialed sessions against it (through
``ZmqControlTransport.socket_cap``: the core never imports this package). Pure Python: no
zmq import.
"""

from __future__ import annotations

import resource
from typing import NamedTuple

__all__ = [
    "LIBZMQ_MAX_SOCKETS",
    "LIBZMQ_SOCKET_LIMIT",
    "OWN_SOCKETS",
    "SOCKETS_PER_SESSION",
    "SocketCap",
    "derived_max_sockets",
    "socket_cap",
]

LIBZMQ_MAX_SOCKETS = 1023
"""libzmq's default ``ZMQ_MAX_SOCKETS``: the derived cap's floor."""
LIBZMQ_SOCKET_LIMIT = 65535
"""libzmq's ``ZMQ_SOCKET_LIMIT`` with epoll (Linux): the largest cap it accepts."""
SOCKETS_PER_SESSION = 3
"""zmq sockets one session holds, dialed or accepted."""
DESCRIPTORS_PER_SESSION = 5
"""Descriptors one session holds: two TCP connections and 3 socket mailboxes."""
OWN_SOCKETS = 16
"""Sockets beside the sessions: the listener and its monitor, ZAP, notices in flight."""
RESERVE_FLOOR = 256
"""Descriptors at least kept for the rest of the process (engine, NIXL, UCX, logs)."""
RESERVE_SHARE = 8
"""Of a larger limit, one descriptor in this many is kept for the rest of the process."""


class SocketCap(NamedTuple):
    """A context's socket cap and where it came from (for logs and ``check-config``)."""

    value: int
    source: str
    """``set by control_options.max_sockets``, or ``derived from ulimit -n N``."""
    per_session: int = SOCKETS_PER_SESSION
    """Sockets one session holds, dialed or accepted."""

    @property
    def sessions(self) -> int:
        """Sessions the cap holds after :data:`OWN_SOCKETS` (the inverse of
        :func:`derived_max_sockets`' sum)."""
        return (self.value - OWN_SOCKETS) // self.per_session


def derived_max_sockets(soft_limit: int, socket_limit: int = LIBZMQ_SOCKET_LIMIT) -> int:
    """The cap for a process whose soft descriptor limit is ``soft_limit`` (negative:
    unlimited): 3 sockets per session that fits the limit less its reserve, plus
    :data:`OWN_SOCKETS`; within :data:`LIBZMQ_MAX_SOCKETS` .. ``socket_limit``."""
    if _unlimited(soft_limit):
        return max(LIBZMQ_MAX_SOCKETS, socket_limit)
    reserve = max(RESERVE_FLOOR, soft_limit // RESERVE_SHARE)
    sessions = max(0, soft_limit - reserve) // DESCRIPTORS_PER_SESSION
    wanted = sessions * SOCKETS_PER_SESSION + OWN_SOCKETS
    return max(LIBZMQ_MAX_SOCKETS, min(wanted, socket_limit))


def socket_cap(max_sockets: int | None, socket_limit: int = LIBZMQ_SOCKET_LIMIT) -> SocketCap:
    """The cap to use: ``max_sockets`` as set, or (None) derived from this process's soft
    ``RLIMIT_NOFILE`` now. ``socket_limit``: the context's ``ZMQ_SOCKET_LIMIT``, if known."""
    if max_sockets is not None:
        return SocketCap(max_sockets, "set by control_options.max_sockets")
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    shown = "unlimited" if _unlimited(soft) else str(soft)
    return SocketCap(derived_max_sockets(soft, socket_limit), f"derived from ulimit -n {shown}")


def _unlimited(soft_limit: int) -> bool:
    """Whether a soft ``RLIMIT_NOFILE`` means no limit (``RLIM_INFINITY``, or negative)."""
    return soft_limit < 0 or soft_limit == resource.RLIM_INFINITY
