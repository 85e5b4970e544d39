"""One tick of the tier's I/O, whose work is proportional to what is due.

In order (docs/design.md, "One driver thread per tier"): the pause check; the control poll
(waiting at most until the next deadline); the pause check again; new connections; the
frames and deaths of the connections the control transport reports active (``take_active``:
every session only with a transport that does not track them); frames held behind full send
queues; held newcomers; the data transport (progressed every tick, polled for the peers with
reads in flight); then the timers: due deadlines (handshakes, loads, leases, idle sessions,
warm dials), the warnings' summary line and ``peers.connect``'s answers. A quiet tier with a
thousand sessions does the same work per tick as one with ten.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from p2pkv.contracts import ControlTransport
from p2pkv.session.admission import Admission
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.env import SessionEnv
from p2pkv.session.pause import PauseDetector
from p2pkv.tiering.table import SessionTable
from p2pkv.types import Outcome

__all__ = ["TickPipeline"]

log = logging.getLogger("p2pkv.tier")

Periodic = Callable[[float], None]
"""Something a tick runs with the time after the deadlines (the warnings' summary...)."""


class TickPipeline:
    """Runs :meth:`tick` over the tier's roles (see the module docstring)."""

    def __init__(
        self,
        control: ControlTransport,
        env: SessionEnv,
        table: SessionTable,
        admission: Admission,
        pauses: PauseDetector,
        peer_timers: Deadlines,
        periodic: Sequence[Periodic],
    ) -> None:
        self._control = control
        self._env = env
        self._table = table
        self._admission = admission
        self._pauses = pauses
        self._timers = (env.deadlines, peer_timers)
        """The requests' deadlines, then the peers' (idle sessions, warm dials)."""
        self._periodic = periodic

    def tick(self, timeout: float) -> None:
        """See ``P2PTier.tick``."""
        table, env = self._table, self._env
        if table.closed:
            return
        pauses = self._pauses
        gap = pauses.gap()
        if gap is not None:
            self._resumed(gap)
        if timeout > 0.0:
            timeout = self._until_due(timeout)
        control = self._control
        accepted = control.poll(timeout)
        gap = pauses.gap(allowed=timeout)
        if gap is not None:  # stopped inside the poll: what it brought is stale
            self._resumed(gap)
        for conn in accepted:
            self._admission.accept(conn)
        table.receive_due(control.take_active())
        table.reap_doomed()
        if env.congested:
            self._flush()
        if len(self._admission):
            self._admission.serve()
        self._data_tick()
        now = env.clock()
        for timers in self._timers:
            timers.fire_due(now)
        for periodic in self._periodic:
            periodic(now)
        if env.doomed or table.lingering:  # doomed since the pass above: close them now
            table.reap_doomed()

    def _until_due(self, timeout: float) -> float:
        """``timeout``, cut to the tier's next deadline."""
        dues = [due for timers in self._timers if (due := timers.next_due()) is not None]
        if not dues:
            return timeout
        return min(timeout, max(0.0, min(dues) - self._env.clock()))

    def _data_tick(self) -> None:
        """Progress the data transport; poll it for the peers with reads of ours in flight
        and hand the terminal ones to the sessions that posted them."""
        env = self._env
        data = env.data
        data.progress()
        owners = env.owners
        if owners:
            for reader in dict.fromkeys(owners.values()):
                done, failed = data.poll(reader.peer)
                for ok, tids in ((True, done), (False, failed)):
                    for tid in tids:
                        owner = owners.pop(tid, None)
                        if owner is not None:
                            owner.on_data(tid, ok)
        env.reads.pump()

    def _flush(self) -> None:
        """Send what sessions hold behind full send queues (back-pressure, in order)."""
        congested = self._env.congested
        for session in list(congested):
            if session.flush():
                congested.discard(session)

    def _resumed(self, gap: float) -> None:
        """This process was paused longer than its peers tolerate silence
        (:mod:`p2pkv.session.pause`): they have dropped its sessions, so close them now
        (loads end at once, reads cancelled first; new requests dial afresh)."""
        table, limit = self._table, self._pauses.limit
        if len(table):
            log.warning(
                "this tier was not ticked for %.1fs (process paused?), longer than the "
                "control transport's silence timeout %gs: closing its %d session(s), "
                "which its peers have dropped",
                gap,
                limit,
                len(table),
            )
        for session in list(table.sessions.values()):
            table.close(
                session,
                Outcome.PEER_DEAD,
                f"this process was paused {gap:.1f}s (no tick), longer than the "
                f"control transport's silence timeout {limit:g}s: {session.peer} has "
                f"dropped the session",
                bye="paused past the silence timeout",
            )
