"""Consumer role of a session: load rounds, aborts, probes and the terminal fetch.

Each ``submit_load`` becomes one **round** of its ``kv_request_id`` (rounds are numbered per
request and session and complete independently). A round's result is released only when
nothing can write into its slots any more: the producer said ``transfer_done`` or
``abort_ack`` (both promise its transfers for the round are drained), the ack deadline
passed, or the session died; with a two-sided data transport the receive posted by
``expect_blocks`` must also be terminal.

A round released *without* that confirmation (session died, ack deadline, protocol error) has
its slots fenced against the producer (:mod:`p2pkv.session.fences`): its result is reported at
once, but a later round whose slots intersect a fence waits, unsent, until the fence is lifted
or its own load deadline passes.

When a request is finished (or one of its loads failed) and no round is open, the consumer
sends one **terminal fetch** (empty keys) so the producer releases what it still pins.

At shutdown (``wind_down``) every round the producer may be writing into is aborted like a
finished request's: its result (``shutdown``) comes with the producer's confirmation, so the
tier releases its region only once no write into it is live (docs/protocol.md §10).

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

__all__ = ["ClientRole", "outcome_from_reason"]

log = logging.getLogger(__name__)

# Round phases.
_UNSENT, _ACTIVE, _ABORTING, _SETTLING, _DONE = 0, 1, 2, 3, 4
# Probe states.
_PENDING, _INFLIGHT, _MISS, _HIT = 0, 1, 2, 3

_FAILURES = frozenset(o for o in Outcome if not o.success)
_ABORTED_BY_US = {
    Outcome.REQUEST_FINISHED: "request finished during the load",
    Outcome.SHUTDOWN: "tier shut down during the load",
}
"""Abort reasons whose round ends with that outcome even if the producer completed it."""


def outcome_from_reason(reason: str) -> Outcome:
    """The failure ``Outcome`` a ``transfer_done`` reason starts with (else TRANSFER_FAILED)."""
    head = reason.partition(":")[0].strip()
    try:
        outcome = Outcome(head)
    except ValueError:
        return Outcome.TRANSFER_FAILED
    return outcome if outcome in _FAILURES else Outcome.TRANSFER_FAILED


class _Round:
    __slots__ = ("job_id", "keys", "no", "phase", "req", "result", "slots", "timer", "why",
                 "xid", "xid_failed")

    def __init__(self, req: _Req, no: int, job: Job) -> None:
        self.req = req
        self.no = no
        self.job_id = job.job_id
        self.keys: Sequence[bytes] = job.keys
        self.slots = job.block_ids
        self.phase = _UNSENT
        self.why = Outcome.LOAD_TIMEOUT
        """Why an abort was sent (LOAD_TIMEOUT, REQUEST_FINISHED or SHUTDOWN)."""
        self.xid: int | None = None
        """Outstanding ``expect_blocks`` id (two-sided transports)."""
        self.xid_failed = False
        self.result: tuple[Outcome, str] = (Outcome.DONE, "")
        self.timer: Timer | None = None


class _Req:
    __slots__ = ("contacted", "failed", "finished", "kv", "next_round", "open_keys", "probes",
                 "released", "rounds", "unsent_keys")

    def __init__(self, kv: str) -> None:
        self.kv = kv
        self.next_round = 0
        self.rounds: dict[int, _Round] = {}
        self.open_keys: set[bytes] = set()
        """Keys of the open rounds: a load may not ask for one again (request conflict)."""
        self.contacted = False
        """A fetch or lookup for this request was sent to the peer."""
        self.finished = False
        self.failed = False
        self.released = False
        self.probes: dict[bytes, int] = {}
        self.unsent_keys: list[bytes] = []


class ClientRole:
    """The consumer half of one session (see the module docstring)."""

    def __init__(self, env: SessionEnv, session: Session) -> None:
        self.env = env
        self.session = session
        self.peer = session.peer
        self.reqs: dict[str, _Req] = {}
        self.unsent: list[_Round] = []
        self.xids: dict[int, _Round] = {}
        self.lookups: dict[int, tuple[_Req, list[bytes], Timer]] = {}
        self.probing: dict[str, _Req] = {}
        """Requests with probe keys not yet sent (flushed at ``on_schedule_end``)."""
        self.next_seq = 0
        self.n_rounds = 0
        self.closing = False
        self.fenced: dict[int, _Round] = {}
        """Unsent rounds whose slots are fenced, by job id (sent in this order once lifted)."""

    # -- engine side ------------------------------------------------------------------------

    def open_request(self, kv: str) -> None:
        """Track ``kv`` from ``on_new_request`` on (so a session death marks it failed)."""
        if kv not in self.reqs:
            self.reqs[kv] = _Req(kv)

    def submit(self, job: Job, kv: str) -> None:
        """Start a load round for ``job`` (already recorded in the ledger)."""
        req = self.reqs.get(kv)
        if req is None:
            req = self.reqs[kv] = _Req(kv)
        conflict = self._conflict(req, job)
        if conflict:
            self.env.ledger.close(job.job_id, Outcome.REQUEST_CONFLICT, conflict)
            return
        req.open_keys.update(job.keys)
        rnd = _Round(req, req.next_round, job)
        req.next_round += 1
        req.rounds[rnd.no] = rnd
        self.n_rounds += 1
        env = self.env
        rnd.timer = env.deadlines.at(env.clock() + env.timeouts.load, self._load_timeout, rnd)
        if self.session.ready:
            self._send_round(rnd)
        else:
            self.unsent.append(rnd)

    @staticmethod
    def _conflict(req: _Req, job: Job) -> str:
        """Why ``job`` cannot be a new round of ``req`` (only this job fails), or ``""``."""
        if req.released:
            return (f"request {req.kv!r} was already ended with its producer (finished or an "
                    f"earlier load failed); a new load needs a new kv_request_id")
        if req.open_keys and not req.open_keys.isdisjoint(job.keys):
            wanted = set(job.keys)
            busy = next(r for r in req.rounds.values() if not wanted.isdisjoint(r.keys))
            return (f"{len(req.open_keys.intersection(job.keys))} of its blocks are already "
                    f"being loaded for request {req.kv!r} by job {busy.job_id}")
        return ""

    def finish(self, kv: str) -> None:
        """The engine finished ``kv``: abort open rounds (results come as REQUEST_FINISHED)."""
        req = self.reqs.get(kv)
        if req is None:
            return
        req.finished = True
        self._drop_probes(req)
        self._end_rounds(req, Outcome.REQUEST_FINISHED, "request finished before sending")
        self._maybe_release(req)

    def wind_down(self) -> None:
        """The tier is shutting down: fail unsent rounds now, abort the others (their results
        come as SHUTDOWN once the producer confirms, or at the session's close)."""
        for req in list(self.reqs.values()):
            self._drop_probes(req)
            self._end_rounds(req, Outcome.SHUTDOWN, "tier shut down before sending")
        self.unsent = []

    def _end_rounds(self, req: _Req, why: Outcome, unsent_detail: str) -> None:
        for rnd in list(req.rounds.values()):
            if rnd.phase == _UNSENT:
                self._complete(rnd, why, unsent_detail)
            elif rnd.phase == _ACTIVE:
                self._abort(rnd, why)

    def probe(self, kv: str, key: bytes) -> LookupResult:
        """Symmetric lookup: RETRY until the batched probe is answered, then HIT/MISS."""
        req = self.reqs.get(kv)
        if req is None:
            req = self.reqs[kv] = _Req(kv)
        state = req.probes.get(key)
        if state is None:
            if req.finished:
                return LookupResult.MISS
            req.probes[key] = _PENDING
            req.unsent_keys.append(key)
            self.probing[kv] = req
            return LookupResult.RETRY
        if state == _HIT:
            return LookupResult.HIT
        if state == _MISS:
            return LookupResult.MISS
        return LookupResult.RETRY

    def flush_lookups(self) -> None:
        """Send one lookup per request with new probe keys (``on_schedule_end``)."""
        if not self.probing or not self.session.ready:
            return
        env = self.env
        deadline = env.clock() + 2 * env.timeouts.lookup
        for req in self.probing.values():
            keys, req.unsent_keys = req.unsent_keys, []
            if not keys:
                continue
            seq = self.next_seq
            self.next_seq += 1
            probes = req.probes
            for k in keys:
                probes[k] = _INFLIGHT
            req.contacted = True
            self.lookups[seq] = (req, keys, env.deadlines.at(deadline, self._lookup_timeout, seq))
            self.session.send(Lookup(seq, req.kv, keys))
        self.probing.clear()

    # -- messages ---------------------------------------------------------------------------

    def on_transfer_done(self, msg: TransferDone) -> None:
        rnd = self._round(msg.kv_request_id, msg.round, "transfer_done")
        if rnd is None or rnd.phase not in (_ACTIVE, _ABORTING):
            return
        if rnd.phase == _ABORTING and rnd.why in _ABORTED_BY_US:
            outcome, detail = rnd.why, _ABORTED_BY_US[rnd.why]
        elif msg.success:
            outcome, detail = Outcome.DONE, ""
        else:
            outcome, detail = outcome_from_reason(msg.reason), f"producer: {msg.reason}"
        self._settle(rnd, outcome, detail, confirmed=True)

    def on_abort_ack(self, msg: AbortAck) -> None:
        rnd = self._round(msg.kv_request_id, msg.round, "abort_ack")
        if rnd is None or rnd.phase != _ABORTING:
            return
        self._settle(rnd, rnd.why, "aborted after " + rnd.why.value, confirmed=True)

    def on_lookup_resp(self, msg: LookupResp) -> None:
        if msg.seq >= self.next_seq:
            raise ProtocolError(f"lookup_resp.seq: {msg.seq} was never sent")
        entry = self.lookups.pop(msg.seq, None)
        if entry is None:
            return  # the request finished or the probe timed out meanwhile
        req, keys, timer = entry
        self.env.deadlines.cancel(timer)
        if len(msg.hits) != len(keys):
            raise ProtocolError(
                f"lookup_resp.hits: {len(msg.hits)} answers for {len(keys)} keys"
            )
        probes = req.probes
        for k, hit in zip(keys, msg.hits, strict=True):
            if probes.get(k) == _INFLIGHT:
                probes[k] = _HIT if hit else _MISS

    def on_xid(self, xid: int, ok: bool) -> None:
        """An ``expect_blocks`` receive terminated (two-sided transports)."""
        rnd = self.xids.pop(xid)
        rnd.xid = None
        if not ok:
            rnd.xid_failed = True
        if rnd.phase == _SETTLING:
            self._settled(rnd)

    def on_ready(self) -> None:
        """The handshake completed: send rounds submitted before it."""
        unsent, self.unsent = self.unsent, []
        for rnd in unsent:
            if rnd.phase == _UNSENT:
                self._send_round(rnd)

    def retry_fenced(self) -> bool:
        """Fences were lifted: send the rounds no longer fenced (``FenceWaiter``)."""
        fenced, self.fenced = self.fenced, {}
        for rnd in fenced.values():
            if not self.session.ready:
                self.unsent.append(rnd)
            else:
                self._send_round(rnd)
        return bool(self.fenced)

    # -- internals --------------------------------------------------------------------------

    def _round(self, kv: str, no: int, what: str) -> _Round | None:
        req = self.reqs.get(kv)
        if req is None:
            return None
        if no >= req.next_round:
            raise ProtocolError(f"{what}.round: round {no} of {kv!r} was never sent")
        return req.rounds.get(no)

    def _send_round(self, rnd: _Round) -> None:
        env = self.env
        if env.fences.blocked(rnd.slots):
            self.fenced[rnd.job_id] = rnd
            env.fences.wait(self)
            return
        keys = rnd.keys
        try:
            xid = env.data.expect_blocks(self.peer, rnd.slots)
        except Exception as exc:
            self._complete(rnd, Outcome.SUBMIT_FAILED,
                           f"expect_blocks failed: {type(exc).__name__}: {exc}")
            return
        if xid is not None:
            rnd.xid = xid
            self.xids[xid] = rnd
            env.owners[xid] = self.session
        rnd.phase = _ACTIVE
        rnd.req.contacted = True
        self.session.send(Fetch(rnd.req.kv, rnd.no, list(keys), list(rnd.slots)))

    def _load_timeout(self, rnd: _Round) -> None:
        rnd.timer = None
        if self.env.observers.enabled:
            self.env.observers.timeout(kind="load", kv_request_id=rnd.req.kv, peer=self.peer)
        if rnd.phase == _UNSENT:
            why = ("its slots are fenced against a write of an earlier load"
                   if rnd.job_id in self.fenced else "handshake not complete")
            self._complete(rnd, Outcome.LOAD_TIMEOUT, "never sent: " + why)
        elif rnd.phase == _ACTIVE:
            self._abort(rnd, Outcome.LOAD_TIMEOUT)

    def _abort(self, rnd: _Round, why: Outcome) -> None:
        env = self.env
        env.deadlines.cancel(rnd.timer)
        rnd.phase = _ABORTING
        rnd.why = why
        rnd.timer = env.deadlines.at(
            env.clock() + env.timeouts.abort_ack, self._abort_ack_timeout, rnd
        )
        self.session.send(Abort(rnd.req.kv, rnd.no))

    def _abort_ack_timeout(self, rnd: _Round) -> None:
        rnd.timer = None
        if self.env.observers.enabled:
            self.env.observers.timeout(kind="abort_ack", kv_request_id=rnd.req.kv,
                                       peer=self.peer)
        self._settle(rnd, Outcome.ABORT_ACK_TIMEOUT,
                     f"no abort_ack within {self.env.timeouts.abort_ack}s after "
                     f"{rnd.why.value}", force=True)

    def _settle(self, rnd: _Round, outcome: Outcome, detail: str, *, force: bool = False,
                confirmed: bool = False) -> None:
        """The producer side of the round is over; finish once our receive is terminal too.

        Unless the producer ``confirmed`` that none of its writes for the round is live, the
        slots of a round whose fetch went out are fenced against it (not at shutdown)."""
        env = self.env
        if (not confirmed and rnd.phase in (_ACTIVE, _ABORTING)
                and outcome is not Outcome.SHUTDOWN):
            env.fences.fence(self.peer, rnd.req.kv, rnd.slots)
        env.deadlines.cancel(rnd.timer)
        rnd.timer = None
        rnd.result = (outcome, detail)
        rnd.phase = _SETTLING
        xid = rnd.xid
        if xid is not None and outcome is not Outcome.DONE:
            mode = CancelMode.IMMEDIATE if force else CancelMode.WAIT
            if xid not in env.data.cancel([xid], mode):
                self._forget_xid(rnd)
        if rnd.xid is None:
            self._settled(rnd)
        else:
            rnd.timer = env.deadlines.at(
                env.clock() + env.timeouts.abort_ack, self._settle_timeout, rnd
            )

    def _settle_timeout(self, rnd: _Round) -> None:
        """Our receive never terminated: give up on it."""
        rnd.timer = None
        if rnd.xid is not None:
            self.env.data.cancel([rnd.xid], CancelMode.IMMEDIATE)
            self._forget_xid(rnd)
        if rnd.result[0] is Outcome.DONE:
            rnd.result = (Outcome.TRANSFER_FAILED, "the posted receive never completed")
        self._settled(rnd)

    def _forget_xid(self, rnd: _Round) -> None:
        xid = rnd.xid
        if xid is not None:
            self.xids.pop(xid, None)
            self.env.owners.pop(xid, None)
            rnd.xid = None

    def _settled(self, rnd: _Round) -> None:
        outcome, detail = rnd.result
        if outcome is Outcome.DONE and rnd.xid_failed:
            outcome, detail = Outcome.TRANSFER_FAILED, "the posted receive failed"
        self._complete(rnd, outcome, detail)

    def _complete(self, rnd: _Round, outcome: Outcome, detail: str) -> None:
        env = self.env
        env.deadlines.cancel(rnd.timer)
        rnd.timer = None
        rnd.phase = _DONE
        self.fenced.pop(rnd.job_id, None)
        self._forget_xid(rnd)
        req = rnd.req
        del req.rounds[rnd.no]
        req.open_keys.difference_update(rnd.keys)
        self.n_rounds -= 1
        env.ledger.close(rnd.job_id, outcome, detail)
        if not outcome.success and not req.finished and not req.failed:
            req.failed = True
            env.host.mark_failed(req.kv, f"{outcome.value}: {detail}")
        self._maybe_release(req)

    def _maybe_release(self, req: _Req) -> None:
        if req.rounds or self.closing:
            return
        if (req.finished or req.failed) and req.contacted and not req.released:
            req.released = True
            if self.session.ready:
                self.session.send(Fetch(req.kv, req.next_round, [], []))
                req.next_round += 1
        if req.finished and self.reqs.get(req.kv) is req:
            self._drop_probes(req)
            del self.reqs[req.kv]

    def _drop_probes(self, req: _Req) -> None:
        if req.probes:
            req.probes.clear()
            req.unsent_keys = []
            self.probing.pop(req.kv, None)
            for seq in [s for s, e in self.lookups.items() if e[0] is req]:
                self.env.deadlines.cancel(self.lookups.pop(seq)[2])

    def _lookup_timeout(self, seq: int) -> None:
        entry = self.lookups.pop(seq, None)
        if entry is None:
            return
        req, keys, _ = entry
        if self.env.observers.enabled:
            self.env.observers.timeout(kind="lookup", kv_request_id=req.kv, peer=self.peer)
        probes = req.probes
        for k in keys:
            if probes.get(k) == _INFLIGHT:
                probes[k] = _MISS

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: every round fails with ``outcome`` (once its receive, if any,
        is drained); unfinished requests are marked failed."""
        env = self.env
        self.closing = True
        for _, _, timer in self.lookups.values():
            env.deadlines.cancel(timer)
        self.lookups.clear()
        self.probing.clear()
        reqs = list(self.reqs.values())
        for req in reqs:
            for rnd in list(req.rounds.values()):
                if rnd.phase == _SETTLING:
                    continue  # producer side already over; waits for its receive only
                self._settle(rnd, outcome, reason)
            if not req.finished and not req.failed:
                req.failed = True
                env.host.mark_failed(req.kv, f"{outcome.value}: {reason}")
        self.reqs = {kv: r for kv, r in self.reqs.items() if r.rounds}
        self.unsent = []
        self.fenced.clear()

    def force_quiesce(self) -> list[int]:
        """Give up on receives that never drained after ``close``; returns their ids."""
        rounds = list(self.xids.values())
        for rnd in rounds:
            self._settle_timeout(rnd)
        return [r.job_id for r in rounds]

    @property
    def busy(self) -> bool:
        return bool(self.n_rounds or self.lookups or self.probing)

    @property
    def unconfirmed(self) -> int:
        """Rounds whose fetch went out and whose producer side is not over yet."""
        return sum(1 for req in self.reqs.values() for rnd in req.rounds.values()
                   if rnd.phase in (_ACTIVE, _ABORTING))

    def state_sizes(self) -> dict[str, int]:
        return {
            "client_requests": len(self.reqs),
            "client_rounds": self.n_rounds,
            "expectations": len(self.xids),
            "lookups": len(self.lookups),
            "probes": sum(len(r.probes) for r in self.reqs.values()),
        }
