"""The dials of the fleet simulator's tier under test, counted: zmq dials (each a PUSH and its
monitor, ``SocketFactory.dial``) and reach checks (a plain TCP connect first,
``ReachChecks.start``; a tier from before them has none, and counts None).

Each is counted by wrapping the class's method once, in the tier-under-test process only,
before the tier is built: the same wrapper for the branch's tier and an older one
(``--fleet-tut-path``), so the two count alike. A wrapped call costs one Python call more.

Threading: the counts are updated by the thread that dials (the tier's).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = ["DialCounts"]


class DialCounts:
    """Counts of the calls of this process's zmq dials and reach checks, from now on."""

    def __init__(self) -> None:
        from p2pkv_zmq.sockets import SocketFactory

        self.dials = 0
        self.checks: int | None = None
        SocketFactory.dial = self._wrapped(SocketFactory.dial, "dials")  # type: ignore[method-assign]
        try:
            from p2pkv_zmq.reach import ReachChecks
        except ImportError:  # a tier under test from before reach checks
            return
        self.checks = 0
        ReachChecks.start = self._wrapped(ReachChecks.start, "checks")  # type: ignore[method-assign]

    def snapshot(self) -> tuple[int, int | None]:
        """The zmq dials and the reach checks so far."""
        return self.dials, self.checks

    def _wrapped(self, method: Callable[..., Any], counter: str) -> Callable[..., Any]:
        def counted(*args: Any) -> Any:
            setattr(self, counter, getattr(self, counter) + 1)
            return method(*args)

        return counted
