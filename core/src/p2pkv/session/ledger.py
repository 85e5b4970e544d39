"""The job ledger: every submitted job id gets exactly one :class:`JobResult`.

``open`` records a job; ``close`` produces its result the first time and returns False (doing
nothing) for a job that already has one or was never opened, so late completions after a
timeout, an abort or a peer death can never produce a second result. Results wait in
``take`` order (completion order) until the engine collects them.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable

from p2pkv.errors import UsageError
from p2pkv.observers import Observers
from p2pkv.types import JobResult, Outcome

log = logging.getLogger(__name__)


class _Open:
    __slots__ = ("is_load", "kv_request_id", "peer", "started")

    def __init__(self, is_load: bool, kv_request_id: str, peer: str, started: float) -> None:
        self.is_load = is_load
        self.kv_request_id = kv_request_id
        self.peer = peer
        self.started = started


class JobLedger:
    """Open jobs and finished results, with per-outcome counters."""

    def __init__(self, clock: Callable[[], float], observers: Observers) -> None:
        self._clock = clock
        self._observers = observers
        self._open: dict[int, _Open] = {}
        self._results: list[JobResult] = []
        self._untaken: set[int] = set()
        """Ids of the results in ``_results``."""
        self.outcomes: Counter[Outcome] = Counter()

    def open(self, job_id: int, is_load: bool, kv_request_id: str = "", peer: str = "") -> None:
        """Record a new job. Raises ``UsageError`` if ``job_id`` is still open (engine bug)."""
        if job_id in self._open:
            raise UsageError(f"job id {job_id} is already in flight; job ids must be unique")
        self._open[job_id] = _Open(is_load, kv_request_id, peer, self._clock())

    def set_peer(self, job_id: int, peer: str) -> None:
        rec = self._open.get(job_id)
        if rec is not None:
            rec.peer = peer

    def is_open(self, job_id: int) -> bool:
        return job_id in self._open

    def close(self, job_id: int, outcome: Outcome, detail: str = "") -> bool:
        """Produce the job's result; False (and nothing) if it already has one or is unknown."""
        rec = self._open.pop(job_id, None)
        if rec is None:
            log.debug("job %d: late %s ignored (already finished)", job_id, outcome.value)
            return False
        self._results.append(JobResult(job_id, outcome, detail))
        self._untaken.add(job_id)
        self.outcomes[outcome] += 1
        obs = self._observers
        if obs.enabled:  # once per job: no keyword arguments built for nobody
            obs.job_finished(
                job_id=job_id,
                is_load=rec.is_load,
                outcome=outcome.value,
                kv_request_id=rec.kv_request_id,
                peer=rec.peer,
                seconds=self._clock() - rec.started,
            )
        return True

    def take(self) -> list[JobResult]:
        """Hand over every result produced since the last call."""
        out, self._results = self._results, []
        self._untaken.clear()
        return out

    def not_taken(self, job_id: int) -> bool:
        """True while ``job_id`` has a result the engine has not taken yet."""
        return job_id in self._untaken

    @property
    def pending(self) -> int:
        """Jobs without a result yet."""
        return len(self._open)

    @property
    def undelivered(self) -> int:
        """Results not yet handed over by ``take``."""
        return len(self._results)

    def open_ids(self) -> list[int]:
        return list(self._open)
