"""Request bookkeeping that spans sessions (the tier's :class:`SessionHost`).

* **Producer requests** active on this instance (``remote_decoder`` routing), and
  **tombstones** of finished ones (kept ``Timeouts.unbound_store`` seconds so a fetch that
  arrives after the request finished and its stores are gone is refused at once instead of
  waiting for the consumer's load timeout).
* **Parked stores**: store jobs whose consumer has not fetched yet, by ``kv_request_id`` in
  submit order, each failing with ``UNBOUND_TIMEOUT`` after ``Timeouts.unbound_store``.
* **Bindings**: ``kv_request_id`` -> the session holding its producer state. An entry lives
  exactly as long as that state (freed when the request is finished and drained).
* **Failed consumer ids**: lookups answer MISS until the consumer request finishes.
* Lookup handles whose ``LocalHitSource.end`` is owed, and which session registered each data
  peer (only that session may remove it).

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from p2pkv.config import Timeouts
from p2pkv.registry import Observers
from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.env import Claim
from p2pkv.session.ledger import JobLedger
from p2pkv.types import Job, Outcome

if TYPE_CHECKING:
    from collections.abc import Callable

    from p2pkv.session.session import Session

__all__ = ["Directory"]

log = logging.getLogger(__name__)


class Directory:
    def __init__(self, ledger: JobLedger, deadlines: Deadlines, clock: Callable[[], float],
                 timeouts: Timeouts, observers: Observers) -> None:
        self._ledger = ledger
        self._deadlines = deadlines
        self._clock = clock
        self._timeouts = timeouts
        self._observers = observers
        self.producers: set[str] = set()
        self.tombstones: dict[str, Timer] = {}
        self.parked: dict[str, list[tuple[Job, Timer]]] = {}
        self.bindings: dict[str, Session] = {}
        self.failed: dict[str, str] = {}
        """Consumer ``kv_request_id``s that cannot load any more, with why (the first
        failure: later loads of the id fail at once, naming it)."""
        self.ends: list[object] = []
        self.data_owner: dict[str, Session] = {}
        self.source_seen = False

    # -- SessionHost ------------------------------------------------------------------------

    @property
    def has_hit_source(self) -> bool:
        return self.source_seen

    def claim(self, kv_request_id: str, session: Session, *, by_fetch: bool) -> Claim | str:
        bound = self.bindings.get(kv_request_id)
        if bound is not None and bound is not session:
            return f"{kv_request_id!r} is already served to another consumer ({bound.peer})"
        entries = self.parked.pop(kv_request_id, None)
        active = kv_request_id in self.producers
        if entries is None and not active and kv_request_id in self.tombstones:
            return f"{kv_request_id!r} already finished on the producer"
        parked: list[Job] = []
        if entries:
            for job, timer in entries:
                self._deadlines.cancel(timer)
                self._ledger.set_peer(job.job_id, session.peer)
                parked.append(job)
        # A fetch for an id never seen here waits for stores (decoder-first); a lookup-served
        # request only gets more supply while a local producer request is running.
        supply_open = active or (by_fetch and entries is None
                                 and kv_request_id not in self.tombstones)
        self.bindings[kv_request_id] = session
        return Claim(parked, supply_open)

    def producer_active(self, kv_request_id: str) -> bool:
        return kv_request_id in self.producers

    def request_gone(self, kv_request_id: str, session: Session) -> None:
        if self.bindings.get(kv_request_id) is session:
            del self.bindings[kv_request_id]
        if kv_request_id in self.tombstones:
            self._tombstone(kv_request_id)  # counts from when the last state went away

    def mark_failed(self, kv_request_id: str, why: str) -> None:
        self.failed.setdefault(kv_request_id, why)

    def open_pinned(self, job: Job, kv_request_id: str, peer: str) -> None:
        self._ledger.open(job.job_id, False, kv_request_id, peer)

    def defer_end(self, handle: object) -> None:
        self.ends.append(handle)

    def data_peer_added(self, peer: str, session: Session) -> None:
        self.data_owner[peer] = session

    # -- producer requests ------------------------------------------------------------------

    def producer_started(self, kv_request_id: str) -> None:
        self.producers.add(kv_request_id)
        self._deadlines.cancel(self.tombstones.pop(kv_request_id, None))

    def producer_finished(self, kv_request_id: str) -> Session | None:
        """Forget the producer request; returns the session holding its state, if any."""
        self.producers.discard(kv_request_id)
        self._tombstone(kv_request_id)
        return self.bindings.get(kv_request_id)

    def _tombstone(self, kv_request_id: str) -> None:
        self._deadlines.cancel(self.tombstones.pop(kv_request_id, None))
        self.tombstones[kv_request_id] = self._deadlines.at(
            self._clock() + self._timeouts.unbound_store, self._tombstone_expired, kv_request_id
        )

    def _tombstone_expired(self, kv_request_id: str) -> None:
        self.tombstones.pop(kv_request_id, None)

    # -- parked stores ----------------------------------------------------------------------

    def park(self, kv_request_id: str, job: Job) -> None:
        timer = self._deadlines.at(
            self._clock() + self._timeouts.unbound_store, self._unbound_expired,
            (kv_request_id, job),
        )
        self.parked.setdefault(kv_request_id, []).append((job, timer))

    def _unbound_expired(self, arg: tuple[str, Job]) -> None:
        kv, job = arg
        entries = self.parked.get(kv)
        if entries is not None:
            self.parked[kv] = entries = [e for e in entries if e[0] is not job]
            if not entries:
                del self.parked[kv]
                if kv in self.tombstones:
                    self._tombstone(kv)
        if self._observers.enabled:
            self._observers.timeout(kind="unbound_store", kv_request_id=kv, peer="")
        self._ledger.close(job.job_id, Outcome.UNBOUND_TIMEOUT,
                           f"no consumer fetched {kv!r} within {self._timeouts.unbound_store}s")

    def fail_parked(self, outcome: Outcome, detail: str) -> None:
        parked, self.parked = self.parked, {}
        for entries in parked.values():
            for job, timer in entries:
                self._deadlines.cancel(timer)
                self._ledger.close(job.job_id, outcome, detail)

    @property
    def parked_count(self) -> int:
        return sum(len(e) for e in self.parked.values())

    def take_ends(self) -> list[object]:
        ends, self.ends = self.ends, []
        return ends

    def state_sizes(self) -> dict[str, int]:
        return {
            "producers": len(self.producers),
            "tombstones": len(self.tombstones),
            "parked": self.parked_count,
            "bindings": len(self.bindings),
            "failed_ids": len(self.failed),
            "deferred_ends": len(self.ends),
        }
