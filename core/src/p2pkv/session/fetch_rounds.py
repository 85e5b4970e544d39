"""The open fetch rounds of a producer role: their pins, their leases, how each ends.

Blocks named in a ``ready`` stay **pinned**: their store jobs get no result, so the engine
keeps the source slots unchanged. A pin ends with the consumer's ``release`` for the round,
or when the lease (``timeouts.lease``) after the round's latest ``ready`` has passed. A
round no ``ready`` armed yet ends one lease after its fetch: demand is never held forever.
A session that dies does not shorten the lease: a paused or cut-off consumer may still be
reading. A failed round tells the consumer (``round_failed``) and then waits for its pins
only.

Threading: driver thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from p2pkv.protocol import Message, Ready, RoundFailed
from p2pkv.session.env import SessionEnv, dropped
from p2pkv.session.store_jobs import StoreJobs, settled_nowhere
from p2pkv.session.supply import Batch, FetchRound, ProducerRequest
from p2pkv.types import Outcome

Failure = tuple[Outcome, str]


class FetchRounds:
    """Rounds, pins and leases of one producer role (see the module docstring).

    ``send`` puts a message on the session (False: over the frame cap, not sent).
    ``maybe_done`` is told of a request each time one of its rounds ended."""

    def __init__(
        self,
        env: SessionEnv,
        peer: str,
        send: Callable[[Message], bool],
        jobs: StoreJobs,
        maybe_done: Callable[[ProducerRequest], None],
    ) -> None:
        self._env = env
        self._peer = peer
        self._send = send
        self._jobs = jobs
        self._maybe_done = maybe_done
        self.count = 0
        """Open rounds over all requests (a counter: the session's ``busy`` is hot)."""
        self.pinned = 0
        """Pinned blocks over all rounds (also after ``close``, until released or expired)."""
        self.closed = False
        self._after_close: list[FetchRound] = []
        """Rounds with pins when the session closed (their leases still run)."""

    def unlink(self) -> None:
        """The session closed with nothing left: forget it and its role (no reference
        cycle)."""
        self._send = dropped
        self._maybe_done = settled_nowhere

    def open(self, req: ProducerRequest, no: int, keys: list[bytes], held_all: bool) -> None:
        """Open round ``no`` of ``req`` for ``keys``: ready what is held, demand the rest."""
        rnd = FetchRound(req, no, len(keys))
        req.rounds[no] = rnd
        self.count += 1
        batch = req.add_demand(rnd, keys, held_all)
        if batch is not None:
            self.ready(rnd, batch)
        if rnd.timer is None and req.rounds.get(no) is rnd:  # no ready armed it
            self._arm_lease(rnd)

    def ready(self, rnd: FetchRound, batch: Batch) -> None:
        """Pin ``batch`` for the lease and tell the consumer where its blocks are."""
        pos, src, jobs = batch
        rnd.unready -= len(pos)
        self.pinned += len(jobs)
        pins = rnd.pins
        first = jobs[0]
        groups = (
            [(first, len(jobs))]
            if jobs.count(first) == len(jobs)  # one job: no loop
            else Counter(jobs).items()
        )
        for sj, n in groups:
            sj.pinned += n
            pins[sj] = pins.get(sj, 0) + n
        self._arm_lease(rnd)
        if not self._send(Ready(rnd.req.kv, rnd.no, pos, src)):  # the consumer's frame cap
            self.fail(rnd, Outcome.SUBMIT_FAILED, "its ready is larger than a frame may be")

    def release(self, rnd: FetchRound, failure: Failure | None) -> None:
        """Unpin ``rnd`` (delivered when ``failure`` is None, else failed with it) and end
        it."""
        self._unpin(rnd, failure)
        self.end(rnd)

    def fail(self, rnd: FetchRound, outcome: Outcome, detail: str) -> None:
        """Tell the consumer the round cannot be served. It ends once its pins are released
        (at once when it has none)."""
        if rnd.failure is not None:
            return
        rnd.failure = (outcome, detail)
        rnd.req.drop_waiting(rnd)
        if not self.closed:
            self.refuse(rnd.req.kv, rnd.no, outcome, detail)
        if not rnd.pins:
            self.end(rnd)

    def end(self, rnd: FetchRound) -> None:
        """Forget ``rnd`` (its pins already released)."""
        req = rnd.req
        if req.rounds.get(rnd.no) is not rnd:
            return
        req.drop_waiting(rnd)
        self._env.deadlines.cancel(rnd.timer)
        rnd.timer = None
        del req.rounds[rnd.no]
        self.count -= 1
        self._maybe_done(req)

    def refuse(self, kv: str, no: int, outcome: Outcome, detail: str) -> None:
        """Send ``round_failed`` for round ``no`` of ``kv``."""
        self._send(RoundFailed(kv, no, f"{outcome.value}: {detail}", outcome.value))

    def close(self, reqs: Iterable[ProducerRequest], outcome: Outcome, reason: str) -> None:
        """The session is over: every round of ``reqs`` fails with ``outcome``, unsent. A
        round with pins waits for its lease (a cut-off consumer may still read);
        :meth:`drop_pins` ends that wait early."""
        self.closed = True
        cancel = self._env.deadlines.cancel
        kept: list[FetchRound] = []
        for req in reqs:
            for rnd in list(req.rounds.values()):
                rnd.failure = (outcome, reason)
                req.drop_waiting(rnd)
                if rnd.pins:
                    kept.append(rnd)
                else:
                    cancel(rnd.timer)
                    del req.rounds[rnd.no]
        self._after_close = kept
        self.count = len(kept)

    def drop_pins(self, outcome: Outcome, reason: str) -> int:
        """Stop waiting for the leases of a closed session (tier shutdown): the pinned store
        jobs get their results now. Returns how many blocks were still pinned."""
        n = self.pinned
        for rnd in self._after_close:
            self.release(rnd, (outcome, reason))
        self._after_close = []
        return n

    def _unpin(self, rnd: FetchRound, failure: Failure | None) -> None:
        pins, rnd.pins = rnd.pins, {}
        n_pinned = sum(pins.values())
        self.pinned -= n_pinned
        if failure is None:
            self._env.counters["blocks_sent"] += n_pinned
        for sj, n in pins.items():
            sj.pinned -= n
            if failure is None:
                sj.remaining -= n
                sj.delivered += n
            elif sj.failure is None:
                sj.failure = failure
        for sj in pins:
            self._jobs.settle(sj)

    def _arm_lease(self, rnd: FetchRound) -> None:
        env = self._env
        env.deadlines.cancel(rnd.timer)
        rnd.timer = env.deadlines.at(env.clock() + env.timeouts.lease, self._lease_expired, rnd)

    def _lease_expired(self, rnd: FetchRound) -> None:
        """The lease after the round's latest ``ready`` (or its fetch) passed without a
        release: the consumer gave it up (or is paused, or gone). Unpin and end it."""
        rnd.timer = None
        env = self._env
        env.observers.timeout(kind="lease", kv_request_id=rnd.req.kv, peer=self._peer)
        detail = f"the consumer did not release it within the lease ({env.timeouts.lease}s)"
        self._unpin(rnd, (Outcome.TRANSFER_FAILED, detail))
        if rnd.failure is None and not self.closed:
            self.fail(rnd, Outcome.LOAD_TIMEOUT, detail)
        self.end(rnd)
