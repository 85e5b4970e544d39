"""The producer requests of this tier and who serves them (the tier's and sessions' shared
view of the producer side).

* **Producer requests** active here (``remote_decoder`` routing), and **tombstones** of
  finished ones (kept ``Timeouts.unbound_store`` seconds so a fetch that arrives after the
  request finished and its stores are gone is refused at once instead of waiting for the
  consumer's load timeout).
* **Parked stores**: store jobs whose consumer has not fetched yet, by ``kv_request_id`` in
  submit order, each failing with ``UNBOUND_TIMEOUT`` after ``Timeouts.unbound_store``.
* **Bindings**: ``kv_request_id`` -> the producer role holding its state. An entry lives
  exactly as long as that state (freed when the request is finished and drained).

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from p2pkv.config import Timeouts
from p2pkv.observers import Observers
from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.ledger import JobLedger
from p2pkv.types import Job, Outcome


class BoundProducer(Protocol):
    """What the directory and the tier use of the producer role a request is bound to
    (``p2pkv.session.producer_role.ProducerRole``; a Protocol so this module need not import
    it)."""

    @property
    def peer(self) -> str:
        """The consumer this role serves."""
        ...

    def add_store(self, kv: str, job: Job) -> None:
        """Serve store ``job`` of request ``kv`` to the consumer."""
        ...

    def producer_finished(self, kv: str) -> None:
        """The engine finished producer request ``kv``: free its state once drained."""
        ...


@dataclass(frozen=True)
class Claim:
    """A producer role takes over ``kv_request_id``: stores parked so far, in submit order,
    and whether more stores may still come (the local producer request is not finished)."""

    parked: Sequence[Job]
    supply_open: bool


class ProducerDirectory:
    def __init__(
        self,
        ledger: JobLedger,
        deadlines: Deadlines,
        clock: Callable[[], float],
        timeouts: Timeouts,
        observers: Observers,
    ) -> None:
        self._ledger = ledger
        self._deadlines = deadlines
        self._clock = clock
        self._timeouts = timeouts
        self._observers = observers
        self._active: set[str] = set()
        self._tombstones: dict[str, Timer] = {}
        self._parked: dict[str, list[tuple[Job, Timer]]] = {}
        self._bindings: dict[str, BoundProducer] = {}
        self._on_tombstone_expired = self._tombstone_expired
        """Bound once: arming a tombstone allocates no method object."""

    # -- bindings ---------------------------------------------------------------------------

    def claim(self, kv_request_id: str, role: BoundProducer, *, by_fetch: bool) -> Claim | str:
        """Bind ``kv_request_id`` to ``role``; a string is the reason it cannot be."""
        bound = self._bindings.get(kv_request_id)
        if bound is not None and bound is not role:
            return f"{kv_request_id!r} is already served to another consumer ({bound.peer})"
        entries = self._parked.pop(kv_request_id, None)
        active = kv_request_id in self._active
        if entries is None and not active and kv_request_id in self._tombstones:
            return f"{kv_request_id!r} already finished on the producer"
        parked: list[Job] = []
        for job, timer in entries or ():
            self._deadlines.cancel(timer)
            self._ledger.set_peer(job.job_id, role.peer)
            parked.append(job)
        # A fetch for an id never seen here waits for stores (decoder-first); a lookup-served
        # request only gets more supply while a local producer request is running.
        supply_open = active or (
            by_fetch and entries is None and kv_request_id not in self._tombstones
        )
        self._bindings[kv_request_id] = role
        return Claim(parked, supply_open)

    def bound(self, kv_request_id: str) -> BoundProducer | None:
        """The producer role holding state for ``kv_request_id``, if any."""
        return self._bindings.get(kv_request_id)

    def request_gone(self, kv_request_id: str, role: BoundProducer) -> None:
        """``role`` holds no more producer state for ``kv_request_id``."""
        if self._bindings.get(kv_request_id) is role:
            del self._bindings[kv_request_id]
        if kv_request_id in self._tombstones:
            self._tombstone(kv_request_id)  # counts from when the last state went away

    # -- producer requests ------------------------------------------------------------------

    @property
    def active_count(self) -> int:
        """Local producer requests that exist and have not finished."""
        return len(self._active)

    def producer_active(self, kv_request_id: str) -> bool:
        """A local producer request with this id exists and has not finished."""
        return kv_request_id in self._active

    def producer_started(self, kv_request_id: str) -> None:
        self._active.add(kv_request_id)
        self._deadlines.cancel(self._tombstones.pop(kv_request_id, None))

    def store_seen(self, kv_request_id: str) -> None:
        """A store arrived for the id: it is a producer request unless already known."""
        if kv_request_id not in self._active and kv_request_id not in self._tombstones:
            self.producer_started(kv_request_id)

    def producer_finished(self, kv_request_id: str) -> BoundProducer | None:
        """Forget the producer request; returns the role holding its state, if any."""
        self._active.discard(kv_request_id)
        self._tombstone(kv_request_id)
        return self._bindings.get(kv_request_id)

    def _tombstone(self, kv_request_id: str) -> None:
        self._deadlines.cancel(self._tombstones.pop(kv_request_id, None))
        self._tombstones[kv_request_id] = self._deadlines.at(
            self._clock() + self._timeouts.unbound_store, self._on_tombstone_expired, kv_request_id
        )

    def _tombstone_expired(self, kv_request_id: str) -> None:
        self._tombstones.pop(kv_request_id, None)

    # -- parked stores ----------------------------------------------------------------------

    def park(self, kv_request_id: str, job: Job) -> None:
        timer = self._deadlines.at(
            self._clock() + self._timeouts.unbound_store,
            self._unbound_expired,
            (kv_request_id, job),
        )
        self._parked.setdefault(kv_request_id, []).append((job, timer))

    def _unbound_expired(self, arg: tuple[str, Job]) -> None:
        kv, job = arg
        entries = self._parked.get(kv)
        if entries is not None:
            self._parked[kv] = entries = [e for e in entries if e[0] is not job]
            if not entries:
                del self._parked[kv]
                if kv in self._tombstones:
                    self._tombstone(kv)
        self._observers.timeout(kind="unbound_store", kv_request_id=kv, peer="")
        self._ledger.close(
            job.job_id,
            Outcome.UNBOUND_TIMEOUT,
            f"no consumer fetched {kv!r} within {self._timeouts.unbound_store}s",
        )

    def fail_parked(self, outcome: Outcome, detail: str) -> None:
        parked, self._parked = self._parked, {}
        for entries in parked.values():
            for job, timer in entries:
                self._deadlines.cancel(timer)
                self._ledger.close(job.job_id, outcome, detail)

    @property
    def parked_count(self) -> int:
        return sum(len(e) for e in self._parked.values())

    def state_sizes(self) -> dict[str, int]:
        return {
            "producers": len(self._active),
            "tombstones": len(self._tombstones),
            "parked": self.parked_count,
            "bindings": len(self._bindings),
        }
