"""Shutting the tier down within ``timeouts.shutdown_drain`` (docs/protocol.md §10).

Steps: stop resolving ``peers.connect``; refuse new connections, fail parked stores and the
loads waiting for a dial;
wind every session down (our loads fail at once, their reads cancelled; the peers' rounds
fail); tick until every session is wound down or the budget is spent; close every session
(a bye each), drop the pins still held and answer every job; close the control transport,
stop the pause detector's watchdog thread, close the data transport.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from p2pkv.contracts import ControlTransport
from p2pkv.discovery import Discovery
from p2pkv.session.admission import Admission
from p2pkv.session.env import SessionEnv
from p2pkv.tiering.dial_queue import DialQueue
from p2pkv.tiering.table import SessionTable
from p2pkv.types import Outcome

__all__ = ["DISCOVERY_JOIN", "Shutdown"]

log = logging.getLogger("p2pkv.tier")

DISCOVERY_JOIN = 1.0
"""Seconds shutdown waits for the resolver thread (a lookup may hang)."""


class Shutdown:
    """Runs the steps of the module docstring once; ``tick(timeout)`` is the tier's,
    ``stop_watch()`` stops the pause detector's watchdog (``PauseDetector.close``)."""

    def __init__(
        self,
        control: ControlTransport,
        env: SessionEnv,
        table: SessionTable,
        admission: Admission,
        discovery: Discovery | None,
        queue: DialQueue,
        tick: Callable[[float], None],
        stop_watch: Callable[[], None],
    ) -> None:
        self._control = control
        self._env = env
        self._table = table
        self._admission = admission
        self._discovery = discovery
        self._queue = queue
        self._tick = tick
        self._stop_watch = stop_watch

    def run(self) -> None:
        """Every step; afterwards the table is closed and every job has its result."""
        if self._discovery is not None:
            self._discovery.close(DISCOVERY_JOIN)
        self._wind_down()
        self._drain_sessions()
        self._close_sessions()
        self._close_transports()

    def _wind_down(self) -> None:
        self._table.stopping = True
        self._admission.stop()
        self._env.producers.fail_parked(Outcome.SHUTDOWN, "tier shut down")
        self._queue.fail_all(Outcome.SHUTDOWN, "tier shut down")
        for session in self._table.sessions.values():
            session.wind_down()

    def _drain_sessions(self) -> None:
        """Tick until every session is wound down or the budget is spent."""
        drain, clock, sessions = self._env.timeouts.shutdown_drain, self._env.clock, self._table
        start, wall = clock(), time.monotonic()
        while (
            any(not s.wound_down for s in sessions.sessions.values())
            and max(clock() - start, time.monotonic() - wall) < drain
        ):
            self._tick(0.001)

    def _close_sessions(self) -> None:
        table, ledger = self._table, self._env.ledger
        for session in list(table.sessions.values()):
            table.close(session, Outcome.SHUTDOWN, "shutdown", bye="shutdown")
        for session in list(table.lingering):
            pinned = session.producer.drop_pins(Outcome.SHUTDOWN, "tier shut down")
            log.warning(
                "shutdown: %d block(s) pinned for %s released before its lease ended",
                pinned,
                session.peer,
            )
        table.lingering.clear()
        table.closed = True
        for job_id in ledger.open_ids():  # safety net: nothing may stay unanswered
            ledger.close(job_id, Outcome.SHUTDOWN, "tier shut down")

    def _close_transports(self) -> None:
        owed = len(self._env.lookup_ends.take())
        if owed:
            log.info(
                "shutdown: %d lookup handle(s) were never released (no serve_lookups call)", owed
            )
        self._control.close()
        self._stop_watch()
        undrained = self._env.data.close()
        if undrained:
            log.error(
                "shutdown: data transport kept its region registered; %d transfer(s) "
                "never drained: %s",
                len(undrained),
                undrained[:16],
            )
