"""Producer role of a session: supply, demand, pins under a lease, lookup serving.

Per ``kv_request_id`` the role keeps the **supply** (blocks stored by the engine and not yet
offered: key -> local slot, key -> store job) and the **demand** of the consumer's open fetch
rounds (key -> round, key -> the key's position in its fetch). As soon as both exist for
some keys, one ``ready`` tells the consumer where they are, and **the consumer reads them**:
the producer never writes into a peer's region (docs/protocol.md §5). Parallel dicts rather
than a tuple per entry: no per-block objects beyond the dict entries.

Invariants (docs/protocol.md, "Producer"):

* Blocks named in a ``ready`` stay **pinned** (their store jobs get no result, so the engine
  keeps the source slots unchanged) until the consumer's ``release`` for the round or until
  the lease (``timeouts.lease``) after the round's latest ``ready`` has passed. A session
  that dies does not shorten the lease: a paused or cut-off consumer may still be reading.
  The consumer accepts a read only if it completed within the lease of its own fetch, which
  went out before our ``ready``: so it never accepts bytes of a slot we unpinned.
* ``release(read=True)`` delivers the round's blocks (their store jobs complete ``done``);
  ``read=False`` or the lease passing fails them (``aborted`` / ``transfer_failed``).
* A round fails fast (``round_failed``, ``demand_unmet``) when it demands a key that cannot
  come any more (the local producer request finished, or the request is lookup-served only).
  A round with no pins ends at once; one with pins waits for its release or lease.
* A round never sees ``ready`` for all its keys by the lease after its fetch arrived (its
  consumer gave it up long before) ends then: demand is never held forever.
* At shutdown (``wind_down``) every open round fails (``peer_dead`` for the consumer) and
  later fetches fail at once; pins wait for the consumer's release within the tier's
  shutdown budget.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Sequence

from p2pkv.errors import ProtocolError, UsageError
from p2pkv.protocol import Fetch, Lookup, LookupResp, Ready, Release, RoundFailed
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv, SessionLink
from p2pkv.types import Job, LocalHitSource, LookupResult, Outcome

__all__ = ["ServerRole"]

log = logging.getLogger(__name__)


class _StoreJob:
    __slots__ = (
        "delivered", "done", "failure", "job_id", "keys", "pinned", "released", "remaining",
        "req", "timed_out", "timer",
    )

    def __init__(self, job_id: int, req: ProducerRequest, keys: Sequence[bytes]) -> None:
        self.job_id = job_id
        self.req = req
        self.keys = keys
        self.remaining = len(keys)
        """Blocks neither delivered nor superseded."""
        self.pinned = 0
        """Blocks of this job named in a ``ready`` and not yet released or expired."""
        self.delivered = 0
        self.failure: tuple[Outcome, str] | None = None
        self.released = False
        """The consumer is done with the request: undelivered blocks are not needed."""
        self.done = False
        self.timed_out = False
        """The store deadline passed: the job fails it unless every block was delivered, once
        no block is pinned any more."""
        self.timer: Timer | None = None


class FetchRound:
    __slots__ = ("failure", "no", "pins", "req", "timer", "unready", "waiting")

    def __init__(self, req: ProducerRequest, no: int, size: int) -> None:
        self.req = req
        self.no = no
        self.unready = size
        """Keys not yet named in a ``ready``."""
        self.waiting = 0
        """Keys demanded with no supply yet."""
        self.pins: dict[_StoreJob, int] = {}
        """Store job -> how many of its blocks this round pins (in the order first pinned)."""
        self.failure: tuple[Outcome, str] | None = None
        """Set once ``round_failed`` went out (the round waits for its pins only)."""
        self.timer: Timer | None = None


class ProducerRequest:
    __slots__ = ("demand", "demand_pos", "jobs", "kv", "max_round", "released", "rounds",
                 "supply", "supply_job", "supply_open")

    def __init__(self, kv: str, supply_open: bool) -> None:
        self.kv = kv
        self.supply: dict[bytes, int] = {}
        """Key -> our slot holding it (with ``supply_job``: the job that pins it)."""
        self.supply_job: dict[bytes, _StoreJob] = {}
        self.demand: dict[bytes, FetchRound] = {}
        """Key -> the open round waiting for it (with ``demand_pos``: its position there)."""
        self.demand_pos: dict[bytes, int] = {}
        self.rounds: dict[int, FetchRound] = {}
        self.jobs: set[_StoreJob] = set()
        self.max_round = -1
        self.supply_open = supply_open
        self.released = False


class _Serve:
    __slots__ = ("answers", "begun", "handle", "keys", "kv", "seq", "timer")

    def __init__(self, seq: int, kv: str, keys: list[bytes]) -> None:
        self.seq = seq
        self.kv = kv
        self.keys = keys
        self.answers: list[bool | None] = [None] * len(keys)
        self.begun = False
        self.handle: object = None
        self.timer: Timer | None = None


class ServerRole:
    """The producer half of one session (see the module docstring)."""

    def __init__(self, env: SessionEnv, session: SessionLink) -> None:
        self.env = env
        self.session = session
        self.peer = session.peer
        self.reqs: dict[str, ProducerRequest] = {}
        self.serves: dict[int, _Serve] = {}
        self.last_lookup_seq = -1
        self.closing = False
        self.winding_down = False
        self.n_rounds = 0
        """Open fetch rounds over all requests (kept as a counter: ``busy`` is hot)."""
        self.n_pins = 0
        """Pinned blocks over all rounds (also after ``close``, until released or expired)."""
        self._closed_rounds: list[tuple[ProducerRequest, FetchRound]] = []
        """Rounds with pins when the session closed (their leases still run)."""
        self._on_store_timeout = self._store_timeout
        self._on_lease_expired = self._lease_expired
        """Bound once: arming a deadline allocates no method object."""

    # -- engine side ------------------------------------------------------------------------

    def add_store(self, kv: str, job: Job) -> None:
        """Offer a store job's blocks for ``kv`` (bound to this session)."""
        req = self.reqs.get(kv)
        if req is None:  # bound requests always have state; recreate defensively
            req = self.reqs[kv] = ProducerRequest(kv, self.env.producers.producer_active(kv))
        self._add_supply(req, job)

    def producer_finished(self, kv: str) -> None:
        """The local producer request finished: no more supply will come for ``kv``."""
        req = self.reqs.get(kv)
        if req is None:
            return
        req.supply_open = False
        for rnd in list(req.rounds.values()):
            if rnd.waiting:
                self._fail_round(
                    req, rnd, Outcome.DEMAND_UNMET,
                    f"{rnd.waiting} demanded block(s) were never stored by the producer",
                )
        self._maybe_drop(req)

    def wind_down(self) -> None:
        """The tier is shutting down: fail every open round (``peer_dead`` for the consumer)
        and the store jobs not pinned (SHUTDOWN); refuse later fetches and lookups. Pinned
        blocks wait for the consumer's release (the tier bounds the wait)."""
        self.winding_down = True
        detail = "the producer is shutting down"
        for req in list(self.reqs.values()):
            req.supply_open = False
            for rnd in list(req.rounds.values()):
                self._fail_round(req, rnd, Outcome.PEER_DEAD, detail)  # as the peer sees it
            for sj in list(req.jobs):
                if not sj.pinned:  # a pinned one ends with its release (done if read)
                    self._fail_job(sj, Outcome.SHUTDOWN, detail)

    # -- messages ---------------------------------------------------------------------------

    def on_fetch(self, msg: Fetch) -> None:
        """Open a round for the fetched keys (or release the request on a terminal fetch);
        a fetch that cannot be served is answered ``round_failed`` at once."""
        if msg.keys and len(set(msg.keys)) != len(msg.keys):
            raise ProtocolError("fetch.keys: duplicate key")
        if msg.keys and self.winding_down:
            self._refuse_winding_down(msg)
            return
        req = self._request_for_fetch(msg)
        if req is None:
            return
        if not msg.keys:
            self._release_request(req)
            return
        held_all = self._servable(req, msg)
        if held_all is not None:
            rnd = FetchRound(req, msg.round, len(msg.keys))
            req.rounds[msg.round] = rnd
            self.n_rounds += 1
            self._match_fetch(req, rnd, msg.keys, held_all)
            if rnd.timer is None and req.rounds.get(rnd.no) is rnd:  # no ready armed it
                self._arm_lease(rnd)

    def _refuse_winding_down(self, msg: Fetch) -> None:
        req = self.reqs.get(msg.kv_request_id)
        if req is not None:  # its release(read=False) will name this round
            req.max_round = max(req.max_round, msg.round)
        self._send_failed(msg.kv_request_id, msg.round, Outcome.PEER_DEAD,
                          "the producer is shutting down")

    def _servable(self, req: ProducerRequest, msg: Fetch) -> bool | None:
        """Whether the supply holds every key of the fetch, or None when it cannot be served
        (a request conflict, or demand the closed supply cannot meet: answered already)."""
        keys = msg.keys
        conflict = self._conflict(req, keys)
        if conflict:  # a request-level conflict fails that round, not the session
            log.warning("peer %s: round %d of %r refused: %s", self.peer, msg.round, req.kv,
                        conflict)
            self._send_failed(req.kv, msg.round, Outcome.REQUEST_CONFLICT, conflict)
            return None
        supply = req.supply
        held_all = supply.keys() >= set(keys)
        if not req.supply_open and not held_all:
            missing = sum(1 for k in keys if k not in supply)
            self._send_failed(req.kv, msg.round, Outcome.DEMAND_UNMET,
                              f"{missing} of {len(keys)} block(s) are not held and cannot "
                              f"arrive")
            self._maybe_drop(req)
            return None
        return held_all

    def _claimed(self, kv: str, *, by_fetch: bool) -> ProducerRequest | str:
        """The state for ``kv``, claiming the request (and its parked stores) on first sight;
        why it cannot be served here, if so."""
        req = self.reqs.get(kv)
        if req is None:
            claim = self.env.producers.claim(kv, self, by_fetch=by_fetch)
            if isinstance(claim, str):
                return claim
            req = self.reqs[kv] = ProducerRequest(kv, claim.supply_open)
            for job in claim.parked:
                self._add_supply(req, job)
        return req

    def _request_for_fetch(self, msg: Fetch) -> ProducerRequest | None:
        """The producer state for ``msg``'s request (claimed on first sight), after checking
        its round number; None when there is nothing to serve (answered already)."""
        kv = msg.kv_request_id
        if not msg.keys and kv not in self.reqs:
            return None  # terminal fetch for a request we hold nothing for
        req = self._claimed(kv, by_fetch=True)
        if isinstance(req, str):
            self._send_failed(kv, msg.round, Outcome.DEMAND_UNMET, req)
            return None
        if msg.round <= req.max_round:  # e.g. a finished kv_request_id reused: that round fails
            if msg.keys:
                self._send_failed(kv, msg.round, Outcome.REQUEST_CONFLICT,
                                  f"round {msg.round} is not above the previous round "
                                  f"{req.max_round} of {kv!r} (is the kv_request_id reused "
                                  f"while the producer still holds it?)")
            return None
        req.max_round = msg.round
        return req

    def _match_fetch(self, req: ProducerRequest, rnd: FetchRound, keys: list[bytes],
                     held_all: bool) -> None:
        supply, supply_job, demand, demand_pos = (req.supply, req.supply_job, req.demand,
                                                  req.demand_pos)
        if held_all:  # producer first: everything is here (C-level passes)
            self._ready(req, rnd, list(range(len(keys))), list(map(supply.pop, keys)),
                        list(map(supply_job.pop, keys)))
            return
        if not supply:  # consumer first: everything waits
            demand.update(dict.fromkeys(keys, rnd))
            demand_pos.update(zip(keys, range(len(keys)), strict=True))
            rnd.waiting = len(keys)
            return
        pos: list[int] = []
        src: list[int] = []
        jobs: list[_StoreJob] = []
        for i, k in enumerate(keys):
            held = supply.pop(k, None)
            if held is None:
                demand[k] = rnd
                demand_pos[k] = i
                rnd.waiting += 1
            else:
                pos.append(i)
                src.append(held)
                jobs.append(supply_job.pop(k))
        if pos:
            self._ready(req, rnd, pos, src, jobs)

    @staticmethod
    def _conflict(req: ProducerRequest, keys: list[bytes]) -> str:
        """Why a new round of ``req`` asking for ``keys`` cannot be served, or ``""``."""
        if req.released:
            return f"{req.kv!r} was already ended by a terminal fetch"
        demand = req.demand
        if demand and not demand.keys().isdisjoint(keys):
            k = next(k for k in keys if k in demand)
            return f"a key is already demanded by round {demand[k].no} of {req.kv!r}"
        return ""

    def on_release(self, msg: Release) -> None:
        """The consumer is done with a round: unpin (delivered if ``read``), end it."""
        req = self.reqs.get(msg.kv_request_id)
        if req is None:
            return  # ended here already (lease passed, or the session was rebuilt)
        if msg.round > req.max_round:
            raise ProtocolError(f"release.round: round {msg.round} of {req.kv!r} was never "
                                f"fetched")
        rnd = req.rounds.get(msg.round)
        if rnd is None:
            return
        if msg.read and rnd.unready:
            raise ProtocolError(f"release.read: round {msg.round} of {req.kv!r} still has "
                                f"{rnd.unready} block(s) never announced")
        if msg.read:
            self._unpin(rnd, None)
        else:
            self._unpin(rnd, (Outcome.ABORTED, "the consumer gave the round up"))
        self._end_round(req, rnd)

    def on_lookup(self, msg: Lookup) -> None:
        if msg.seq <= self.last_lookup_seq:
            raise ProtocolError(
                f"lookup.seq: {msg.seq} is not above the previous lookup {self.last_lookup_seq}"
            )
        self.last_lookup_seq = msg.seq
        if not self.env.lookup_ends.source_seen or self.winding_down:
            self.session.send(LookupResp(msg.seq, [False] * len(msg.keys)))
            return
        serve = _Serve(msg.seq, msg.kv_request_id, msg.keys)
        serve.timer = self.env.deadlines.at(
            self.env.clock() + self.env.timeouts.lookup, self._serve_expired, serve
        )
        self.serves[msg.seq] = serve

    # -- lookup serving ---------------------------------------------------------------------

    def serve(self, source: LocalHitSource) -> None:
        """Advance every pending lookup with ``source``; answer the settled ones."""
        if not self.serves:
            return
        now = self.env.clock()
        for serve in list(self.serves.values()):
            answers = serve.answers
            try:
                if not serve.begun:
                    serve.handle = source.begin(serve.kv)
                    serve.begun = True
                for i, key in enumerate(serve.keys):
                    if answers[i] is None:
                        res = source.lookup(serve.handle, key)
                        if res is LookupResult.HIT:
                            answers[i] = True
                        elif res is LookupResult.MISS:
                            answers[i] = False
            except Exception:
                log.exception("peer %s: hit source failed serving lookup %d of %r; "
                              "answering MISS", self.peer, serve.seq, serve.kv)
                self._answer_miss(serve, source)
                continue
            expired = serve.timer is not None and now >= serve.timer[0]
            if expired or None not in answers:
                self._answer(serve, source)

    def _answer(self, serve: _Serve, source: LocalHitSource) -> None:
        hits = [a is True for a in serve.answers]
        hit_keys = [k for k, h in zip(serve.keys, hits, strict=True) if h]
        if hit_keys:
            pinned: set[bytes] | None = None
            try:
                job = source.pin(serve.handle, hit_keys)
            except Exception:
                log.exception("peer %s: hit source pin() failed; answering MISS", self.peer)
            else:
                pinned = self._adopt_pinned(serve.kv, job)
            hits = [h and pinned is not None and k in pinned
                    for k, h in zip(serve.keys, hits, strict=True)]
        self._finish_serve(serve, hits)
        self._end(source, serve.handle)

    def _end(self, source: LocalHitSource, handle: object) -> None:
        try:
            source.end(handle)
        except Exception:
            log.exception("peer %s: hit source end() failed", self.peer)

    def _adopt_pinned(self, kv: str, job: Job) -> set[bytes] | None:
        """Turn a pinned job into supply for ``kv``; None if it cannot serve (then the job
        already has its result, or could not be recorded)."""
        ledger = self.env.ledger
        try:
            ledger.open(job.job_id, False, kv, self.peer)
        except UsageError:
            log.exception("peer %s: hit source pinned an unusable job; answering MISS", self.peer)
            return None
        if job.is_load or len(job.keys) != len(job.block_ids):
            ledger.close(job.job_id, Outcome.SUBMIT_FAILED,
                         "pinned job is not a store with one slot per key")
            return None
        req = self._claimed(kv, by_fetch=False)
        if isinstance(req, str):
            ledger.close(job.job_id, Outcome.NOTHING_TO_DO, req)
            return None
        self._add_supply(req, job)
        return set(job.keys)

    def _answer_miss(self, serve: _Serve, source: LocalHitSource | None) -> None:
        self._finish_serve(serve, [False] * len(serve.keys))
        if serve.begun:
            if source is None:
                self.env.lookup_ends.defer(serve.handle)
            else:
                self._end(source, serve.handle)

    def _finish_serve(self, serve: _Serve, hits: list[bool]) -> None:
        self.env.deadlines.cancel(serve.timer)
        self.serves.pop(serve.seq, None)
        self.session.send(LookupResp(serve.seq, hits))

    def _serve_expired(self, serve: _Serve) -> None:
        """The lookup deadline passed with no ``serve_lookups`` call to finish it: MISS."""
        serve.timer = None
        self.env.observers.timeout(kind="lookup", kv_request_id=serve.kv, peer=self.peer)
        self._answer_miss(serve, None)

    # -- supply and matching ----------------------------------------------------------------

    def _add_supply(self, req: ProducerRequest, job: Job) -> None:
        sj = _StoreJob(job.job_id, req, job.keys)
        req.jobs.add(sj)
        env = self.env
        sj.timer = env.deadlines.at(env.clock() + env.timeouts.store, self._on_store_timeout, sj)
        if req.released:
            sj.released = True
            self._maybe_release_job(sj)
            return
        supply, supply_job, demand = req.supply, req.supply_job, req.demand
        keys = job.keys
        if not demand and supply.keys().isdisjoint(keys):  # nothing to match: just hold them
            before = len(supply)
            supply.update(zip(keys, job.block_ids, strict=True))
            supply_job.update(dict.fromkeys(keys, sj))
            sj.remaining -= len(keys) - (len(supply) - before)  # a key twice in one job
            self._maybe_release_job(sj)
            return
        matched: dict[FetchRound, tuple[list[int], list[int], list[_StoreJob]]] = {}
        for key, slot in zip(keys, job.block_ids, strict=True):
            rnd = demand.pop(key, None)
            if rnd is None:
                if key in supply:
                    sj.remaining -= 1  # an earlier job holds this key already
                else:
                    supply[key] = slot
                    supply_job[key] = sj
                continue
            rnd.waiting -= 1
            group = matched.get(rnd)
            if group is None:
                group = matched[rnd] = ([], [], [])
            group[0].append(req.demand_pos.pop(key))
            group[1].append(slot)
            group[2].append(sj)
        for rnd, (pos, src, jobs) in matched.items():
            self._ready(req, rnd, pos, src, jobs)
        self._maybe_release_job(sj)

    def _ready(self, req: ProducerRequest, rnd: FetchRound, pos: list[int], src: list[int],
               jobs: list[_StoreJob]) -> None:
        """Pin ``src`` (blocks of ``jobs``) for the lease and tell the consumer."""
        rnd.unready -= len(pos)
        self.n_pins += len(jobs)
        pins = rnd.pins
        first = jobs[0]
        groups = ([(first, len(jobs))] if jobs.count(first) == len(jobs)  # one job: no loop
                  else Counter(jobs).items())
        for sj, n in groups:
            sj.pinned += n
            pins[sj] = pins.get(sj, 0) + n
        self._arm_lease(rnd)
        if not self.session.send(Ready(req.kv, rnd.no, pos, src)):  # the consumer's frame cap
            self._fail_round(req, rnd, Outcome.SUBMIT_FAILED, "its ready is larger than a "
                             "frame may be")

    def _arm_lease(self, rnd: FetchRound) -> None:
        env = self.env
        env.deadlines.cancel(rnd.timer)
        rnd.timer = env.deadlines.at(env.clock() + env.timeouts.lease, self._on_lease_expired,
                                     rnd)

    def _unpin(self, rnd: FetchRound, failure: tuple[Outcome, str] | None) -> None:
        """Release the round's pins: delivered (``failure`` None) or failed with it."""
        pins, rnd.pins = rnd.pins, {}
        n_pinned = sum(pins.values())
        self.n_pins -= n_pinned
        if failure is None:
            self.env.counters["blocks_sent"] += n_pinned
        for sj, n in pins.items():
            sj.pinned -= n
            if failure is None:
                sj.remaining -= n
                sj.delivered += n
            elif sj.failure is None:
                sj.failure = failure
        for sj in pins:
            self._maybe_release_job(sj)

    # -- rounds -----------------------------------------------------------------------------

    def _fail_round(self, req: ProducerRequest, rnd: FetchRound, outcome: Outcome,
                    detail: str) -> None:
        """Tell the consumer the round cannot be served; it ends once its pins are released
        (at once when it has none)."""
        if rnd.failure is not None:
            return
        rnd.failure = (outcome, detail)
        self._drop_waiting(req, rnd)
        if not self.closing:
            self._send_failed(req.kv, rnd.no, outcome, detail)
        if not rnd.pins:
            self._end_round(req, rnd)

    @staticmethod
    def _drop_waiting(req: ProducerRequest, rnd: FetchRound) -> None:
        if rnd.waiting:
            for k in [k for k, r in req.demand.items() if r is rnd]:
                del req.demand[k]
                del req.demand_pos[k]
            rnd.waiting = 0

    def _end_round(self, req: ProducerRequest, rnd: FetchRound) -> None:
        if req.rounds.get(rnd.no) is not rnd:
            return
        self._drop_waiting(req, rnd)
        self.env.deadlines.cancel(rnd.timer)
        rnd.timer = None
        del req.rounds[rnd.no]
        self.n_rounds -= 1
        self._maybe_drop(req)

    def _send_failed(self, kv: str, rnd_no: int, outcome: Outcome, detail: str) -> None:
        self.session.send(RoundFailed(kv, rnd_no, f"{outcome.value}: {detail}", outcome.value))

    def _lease_expired(self, rnd: FetchRound) -> None:
        """The lease after the round's latest ``ready`` (or its fetch) passed without a
        release: the consumer gave it up (or is paused, or gone); unpin and end it."""
        req = rnd.req
        rnd.timer = None
        env = self.env
        env.observers.timeout(kind="lease", kv_request_id=req.kv, peer=self.peer)
        detail = f"the consumer did not release it within the lease ({env.timeouts.lease}s)"
        self._unpin(rnd, (Outcome.TRANSFER_FAILED, detail))
        if rnd.failure is None and not self.closing:
            self._fail_round(req, rnd, Outcome.LOAD_TIMEOUT, detail)
        self._end_round(req, rnd)

    def _release_request(self, req: ProducerRequest) -> None:
        """Terminal fetch: the consumer is done with ``req``; release everything."""
        req.released = True
        req.supply.clear()
        req.supply_job.clear()
        for rnd in list(req.rounds.values()):
            self._unpin(rnd, (Outcome.ABORTED, "the consumer ended the request"))
            self._end_round(req, rnd)
        for sj in list(req.jobs):
            sj.released = True
            self._maybe_release_job(sj)
        self._maybe_drop(req)

    # -- store jobs -------------------------------------------------------------------------

    def _store_timeout(self, sj: _StoreJob) -> None:
        sj.timer = None
        self.env.observers.timeout(kind="store", kv_request_id=sj.req.kv, peer=self.peer)
        sj.timed_out = True  # a job being read fails only once the release decided
        self._withdraw(sj)
        self._maybe_release_job(sj)

    def _fail_job(self, sj: _StoreJob, outcome: Outcome, detail: str) -> None:
        if sj.failure is None:
            sj.failure = (outcome, detail)
        self._withdraw(sj)
        self._maybe_release_job(sj)

    @staticmethod
    def _withdraw(sj: _StoreJob) -> None:
        """Offer none of ``sj``'s blocks any more."""
        supply, supply_job = sj.req.supply, sj.req.supply_job
        if supply:
            for key in sj.keys:
                if supply_job.get(key) is sj:
                    del supply[key]
                    del supply_job[key]

    def _maybe_release_job(self, sj: _StoreJob) -> None:
        if sj.done or sj.pinned:
            return
        if sj.failure is not None:
            outcome, detail = sj.failure
        elif sj.remaining <= 0:
            outcome, detail = Outcome.DONE, ""
        elif sj.timed_out:
            outcome, detail = (Outcome.STORE_TIMEOUT,
                               f"not delivered within {self.env.timeouts.store}s")
        elif sj.released:
            if sj.delivered:
                outcome, detail = Outcome.DONE, "consumer needed only part of the blocks"
            else:
                outcome, detail = Outcome.NOTHING_TO_DO, "consumer needed none of the blocks"
        else:
            return
        sj.done = True
        self.env.deadlines.cancel(sj.timer)
        self.env.ledger.close(sj.job_id, outcome, detail)
        sj.req.jobs.discard(sj)
        self._maybe_drop(sj.req)

    def _maybe_drop(self, req: ProducerRequest) -> None:
        if self.closing or req.rounds or req.jobs or self.reqs.get(req.kv) is not req:
            return
        if self.env.producers.producer_active(req.kv):
            return  # keep the binding: more stores will come for this request
        del self.reqs[req.kv]
        self.env.producers.request_gone(req.kv, self)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: fail every store job with ``outcome``. Jobs with pinned
        blocks get that result only when their lease passes (a cut-off consumer may still be
        reading them); :meth:`drop_pins` ends that wait early (tier shutdown)."""
        self.closing = True
        env = self.env
        for serve in self.serves.values():
            env.deadlines.cancel(serve.timer)
            if serve.begun:
                env.lookup_ends.defer(serve.handle)
        self.serves.clear()
        reqs = list(self.reqs.values())
        self.reqs.clear()
        for req in reqs:
            for rnd in list(req.rounds.values()):
                rnd.failure = (outcome, reason)
                self._drop_waiting(req, rnd)
                if not rnd.pins:
                    env.deadlines.cancel(rnd.timer)
                    del req.rounds[rnd.no]
            for sj in list(req.jobs):
                self._fail_job(sj, outcome, reason)
            env.producers.request_gone(req.kv, self)
        self._closed_rounds = [(req, rnd) for req in reqs for rnd in req.rounds.values()]
        self.n_rounds = len(self._closed_rounds)

    def drop_pins(self, outcome: Outcome, reason: str) -> int:
        """Stop waiting for the leases of a closed session (tier shutdown): the pinned store
        jobs get their results now. Returns how many blocks were still pinned."""
        n = self.n_pins
        for req, rnd in self._closed_rounds:
            self._unpin(rnd, (outcome, reason))
            self._end_round(req, rnd)
        self._closed_rounds = []
        return n

    @property
    def busy(self) -> bool:
        """Rounds, pins or lookups outstanding (a reason for the engine to keep ticking)."""
        return bool(self.serves or self.n_rounds or self.n_pins)

    def state_sizes(self) -> dict[str, int]:
        return {
            "server_requests": len(self.reqs),
            "server_rounds": self.n_rounds,
            "server_jobs": sum(len(r.jobs) for r in self.reqs.values()),
            "supply": sum(len(r.supply) for r in self.reqs.values()),
            "demand": sum(len(r.demand) for r in self.reqs.values()),
            "pins": self.n_pins,
            "serves": len(self.serves),
        }
