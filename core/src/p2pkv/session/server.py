"""Producer role of a session: supply, demand, transfers, aborts and lookup serving.

Per ``kv_request_id`` the role keeps the **supply** (blocks stored by the engine and not yet
sent: key -> local slot, key -> store job) and the **demand** of the consumer's open fetch
rounds (key -> round, key -> destination slot). A block is written as soon as both exist; one
``write_blocks`` per round per batch. Parallel dicts rather than a tuple per entry: no
per-block objects beyond the dict entries.

Invariants (docs/protocol.md, "Producer"):

* ``transfer_done`` / ``abort_ack`` for a round is sent only when none of the round's
  transfers is in flight, so the consumer may release its slots on receipt.
* A store job's result is produced only when none of its blocks is in flight (the engine
  unpins the source slots on that result).
* A round fails fast with ``demand_unmet`` when it demands a key that cannot come any more
  (the local producer request finished, or the request is lookup-served only).
* A round still open ``timeouts.load + 2 * timeouts.abort_ack`` after its fetch (its consumer
  has given it up; only a lost or reordered abort leaves it open) fails ``load_timeout``:
  demand is never held forever.
* At shutdown (``wind_down``) every open round fails (``peer_dead``) once its writes are
  over, and later fetches fail at once: the consumer learns that no write of ours is live
  before we say ``bye`` (docs/protocol.md §10).

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING

from p2pkv.contracts import CancelMode
from p2pkv.errors import ProtocolError
from p2pkv.protocol import Abort, AbortAck, Fetch, Lookup, LookupResp, TransferDone
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv
from p2pkv.types import Job, LookupResult, Outcome

if TYPE_CHECKING:
    from p2pkv.session.session import Session
    from p2pkv.tier import LocalHitSource

__all__ = ["ServerRole"]

log = logging.getLogger(__name__)


def _round_lifetime(env: SessionEnv) -> float:
    """How long a fetch round may stay open: the consumer's load deadline and its abort-ack
    window (both counted from before the fetch arrived here), plus one more window of margin
    so the consumer's own deadline always fires first."""
    return env.timeouts.load + 2 * env.timeouts.abort_ack


class _StoreJob:
    __slots__ = (
        "delivered", "done", "failure", "inflight", "job_id", "keys", "released",
        "remaining", "req", "timer",
    )

    def __init__(self, job_id: int, req: _Req, keys: Sequence[bytes]) -> None:
        self.job_id = job_id
        self.req = req
        self.keys = keys
        self.remaining = len(keys)
        """Blocks neither delivered nor superseded."""
        self.inflight = 0
        """Blocks of this job inside transfers that have not terminated."""
        self.delivered = 0
        self.failure: tuple[Outcome, str] | None = None
        self.released = False
        """The consumer is done with the request: undelivered blocks are not needed."""
        self.done = False
        self.timer: Timer | None = None


class _Round:
    __slots__ = ("aborting", "failure", "inflight", "no", "remaining", "silent", "tids",
                 "timer", "waiting")

    def __init__(self, no: int, remaining: int) -> None:
        self.no = no
        self.remaining = remaining
        """Blocks not yet delivered."""
        self.waiting = 0
        """Blocks demanded with no supply yet."""
        self.inflight = 0
        self.tids: set[int] = set()
        self.failure: tuple[Outcome, str] | None = None
        self.aborting = False
        self.silent = False
        """Aborted by a terminal fetch: no abort_ack is owed."""
        self.timer: Timer | None = None


class _Req:
    __slots__ = ("demand", "demand_slot", "jobs", "kv", "max_round", "released", "rounds",
                 "supply", "supply_job", "supply_open")

    def __init__(self, kv: str, supply_open: bool) -> None:
        self.kv = kv
        self.supply: dict[bytes, int] = {}
        """Key -> our slot holding it (with ``supply_job``: the job that pins it)."""
        self.supply_job: dict[bytes, _StoreJob] = {}
        self.demand: dict[bytes, _Round] = {}
        """Key -> the open round waiting for it (with ``demand_slot``: where it must go)."""
        self.demand_slot: dict[bytes, int] = {}
        self.rounds: dict[int, _Round] = {}
        self.jobs: set[_StoreJob] = set()
        self.max_round = -1
        self.supply_open = supply_open
        self.released = False


class _Transfer:
    __slots__ = ("jobs", "nblocks", "req", "rnd", "started")

    def __init__(self, req: _Req, rnd: _Round, jobs: list[_StoreJob], started: float) -> None:
        self.req = req
        self.rnd = rnd
        self.jobs = jobs
        self.nblocks = len(jobs)
        self.started = started


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

    def __init__(self, env: SessionEnv, session: Session) -> None:
        self.env = env
        self.session = session
        self.peer = session.peer
        self.reqs: dict[str, _Req] = {}
        self.transfers: dict[int, _Transfer] = {}
        self.serves: dict[int, _Serve] = {}
        self.last_lookup_seq = -1
        self.closing = False
        self.winding_down = False
        self.n_rounds = 0
        """Open fetch rounds over all requests (kept as a counter: ``busy`` is hot)."""

    # -- engine side ------------------------------------------------------------------------

    def add_store(self, kv: str, job: Job) -> None:
        """Offer a store job's blocks for ``kv`` (bound to this session)."""
        req = self.reqs.get(kv)
        if req is None:  # bound requests always have state; recreate defensively
            req = self.reqs[kv] = _Req(kv, self.env.host.producer_active(kv))
        self._add_supply(req, job)

    def producer_finished(self, kv: str) -> None:
        """The local producer request finished: no more supply will come for ``kv``."""
        req = self.reqs.get(kv)
        if req is None:
            return
        req.supply_open = False
        for rnd in list(req.rounds.values()):
            if rnd.waiting and not rnd.aborting:
                self._fail_round(
                    req, rnd, Outcome.DEMAND_UNMET,
                    f"{rnd.waiting} demanded block(s) were never stored by the producer",
                )
        self._maybe_drop(req)

    def wind_down(self) -> None:
        """The tier is shutting down: stop every write (wait-cancel), fail every store job
        (SHUTDOWN) and round (``peer_dead`` for the consumer) as their writes end, refuse
        later fetches and lookups."""
        self.winding_down = True
        detail = "the producer is shutting down"
        for req in list(self.reqs.values()):
            req.supply_open = False
            for rnd in list(req.rounds.values()):
                if not rnd.aborting:
                    self._fail_round(req, rnd, Outcome.PEER_DEAD, detail)  # as the peer sees it
                    self._stop_writes(req, rnd, Outcome.SHUTDOWN, detail)
                    self._maybe_finish_round(req, rnd)
            for sj in list(req.jobs):
                self._fail_job(sj, Outcome.SHUTDOWN, detail)

    # -- messages ---------------------------------------------------------------------------

    def on_fetch(self, msg: Fetch, peer_num_blocks: int) -> None:
        keys, slots, kv = msg.keys, msg.slots, msg.kv_request_id
        keyset = set(keys)
        if keys:
            if len(keyset) != len(keys):
                raise ProtocolError("fetch.keys: duplicate key")
            if len(set(slots)) != len(slots):
                raise ProtocolError("fetch.slots: duplicate slot")
            top = max(slots)
            if top >= peer_num_blocks:
                raise ProtocolError(
                    f"fetch.slots: slot {top} is outside the consumer's region "
                    f"0..{peer_num_blocks - 1}"
                )
            if self.winding_down:
                self._send_done(kv, msg.round, Outcome.PEER_DEAD, "the producer is shutting down")
                return
        req = self.reqs.get(kv)
        if req is None:
            if not keys:
                return  # terminal fetch for a request we hold nothing for
            claim = self.env.host.claim(kv, self.session, by_fetch=True)
            if isinstance(claim, str):
                self._send_done(kv, msg.round, Outcome.DEMAND_UNMET, claim)
                return
            req = self.reqs[kv] = _Req(kv, claim.supply_open)
            for job in claim.parked:
                self._add_supply(req, job)
        if msg.round <= req.max_round:
            raise ProtocolError(
                f"fetch.round: {msg.round} is not above the previous round {req.max_round} "
                f"of {kv!r}"
            )
        req.max_round = msg.round
        if not keys:
            self._release(req)
            return
        conflict = self._conflict(req, keys)
        if conflict:  # a request-level conflict fails that round, not the session
            log.warning("peer %s: round %d of %r refused: %s", self.peer, msg.round, kv,
                        conflict)
            self._send_done(kv, msg.round, Outcome.REQUEST_CONFLICT, conflict)
            return
        demand, supply = req.demand, req.supply
        held_all = supply.keys() >= keyset
        if not req.supply_open and not held_all:
            missing = len(keyset - supply.keys())
            if missing:
                self._send_done(
                    kv, msg.round, Outcome.DEMAND_UNMET,
                    f"{missing} of {len(keys)} block(s) are not held and cannot arrive",
                )
                self._maybe_drop(req)
                return
        rnd = _Round(msg.round, len(keys))
        req.rounds[msg.round] = rnd
        self.n_rounds += 1
        env = self.env
        rnd.timer = env.deadlines.at(env.clock() + _round_lifetime(env),
                                     self._round_expired, (req, rnd))
        supply_job, demand_slot = req.supply_job, req.demand_slot
        if held_all:  # producer first: everything is here (one C-level pass per map)
            self._submit(req, rnd, list(map(supply.pop, keys)), slots,
                         list(map(supply_job.pop, keys)))
            return
        if not supply:  # consumer first: everything waits
            demand.update(dict.fromkeys(keys, rnd))
            demand_slot.update(zip(keys, slots, strict=True))
            rnd.waiting = len(keys)
            return
        local: list[int] = []
        remote: list[int] = []
        jobs: list[_StoreJob] = []
        for k, dest in zip(keys, slots, strict=True):
            held = supply.pop(k, None)
            if held is None:
                demand[k] = rnd
                demand_slot[k] = dest
                rnd.waiting += 1
            else:
                local.append(held)
                remote.append(dest)
                jobs.append(supply_job.pop(k))
        if local:
            self._submit(req, rnd, local, remote, jobs)

    @staticmethod
    def _conflict(req: _Req, keys: list[bytes]) -> str:
        """Why a new round of ``req`` asking for ``keys`` cannot be served, or ``""``."""
        if req.released:
            return f"{req.kv!r} was already ended by a terminal fetch"
        demand = req.demand
        if demand and not demand.keys().isdisjoint(keys):
            k = next(k for k in keys if k in demand)
            return f"a key is already demanded by round {demand[k].no} of {req.kv!r}"
        return ""

    def on_abort(self, msg: Abort) -> None:
        req = self.reqs.get(msg.kv_request_id)
        rnd = req.rounds.get(msg.round) if req is not None else None
        if req is None or rnd is None:
            self.session.send(AbortAck(msg.kv_request_id, msg.round))
            return
        if not rnd.aborting:
            self._abort_round(req, rnd, silent=False)

    def on_lookup(self, msg: Lookup) -> None:
        if msg.seq <= self.last_lookup_seq:
            raise ProtocolError(
                f"lookup.seq: {msg.seq} is not above the previous lookup {self.last_lookup_seq}"
            )
        self.last_lookup_seq = msg.seq
        if not self.env.host.has_hit_source or self.winding_down:
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
            expired = serve.timer is not None and now >= serve.timer.when
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
        try:
            self.env.host.open_pinned(job, kv, self.peer)
        except ValueError:
            log.exception("peer %s: hit source pinned an unusable job; answering MISS", self.peer)
            return None
        if job.is_load or len(job.keys) != len(job.block_ids):
            self.env.ledger.close(job.job_id, Outcome.SUBMIT_FAILED,
                                  "pinned job is not a store with one slot per key")
            return None
        req = self.reqs.get(kv)
        if req is None:
            claim = self.env.host.claim(kv, self.session, by_fetch=False)
            if isinstance(claim, str):
                self.env.ledger.close(job.job_id, Outcome.NOTHING_TO_DO, claim)
                return None
            req = self.reqs[kv] = _Req(kv, claim.supply_open)
            for parked in claim.parked:
                self._add_supply(req, parked)
        self._add_supply(req, job)
        return set(job.keys)

    def _answer_miss(self, serve: _Serve, source: LocalHitSource | None) -> None:
        self._finish_serve(serve, [False] * len(serve.keys))
        if serve.begun:
            if source is None:
                self.env.host.defer_end(serve.handle)
            else:
                self._end(source, serve.handle)

    def _finish_serve(self, serve: _Serve, hits: list[bool]) -> None:
        self.env.deadlines.cancel(serve.timer)
        self.serves.pop(serve.seq, None)
        self.session.send(LookupResp(serve.seq, hits))

    def _serve_expired(self, serve: _Serve) -> None:
        """The lookup deadline passed with no ``serve_lookups`` call to finish it: MISS."""
        serve.timer = None
        if self.env.observers.enabled:
            self.env.observers.timeout(kind="lookup", kv_request_id=serve.kv, peer=self.peer)
        self._answer_miss(serve, None)

    # -- supply and matching ----------------------------------------------------------------

    def _add_supply(self, req: _Req, job: Job) -> None:
        sj = _StoreJob(job.job_id, req, job.keys)
        req.jobs.add(sj)
        env = self.env
        sj.timer = env.deadlines.at(env.clock() + env.timeouts.store, self._store_timeout, sj)
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
        matched: dict[_Round, tuple[list[int], list[int], list[_StoreJob]]] = {}
        for key, slot in zip(keys, job.block_ids, strict=True):
            rnd = demand.pop(key, None)
            if rnd is None:
                if key in supply:
                    sj.remaining -= 1  # an earlier job holds this key already
                else:
                    supply[key] = slot
                    supply_job[key] = sj
                continue
            dest = req.demand_slot.pop(key)
            rnd.waiting -= 1
            group = matched.get(rnd)
            if group is None:
                group = matched[rnd] = ([], [], [])
            group[0].append(slot)
            group[1].append(dest)
            group[2].append(sj)
        for rnd, (local, remote, jobs) in matched.items():
            self._submit(req, rnd, local, remote, jobs)
        self._maybe_release_job(sj)

    def _submit(self, req: _Req, rnd: _Round, local: list[int], remote: list[int],
                jobs: list[_StoreJob]) -> None:
        env = self.env
        try:
            tid = env.data.write_blocks(self.peer, local, remote)
        except Exception as exc:
            detail = f"write_blocks failed: {type(exc).__name__}: {exc}"
            log.warning("peer %s: %s (request %r round %d)", self.peer, detail, req.kv, rnd.no)
            env.counters["submit_failures"] += 1
            for sj in jobs:
                if sj.failure is None:
                    self._fail_job(sj, Outcome.SUBMIT_FAILED, detail)
            self._fail_round(req, rnd, Outcome.SUBMIT_FAILED, detail)
            return
        rnd.inflight += 1
        rnd.tids.add(tid)
        for sj in jobs:
            sj.inflight += 1
        self.transfers[tid] = _Transfer(req, rnd, jobs, env.clock())
        env.owners[tid] = self.session
        if env.observers.enabled:
            env.observers.transfer_submitted(
                peer=self.peer, transfer_id=tid, blocks=len(local),
                nbytes=len(local) * env.local.block_len,
            )

    def on_transfer(self, tid: int, ok: bool) -> None:
        """A write of ours terminated (routed here from ``data.poll``)."""
        t = self.transfers.pop(tid)
        env = self.env
        rnd, req = t.rnd, t.req
        rnd.inflight -= 1
        rnd.tids.discard(tid)
        if env.observers.enabled:
            env.observers.transfer_finished(
                peer=self.peer, transfer_id=tid, success=ok,
                nbytes=t.nblocks * env.local.block_len, seconds=env.clock() - t.started,
            )
        if ok:
            env.counters["blocks_sent"] += t.nblocks
            rnd.remaining -= t.nblocks
            for sj in t.jobs:
                sj.inflight -= 1
                sj.remaining -= 1
                sj.delivered += 1
        else:
            env.counters["transfers_failed"] += 1
            for sj in t.jobs:
                sj.inflight -= 1
                if sj.failure is None:
                    self._fail_job(sj, Outcome.TRANSFER_FAILED, f"transfer {tid} failed")
            self._fail_round(req, rnd, Outcome.TRANSFER_FAILED, f"transfer {tid} failed")
        self._release_jobs(t.jobs)
        self._maybe_finish_round(req, rnd)

    def _cancelled(self, tid: int, outcome: Outcome, detail: str) -> None:
        """A write of ours was stopped (wait-cancel confirmed) or given up on."""
        t = self.transfers.pop(tid)
        self.env.owners.pop(tid, None)
        t.rnd.inflight -= 1
        t.rnd.tids.discard(tid)
        for sj in t.jobs:
            sj.inflight -= 1
            if sj.failure is None:
                self._fail_job(sj, outcome, detail)
        self._release_jobs(t.jobs)

    # -- rounds -----------------------------------------------------------------------------

    def _fail_round(self, req: _Req, rnd: _Round, outcome: Outcome, detail: str) -> None:
        if rnd.failure is not None or rnd.aborting:
            return
        rnd.failure = (outcome, detail)
        self._drop_waiting(req, rnd)
        self._maybe_finish_round(req, rnd)

    @staticmethod
    def _drop_waiting(req: _Req, rnd: _Round) -> None:
        if rnd.waiting:
            for k in [k for k, r in req.demand.items() if r is rnd]:
                del req.demand[k]
                del req.demand_slot[k]
            rnd.waiting = 0

    def _maybe_finish_round(self, req: _Req, rnd: _Round) -> None:
        if rnd.inflight or self.closing or req.rounds.get(rnd.no) is not rnd:
            return
        if rnd.aborting:
            if not rnd.silent:
                self.session.send(AbortAck(req.kv, rnd.no))
        elif rnd.failure is not None:
            self._send_done(req.kv, rnd.no, *rnd.failure)
        elif rnd.remaining == 0:
            self.session.send(TransferDone(req.kv, rnd.no, True))
        else:
            return
        self.env.deadlines.cancel(rnd.timer)
        del req.rounds[rnd.no]
        self.n_rounds -= 1
        self._maybe_drop(req)

    def _send_done(self, kv: str, rnd_no: int, outcome: Outcome, detail: str) -> None:
        self.session.send(TransferDone(kv, rnd_no, False, f"{outcome.value}: {detail}"))

    def _abort_round(self, req: _Req, rnd: _Round, *, silent: bool) -> None:
        rnd.aborting = True
        rnd.silent = silent
        self._stop_writes(req, rnd, Outcome.ABORTED, "the consumer aborted the round")
        env = self.env
        env.deadlines.cancel(rnd.timer)  # the round's expiry: the consumer ended it
        rnd.timer = None
        if rnd.inflight:
            rnd.timer = env.deadlines.at(
                env.clock() + env.timeouts.abort_drain, self._abort_drain_expired, (req, rnd)
            )
        self._maybe_finish_round(req, rnd)

    def _stop_writes(self, req: _Req, rnd: _Round, outcome: Outcome, detail: str) -> None:
        """Stop ``rnd``'s waiting demand and wait-cancel its writes; those confirmed stopped
        end now with ``outcome``, the rest end when the data transport reports them."""
        self._drop_waiting(req, rnd)
        if rnd.tids:
            still = set(self.env.data.cancel(list(rnd.tids), CancelMode.WAIT))
            for tid in [t for t in rnd.tids if t not in still]:
                self._cancelled(tid, outcome, detail)

    def _round_expired(self, arg: tuple[_Req, _Round]) -> None:
        """The consumer's load deadline and its abort window have passed and the round is
        still open (blocks never supplied; its abort was lost or came first, reordered): the
        consumer has given it up, so it ends now instead of holding demand forever. Writes
        still in flight end it when they are over."""
        req, rnd = arg
        rnd.timer = None
        if req.rounds.get(rnd.no) is not rnd or rnd.aborting:
            return
        env = self.env
        if env.observers.enabled:
            env.observers.timeout(kind="round", kv_request_id=req.kv, peer=self.peer)
        self._fail_round(req, rnd, Outcome.LOAD_TIMEOUT,
                         f"open {_round_lifetime(env)}s, past the consumer's load and abort "
                         f"deadlines, with {rnd.waiting} block(s) never stored")

    def _abort_drain_expired(self, arg: tuple[_Req, _Round]) -> None:
        """Writes of an aborted round are still live after ``abort_drain``. Acking would
        promise the consumer they are over, and no cancel can recall a posted write: the
        session closes instead (the writes retire, the consumer fences their slots, §5.1)."""
        req, rnd = arg
        rnd.timer = None
        env = self.env
        reason = (f"{len(rnd.tids)} write(s) of aborted round {rnd.no} of {req.kv!r} did not "
                  f"drain within {env.timeouts.abort_drain}s")
        log.warning("peer %s: %s; closing the session", self.peer, reason)
        if env.observers.enabled:
            env.observers.timeout(kind="abort_drain", kv_request_id=req.kv, peer=self.peer)
        self.session.doom(Outcome.TRANSFER_FAILED, reason,
                          f"{Outcome.TRANSFER_FAILED.value}: {reason}")

    def _release(self, req: _Req) -> None:
        """Terminal fetch: the consumer is done with ``req``; release everything."""
        req.released = True
        req.supply.clear()
        req.supply_job.clear()
        for rnd in list(req.rounds.values()):
            if rnd.aborting:
                rnd.silent = True
            else:
                self._abort_round(req, rnd, silent=True)
        for sj in list(req.jobs):
            sj.released = True
            self._maybe_release_job(sj)
        self._maybe_drop(req)

    # -- store jobs -------------------------------------------------------------------------

    def _store_timeout(self, sj: _StoreJob) -> None:
        sj.timer = None
        if self.env.observers.enabled:
            self.env.observers.timeout(kind="store", kv_request_id=sj.req.kv, peer=self.peer)
        self._fail_job(sj, Outcome.STORE_TIMEOUT,
                       f"not delivered within {self.env.timeouts.store}s")

    def _fail_job(self, sj: _StoreJob, outcome: Outcome, detail: str) -> None:
        if sj.failure is None:
            sj.failure = (outcome, detail)
        supply, supply_job = sj.req.supply, sj.req.supply_job
        if supply:
            for key in sj.keys:
                if supply_job.get(key) is sj:
                    del supply[key]
                    del supply_job[key]
        self._maybe_release_job(sj)

    def _release_jobs(self, jobs: list[_StoreJob]) -> None:
        prev = None
        for sj in jobs:
            if sj is not prev:
                self._maybe_release_job(sj)
                prev = sj

    def _maybe_release_job(self, sj: _StoreJob) -> None:
        if sj.done or sj.inflight:
            return
        if sj.failure is not None:
            outcome, detail = sj.failure
        elif sj.remaining <= 0:
            outcome, detail = Outcome.DONE, ""
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

    def _maybe_drop(self, req: _Req) -> None:
        if self.closing or req.rounds or req.jobs or self.reqs.get(req.kv) is not req:
            return
        if self.env.host.producer_active(req.kv):
            return  # keep the binding: more stores will come for this request
        del self.reqs[req.kv]
        self.env.host.request_gone(req.kv, self.session)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: fail every store job (results wait for in-flight blocks),
        wait-cancel every transfer, answer nothing more."""
        self.closing = True
        self.n_rounds = 0
        env = self.env
        for serve in self.serves.values():
            env.deadlines.cancel(serve.timer)
            if serve.begun:
                env.host.defer_end(serve.handle)
        self.serves.clear()
        reqs = list(self.reqs.values())
        self.reqs.clear()
        for req in reqs:
            for rnd in req.rounds.values():
                env.deadlines.cancel(rnd.timer)
            req.rounds.clear()
            req.demand.clear()
            req.demand_slot.clear()
            for sj in list(req.jobs):
                self._fail_job(sj, outcome, reason)
            env.host.request_gone(req.kv, self.session)
        if self.transfers:
            still = set(env.data.cancel(list(self.transfers), CancelMode.WAIT))
            for tid in [t for t in self.transfers if t not in still]:
                self._cancelled(tid, outcome, reason)

    def give_up(self, outcome: Outcome, reason: str) -> list[int]:
        """Stop waiting for transfers that never drained after ``close``: their store jobs get
        their results now. Returns the ids, still live in the data transport: they are not
        cancelled (a posted write cannot be recalled; its handle must outlive it)."""
        tids = list(self.transfers)
        for tid in tids:
            self._cancelled(tid, outcome, reason)
        return tids

    @property
    def busy(self) -> bool:
        """Rounds, transfers or lookups outstanding (a reason for the engine to keep ticking)."""
        return bool(self.transfers or self.serves or self.n_rounds)

    def state_sizes(self) -> dict[str, int]:
        return {
            "server_requests": len(self.reqs),
            "server_rounds": sum(len(r.rounds) for r in self.reqs.values()),
            "server_jobs": sum(len(r.jobs) for r in self.reqs.values()),
            "supply": sum(len(r.supply) for r in self.reqs.values()),
            "demand": sum(len(r.demand) for r in self.reqs.values()),
            "transfers": len(self.transfers),
            "serves": len(self.serves),
        }
