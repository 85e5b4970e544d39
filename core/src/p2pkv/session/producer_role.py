"""Producer role of a session: serves the consumer's fetches and lookups from our blocks.

The role is a facade over four parts, each in its own module:

* :mod:`~p2pkv.session.supply`: per request, the supply and the demand, matched there.
* :mod:`~p2pkv.session.fetch_rounds`: the open rounds, their pins and leases.
* :mod:`~p2pkv.session.store_jobs`: each store job's one result.
* :mod:`~p2pkv.session.lookup_serving`: lookups answered from the engine's hit source.

As soon as supply and demand meet for some keys, one ``ready`` tells the consumer where they
are, and **the consumer reads them**. The producer never writes into a peer's region
(docs/protocol.md §5). The role talks to its session through one ``send`` callback.

Rules (docs/protocol.md, "Producer"):

* Blocks named in a ``ready`` stay pinned until the consumer's ``release`` or the lease.
  The consumer accepts a read only if it completed within the lease of its own fetch, which
  went out before our ``ready``. So it never accepts bytes of a slot we unpinned.
* ``release(read=True)`` delivers the round's blocks (their store jobs complete ``done``).
  ``read=False`` or the lease passing fails them (``aborted`` / ``transfer_failed``).
* A round fails fast (``round_failed``, ``demand_unmet``) when it demands a key that cannot
  come any more: the local producer request finished, or the request is lookup-served only.
* At shutdown (``wind_down``) every open round fails (``peer_dead`` for the consumer), and
  later fetches fail at once. Pins wait for the consumer's release within the tier's
  shutdown budget.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2pkv.errors import ProtocolError, UsageError
from p2pkv.protocol import Fetch, Lookup, Message, Release
from p2pkv.session.env import SessionEnv
from p2pkv.session.fetch_rounds import FetchRounds
from p2pkv.session.lookup_serving import LookupServing
from p2pkv.session.store_jobs import StoreJobs
from p2pkv.session.supply import ProducerRequest
from p2pkv.types import Job, LocalHitSource, Outcome

log = logging.getLogger(__name__)


class ProducerRole:
    """The producer half of one session (see the module docstring).

    ``send`` puts a message on the session: dropped when the session is not ready, False
    when the frame is over the size cap (not sent; the role fails the round it built)."""

    def __init__(self, env: SessionEnv, peer: str, send: Callable[[Message], bool]) -> None:
        self.env = env
        self.peer = peer
        self.reqs: dict[str, ProducerRequest] = {}
        """The requests this role holds state for (read-only outside the role)."""
        self.closing = False
        self.winding_down = False
        self.asked = False
        """The peer has asked us for blocks (a fetch or a lookup): it may have another
        request on its way at any moment, so quiet as the session looks here, a close would
        cross it (the tier never probes such a session, :mod:`p2pkv.tiering.domains`)."""
        self._jobs = StoreJobs(env, peer, self._maybe_drop)
        self._rounds = FetchRounds(env, peer, send, self._jobs, self._maybe_drop)
        self._lookups = LookupServing(env, peer, send, self._adopt_pinned)

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
                self._rounds.fail(
                    rnd,
                    Outcome.DEMAND_UNMET,
                    f"{rnd.waiting} demanded block(s) were never stored by the producer",
                )
        self._maybe_drop(req)

    def wind_down(self) -> None:
        """The tier is shutting down. Every open round fails (``peer_dead`` for the consumer),
        and so do the store jobs not pinned (SHUTDOWN). Later fetches and lookups are
        refused. Pinned blocks wait for the consumer's release (the tier bounds the wait)."""
        self.winding_down = True
        self._lookups.refuse_new()
        detail = "the producer is shutting down"
        for req in list(self.reqs.values()):
            req.supply_open = False
            for rnd in list(req.rounds.values()):
                self._rounds.fail(rnd, Outcome.PEER_DEAD, detail)  # as the peer sees it
            for sj in list(req.jobs):
                if not sj.pinned:  # a pinned one ends with its release (done if read)
                    self._jobs.fail(sj, Outcome.SHUTDOWN, detail)

    def serve(self, source: LocalHitSource) -> None:
        """Advance every pending lookup with ``source``; answer the settled ones."""
        self._lookups.serve(source)

    # -- messages ---------------------------------------------------------------------------

    def on_fetch(self, msg: Fetch) -> None:
        """Open a round for the fetched keys, or release the request on a terminal fetch.
        A fetch that cannot be served is answered ``round_failed`` at once."""
        self.asked = True
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
            self._rounds.open(req, msg.round, msg.keys, held_all)

    def on_release(self, msg: Release) -> None:
        """The consumer is done with a round: unpin (delivered if ``read``), end it."""
        req = self.reqs.get(msg.kv_request_id)
        if req is None:
            return  # ended here already (lease passed, or the session was rebuilt)
        if msg.round > req.max_round:
            raise ProtocolError(f"release.round: round {msg.round} of {req.kv!r} was never fetched")
        rnd = req.rounds.get(msg.round)
        if rnd is None:
            return
        if msg.read and rnd.unready:
            raise ProtocolError(
                f"release.read: round {msg.round} of {req.kv!r} still has "
                f"{rnd.unready} block(s) never announced"
            )
        self._rounds.release(
            rnd, None if msg.read else (Outcome.ABORTED, "the consumer gave the round up")
        )

    def on_lookup(self, msg: Lookup) -> None:
        self.asked = True
        self._lookups.on_lookup(msg)

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: fail every store job with ``outcome``. Jobs with pinned
        blocks get that result only when their lease passes (a cut-off consumer may still be
        reading them); :meth:`drop_pins` ends that wait early (tier shutdown)."""
        self.closing = True
        self._lookups.close()
        reqs = list(self.reqs.values())
        self.reqs.clear()
        self._rounds.close(reqs, outcome, reason)
        for req in reqs:
            for sj in list(req.jobs):
                self._jobs.fail(sj, outcome, reason)
            self.env.producers.request_gone(req.kv, self)

    def unlink(self) -> None:
        """The session closed and wound down: its parts forget it and this role, so none
        is left in a reference cycle."""
        self._jobs.unlink()
        self._rounds.unlink()
        self._lookups.unlink()

    def drop_pins(self, outcome: Outcome, reason: str) -> int:
        """Stop waiting for the leases of a closed session (tier shutdown): the pinned store
        jobs get their results now. Returns how many blocks were still pinned."""
        return self._rounds.drop_pins(outcome, reason)

    @property
    def n_rounds(self) -> int:
        """Open fetch rounds over all requests."""
        return self._rounds.count

    @property
    def n_pins(self) -> int:
        """Pinned blocks over all rounds (also after ``close``, until released or expired)."""
        return self._rounds.pinned

    @property
    def lookups_waiting(self) -> int:
        """The peer's lookups waiting for ``serve_lookups`` (or their deadline)."""
        return len(self._lookups)

    @property
    def busy(self) -> bool:
        """Rounds, pins or lookups outstanding (a reason for the engine to keep ticking)."""
        rounds = self._rounds
        return bool(rounds.count or rounds.pinned or len(self._lookups))

    def state_sizes(self) -> dict[str, int]:
        reqs = self.reqs.values()
        return {
            "producer_requests": len(self.reqs),
            "producer_rounds": self._rounds.count,
            "producer_jobs": sum(len(r.jobs) for r in reqs),
            "supply": sum(len(r.supply) for r in reqs),
            "demand": sum(len(r.demand) for r in reqs),
            "pins": self._rounds.pinned,
            "serves": len(self._lookups),
        }

    # -- internals --------------------------------------------------------------------------

    def _refuse_winding_down(self, msg: Fetch) -> None:
        req = self.reqs.get(msg.kv_request_id)
        if req is not None:  # its release(read=False) will name this round
            req.max_round = max(req.max_round, msg.round)
        self._rounds.refuse(
            msg.kv_request_id, msg.round, Outcome.PEER_DEAD, "the producer is shutting down"
        )

    def _servable(self, req: ProducerRequest, msg: Fetch) -> bool | None:
        """Whether the supply holds every key of the fetch. None when it cannot be served:
        a request conflict, or demand the closed supply cannot meet (answered already)."""
        keys = msg.keys
        conflict = req.conflict(keys)
        if conflict:  # a request-level conflict fails that round, not the session
            log.warning(
                "peer %s: round %d of %r refused: %s", self.peer, msg.round, req.kv, conflict
            )
            self._rounds.refuse(req.kv, msg.round, Outcome.REQUEST_CONFLICT, conflict)
            return None
        held_all = req.holds_all(keys)
        if not req.supply_open and not held_all:
            self._rounds.refuse(
                req.kv,
                msg.round,
                Outcome.DEMAND_UNMET,
                f"{req.missing(keys)} of {len(keys)} block(s) are not held and cannot arrive",
            )
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
            self._rounds.refuse(kv, msg.round, Outcome.DEMAND_UNMET, req)
            return None
        if msg.round <= req.max_round:  # e.g. a finished kv_request_id reused: that round fails
            if msg.keys:
                self._rounds.refuse(
                    kv,
                    msg.round,
                    Outcome.REQUEST_CONFLICT,
                    f"round {msg.round} is not above the previous round "
                    f"{req.max_round} of {kv!r} (is the kv_request_id reused "
                    f"while the producer still holds it?)",
                )
            return None
        req.max_round = msg.round
        return req

    def _adopt_pinned(self, kv: str, job: Job) -> set[bytes] | None:
        """Turn a job the hit source pinned into supply for ``kv``. None if it cannot serve
        (then the job already has its result, or could not be recorded)."""
        ledger = self.env.ledger
        try:
            ledger.open(job.job_id, False, kv, self.peer)
        except UsageError:
            log.exception("peer %s: hit source pinned an unusable job; answering MISS", self.peer)
            return None
        if job.is_load or len(job.keys) != len(job.block_ids):
            ledger.close(
                job.job_id, Outcome.SUBMIT_FAILED, "pinned job is not a store with one slot per key"
            )
            return None
        req = self._claimed(kv, by_fetch=False)
        if isinstance(req, str):
            ledger.close(job.job_id, Outcome.NOTHING_TO_DO, req)
            return None
        self._add_supply(req, job)
        return set(job.keys)

    def _add_supply(self, req: ProducerRequest, job: Job) -> None:
        sj = self._jobs.open(req, job)
        if req.released:
            sj.released = True
        else:
            for rnd, batch in req.add_supply(sj, job.block_ids).items():
                self._rounds.ready(rnd, batch)
        self._jobs.settle(sj)

    def _release_request(self, req: ProducerRequest) -> None:
        """Terminal fetch: the consumer is done with ``req``; release everything."""
        req.released = True
        req.clear_supply()
        for rnd in list(req.rounds.values()):
            self._rounds.release(rnd, (Outcome.ABORTED, "the consumer ended the request"))
        for sj in list(req.jobs):
            sj.released = True
            self._jobs.settle(sj)
        self._maybe_drop(req)

    def _maybe_drop(self, req: ProducerRequest) -> None:
        """Free ``req`` once nothing of it is left (no round, no job, no local producer)."""
        if self.closing or req.rounds or req.jobs or self.reqs.get(req.kv) is not req:
            return
        if self.env.producers.producer_active(req.kv):
            return  # keep the binding: more stores will come for this request
        del self.reqs[req.kv]
        self.env.producers.request_gone(req.kv, self)
