"""The results of a producer role's store jobs: each job gets exactly one, once decided.

A store job's result waits while any of its blocks is pinned (the consumer may be reading
them). Then it is, in this order: the failure recorded for it, ``done`` once every block was
delivered or superseded, ``store_timeout`` once its deadline passed, and for a request the
consumer ended, ``done`` or ``nothing_to_do`` by whether any block was delivered.

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable

from p2pkv.session.env import SessionEnv
from p2pkv.session.supply import ProducerRequest, StoreJob
from p2pkv.types import Job, Outcome


class StoreJobs:
    """Store jobs of one producer role: their deadlines and their results.

    ``settled`` is told of a request each time one of its jobs got its result (the role
    frees the request once nothing of it is left)."""

    def __init__(
        self, env: SessionEnv, peer: str, settled: Callable[[ProducerRequest], None]
    ) -> None:
        self._env = env
        self._peer = peer
        self._settled = settled

    def unlink(self) -> None:
        """The session closed with nothing left: forget its role (no reference cycle)."""
        self._settled = settled_nowhere

    def open(self, req: ProducerRequest, job: Job) -> StoreJob:
        """Track ``job`` of ``req`` and arm its store deadline."""
        sj = StoreJob(job.job_id, req, job.keys)
        req.jobs.add(sj)
        env = self._env
        sj.timer = env.deadlines.at(env.clock() + env.timeouts.store, self._timeout, sj)
        return sj

    def fail(self, sj: StoreJob, outcome: Outcome, detail: str) -> None:
        """Fail ``sj`` (the first failure wins); it is offered no more, and ends once
        nothing of it is pinned."""
        if sj.failure is None:
            sj.failure = (outcome, detail)
        sj.req.withdraw(sj)
        self.settle(sj)

    def settle(self, sj: StoreJob) -> None:
        """Report ``sj``'s result if it is decided and nothing of it is pinned."""
        if sj.done or sj.pinned:
            return
        if sj.failure is not None:
            outcome, detail = sj.failure
        elif sj.remaining <= 0:
            outcome, detail = Outcome.DONE, ""
        elif sj.timed_out:
            outcome, detail = (
                Outcome.STORE_TIMEOUT,
                f"not delivered within {self._env.timeouts.store}s",
            )
        elif sj.released:
            if sj.delivered:
                outcome, detail = Outcome.DONE, "consumer needed only part of the blocks"
            else:
                outcome, detail = Outcome.NOTHING_TO_DO, "consumer needed none of the blocks"
        else:
            return
        sj.done = True
        env = self._env
        env.deadlines.cancel(sj.timer)
        env.ledger.close(sj.job_id, outcome, detail)
        sj.req.jobs.discard(sj)
        self._settled(sj.req)

    def _timeout(self, sj: StoreJob) -> None:
        sj.timer = None
        self._env.observers.timeout(kind="store", kv_request_id=sj.req.kv, peer=self._peer)
        sj.timed_out = True  # a job being read fails only once the release decided
        sj.req.withdraw(sj)
        self.settle(sj)


def settled_nowhere(req: ProducerRequest) -> None:
    """What a closed session's producer parts tell of a request: nothing (see ``unlink``)."""
