"""Consumer role of a session: load rounds, the reads into our slots, and release.

Each ``submit_load`` becomes one **round** of its ``kv_request_id``
(:mod:`~p2pkv.session.loads` holds the per-request state). The consumer owns every write
into its region (docs/protocol.md §5). It sends ``fetch``; the producer answers ``ready``:
which keys sit in which of its slots, pinned for the lease. Then **we post the reads**
(``DataTransport.read_blocks``, through the tier's :class:`~p2pkv.session.reads.ReadGate`).
A round is ``done`` once every block was read, **and** each read completed within the
lease of the moment we sent the fetch, on our own clock. Then we send ``release(read=True)``.
Probes of keys (symmetric lookups) are :mod:`~p2pkv.session.probes`.

Flow control: a round's fetch goes out only once the session's
:class:`~p2pkv.session.window.LoadWindow` has room (``flow.window_rounds`` /
``flow.window_blocks``). Until then it waits in the tier, PD loads before prefix pulls,
within its own load deadline; a timeout there names the queue. A read the data transport has
no room for yet (``TransferBusy``) waits in the read gate the same way.

On any failure we cancel our reads first (``cancel`` is final: no byte can land
afterwards). Failures are the load deadline, the request finishing, the producer's
``round_failed``, a failed read, session death and shutdown. We report the result at once,
and send ``release(read=False)`` while the session carries messages. So a reported result
is final for the bytes too: the engine may reuse the slots at once, and nothing needs
fencing.

When a request is finished (or one of its loads failed) and no round is open, the consumer
sends one **terminal fetch** (empty keys), so the producer releases what it still holds. It
is sent as cleanup (``SessionLink.send``): it rides the next frame to that producer, or
leaves at the tier's next tick, instead of waking both sides' I/O on its own.

Threading: driver thread only.
"""

from __future__ import annotations

from p2pkv.errors import ProtocolError
from p2pkv.protocol import Fetch, LookupResp, Ready, Release, RoundFailed
from p2pkv.session.env import ClosedLink, SessionEnv, SessionLink
from p2pkv.session.loads import ConsumerRequest, LoadRound, Phase
from p2pkv.session.probes import Probes
from p2pkv.session.reads import HeldRead
from p2pkv.session.window import LoadWindow
from p2pkv.types import Job, LookupResult, Outcome

LEASE_DRIFT = 0.01
"""Share of the lease kept back for the producer's clock running faster than ours."""

_FAILURES = {o.value: o for o in Outcome if not o.success}


def failure_outcome(value: str) -> Outcome:
    """The failure ``Outcome`` named by a ``round_failed.outcome`` (else TRANSFER_FAILED)."""
    return _FAILURES.get(value, Outcome.TRANSFER_FAILED)


class ConsumerRole:
    """The consumer half of one session (see the module docstring)."""

    def __init__(self, env: SessionEnv, session: SessionLink) -> None:
        self.env = env
        self.session = session
        self.peer = session.peer
        self.reqs: dict[str, ConsumerRequest] = {}
        """The requests this role holds state for (read-only outside the role)."""
        self.window: LoadWindow[LoadRound] = LoadWindow(
            env.flow.window_rounds, env.flow.window_blocks
        )
        self.reads: dict[int, LoadRound] = {}
        """Our reads in flight, by transfer id."""
        self.probes = Probes(env, session)
        self.n_rounds = 0
        self.closing = False

    # -- engine side ------------------------------------------------------------------------

    def open_request(self, kv: str) -> None:
        """Track ``kv`` from ``on_new_request`` on (so a session death marks it failed)."""
        self._request(kv)

    def submit(
        self, job: Job, kv: str, *, pull: bool = False, deadline: float | None = None
    ) -> None:
        """Start a load round for ``job`` (already recorded in the ledger). ``pull``: a
        prefix pull (``remote_kv_source``), which waits behind PD loads for the window.
        ``deadline``: when the load fails ``load_timeout`` (default: ``timeouts.load`` from
        now; a load that waited for its peer's dial keeps the one it had)."""
        req = self._request(kv)
        env = self.env
        conflict = req.conflict(job, env.ledger)
        if conflict:
            env.ledger.close(job.job_id, Outcome.REQUEST_CONFLICT, conflict)
            return
        rnd = req.open_round(job)
        self.n_rounds += 1
        if deadline is None:
            deadline = env.clock() + env.timeouts.load
        rnd.timer = env.deadlines.at(deadline, self._load_timeout, rnd)
        self.window.wait(rnd, pull=pull)
        self._open_rounds()

    def finish(self, kv: str) -> None:
        """The engine finished ``kv``: its open rounds fail REQUEST_FINISHED now."""
        req = self.reqs.get(kv)
        if req is None:
            return
        req.finished = True
        self.probes.drop(req)
        self._end_rounds(req, Outcome.REQUEST_FINISHED, "request finished during the load")
        self._maybe_release(req)

    def wind_down(self) -> None:
        """The tier is shutting down: every round fails SHUTDOWN now (reads cancelled)."""
        for req in list(self.reqs.values()):
            self.probes.drop(req)
            self._end_rounds(req, Outcome.SHUTDOWN, "tier shut down during the load")

    def probe(self, kv: str, key: bytes) -> LookupResult:
        """Symmetric lookup: RETRY until the batched probe is answered, then HIT/MISS."""
        return self.probes.probe(self._request(kv), key)

    def flush_lookups(self) -> None:
        """Send one lookup per request with new probe keys (``on_schedule_end``)."""
        self.probes.flush()

    # -- messages ---------------------------------------------------------------------------

    def on_ready(self, msg: Ready, peer_num_blocks: int) -> None:
        """The producer pinned some of the round's blocks: read them into our slots."""
        top = max(msg.slots)
        if top >= peer_num_blocks:
            raise ProtocolError(
                f"ready.slots: slot {top} is outside the producer's region 0..{peer_num_blocks - 1}"
            )
        rnd = self._round(msg.kv_request_id, msg.round, "ready")
        if rnd is None:  # the round ended here meanwhile (we sent, or will send, release)
            return
        local = rnd.announce(msg.pos)
        gate = self.env.reads
        for piece_local, piece_remote in gate.split(self.peer, local, msg.slots):
            held = HeldRead(self, rnd, self.peer, piece_local, piece_remote)
            rnd.held.append(held)
            gate.post(held)
            if rnd.phase is not Phase.ACTIVE:
                return  # a refused piece failed the round

    def read_posted(self, held: HeldRead, rid: int) -> None:
        """The read gate posted ``held`` as read ``rid`` (now, or once room was free)."""
        rnd: LoadRound = held.owner_data  # type: ignore[assignment]
        rnd.held.remove(held)
        env = self.env
        nblocks = held.nblocks
        rnd.reads[rid] = (nblocks, env.clock())
        self.reads[rid] = rnd
        env.owners[rid] = self
        if env.observers.enabled:
            env.observers.transfer_submitted(
                peer=self.peer,
                transfer_id=rid,
                blocks=nblocks,
                nbytes=nblocks * env.local.block_len,
            )

    def read_refused(self, held: HeldRead, exc: Exception) -> None:
        """The data transport refused ``held`` for good: its round fails."""
        rnd: LoadRound = held.owner_data  # type: ignore[assignment]
        rnd.held.remove(held)
        self.env.counters["submit_failures"] += 1
        self._fail(rnd, Outcome.SUBMIT_FAILED, f"read_blocks failed: {type(exc).__name__}: {exc}")

    def on_data(self, rid: int, ok: bool) -> None:
        """A read of ours terminated (routed here from ``data.poll``)."""
        rnd = self.reads.pop(rid)
        nblocks, posted = rnd.reads.pop(rid)
        env = self.env
        env.reads.ended(rid)
        now = env.clock()
        window = self.session.read_window
        late = ok and now - rnd.sent_at > window
        if env.observers.enabled:
            env.observers.transfer_finished(
                peer=self.peer,
                transfer_id=rid,
                success=ok and not late,
                nbytes=nblocks * env.local.block_len,
                seconds=now - posted,
            )
        if not ok:
            env.counters["transfers_failed"] += 1
            self._fail(rnd, Outcome.TRANSFER_FAILED, f"read {rid} failed")
            return
        if late:
            env.counters["transfers_failed"] += 1
            self._fail(
                rnd,
                Outcome.TRANSFER_FAILED,
                f"read {rid} completed {now - rnd.sent_at:.1f}s after the fetch, past "
                f"the producer's lease ({window:.1f}s usable): its source may have "
                f"changed",
            )
            return
        env.counters["blocks_read"] += nblocks
        rnd.unread -= nblocks
        if rnd.unread == 0:
            self.session.send(Release(rnd.req.kv, rnd.no, True))
            self._complete(rnd, Outcome.DONE, "")

    def on_round_failed(self, msg: RoundFailed) -> None:
        rnd = self._round(msg.kv_request_id, msg.round, "round_failed")
        if rnd is None:
            return
        self._fail(rnd, failure_outcome(msg.outcome), f"producer: {msg.reason}")

    def on_lookup_resp(self, msg: LookupResp) -> None:
        self.probes.on_lookup_resp(msg)

    def on_session_ready(self) -> None:
        """The handshake completed: send the rounds submitted before it (the window's
        worth)."""
        self._open_rounds()

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: every round fails with ``outcome`` now (its reads cancelled,
        finally); unfinished requests are marked failed."""
        env = self.env
        self.closing = True
        self.probes.close()
        for req in list(self.reqs.values()):
            for rnd in list(req.rounds.values()):
                self._fail(rnd, outcome, reason)
            if not req.finished and not req.failed:
                req.failed = True
                env.failed_loads.mark(req.kv, f"{outcome.value}: {reason}")
        self.reqs.clear()

    def unlink(self) -> None:
        """The session closed and wound down: a stand-in replaces it here and in the
        probes, so no reference cycle is left."""
        link = ClosedLink(self.peer)
        self.session = link
        self.probes.unlink(link)

    @property
    def busy(self) -> bool:
        return bool(self.n_rounds or self.probes.busy)

    def state_sizes(self) -> dict[str, int]:
        return {
            "consumer_requests": len(self.reqs),
            "consumer_rounds": self.n_rounds,
            "reads": len(self.reads),
            "queued_rounds": self.window.waiting,
            "lookups": self.probes.in_flight,
            "probes": sum(len(r.probes) for r in self.reqs.values()),
        }

    # -- internals --------------------------------------------------------------------------

    def _request(self, kv: str) -> ConsumerRequest:
        req = self.reqs.get(kv)
        if req is None:
            req = self.reqs[kv] = ConsumerRequest(kv)
        return req

    def _round(self, kv: str, no: int, what: str) -> LoadRound | None:
        req = self.reqs.get(kv)
        if req is None:
            return None
        if no >= req.next_round:
            raise ProtocolError(f"{what}.round: round {no} of {kv!r} was never sent")
        return req.rounds.get(no)

    def _open_rounds(self) -> None:
        """Send the fetches of waiting rounds the window has room for (once ready)."""
        if not self.session.ready or not self.window.waiting:
            return
        now = self.env.clock()
        for rnd in self.window.admit(lambda r: r.timer is not None and r.timer[0] <= now):
            rnd.opened = True
            self._send_round(rnd)

    def _send_round(self, rnd: LoadRound) -> None:
        rnd.phase = Phase.ACTIVE
        rnd.sent_at = self.env.clock()
        if self.session.send(Fetch(rnd.req.kv, rnd.no, list(rnd.keys))):
            rnd.req.contacted = True
        else:  # the producer never saw it: nothing to release
            rnd.phase = Phase.UNSENT
            self._fail(rnd, Outcome.SUBMIT_FAILED, "its fetch is larger than a frame may be")

    def _load_timeout(self, rnd: LoadRound) -> None:
        rnd.timer = None
        env = self.env
        env.observers.timeout(kind="load", kv_request_id=rnd.req.kv, peer=self.peer)
        load = env.timeouts.load
        if rnd.phase is not Phase.UNSENT:
            waited = ""
            if rnd.held:
                waited = (
                    f"; {len(rnd.held)} read(s) waited for room in the data transport "
                    f"({env.reads.busy})"
                )
            detail = f"{rnd.unread} of {len(rnd.keys)} block(s) not read within {load}s{waited}"
        elif not self.session.ready:
            detail = "never sent: handshake not complete"
        else:
            window = self.window
            detail = (
                f"waited {load}s in the flow-control queue for {self.peer} behind "
                f"{window.ahead_of(rnd)} load(s); the window was full: {window.rounds} "
                f"round(s) of flow.window_rounds={window.max_rounds} and {window.blocks} "
                f"block(s) of flow.window_blocks={window.max_blocks} open"
            )
        self._fail(rnd, Outcome.LOAD_TIMEOUT, detail)

    def _end_rounds(self, req: ConsumerRequest, why: Outcome, detail: str) -> None:
        for rnd in list(req.rounds.values()):
            self._fail(rnd, why, detail)

    def _fail(self, rnd: LoadRound, outcome: Outcome, detail: str) -> None:
        """End ``rnd`` with a failure: cancel its reads (final), release the producer's pins
        if the fetch went out, and report at once."""
        env = self.env
        if rnd.reads:
            rids = list(rnd.reads)
            env.data.cancel(rids)
            for rid in rids:
                self.reads.pop(rid, None)
                env.owners.pop(rid, None)
                env.reads.ended(rid)
            rnd.reads.clear()
        if rnd.held:
            for held in rnd.held:
                held.live = False  # the gate drops it when its turn comes
            rnd.held.clear()
        if not rnd.opened:
            self.window.leave(rnd)
        if rnd.phase is Phase.ACTIVE and not self.closing:
            self.session.send(Release(rnd.req.kv, rnd.no, False))
        self._complete(rnd, outcome, detail)

    def _complete(self, rnd: LoadRound, outcome: Outcome, detail: str) -> None:
        env = self.env
        env.deadlines.cancel(rnd.timer)
        rnd.timer = None
        rnd.phase = Phase.DONE
        req = rnd.req
        del req.rounds[rnd.no]
        req.open_keys.difference_update(rnd.keys)
        self.n_rounds -= 1
        env.ledger.close(rnd.job_id, outcome, detail)
        if outcome.success:
            req.loaded[rnd.job_id] = rnd.keys
        elif not req.finished and not req.failed:
            req.failed = True
            env.failed_loads.mark(req.kv, f"{outcome.value}: {detail}")
        if rnd.opened:
            rnd.opened = False
            self.window.close(rnd)
            if not self.closing:
                self._open_rounds()
        self._maybe_release(req)

    def _maybe_release(self, req: ConsumerRequest) -> None:
        if req.rounds or self.closing:
            return
        if (req.finished or req.failed) and req.contacted and not req.released:
            req.released = True
            if self.session.ready:
                self.session.send(Fetch(req.kv, req.next_round, []), cleanup=True)
                req.next_round += 1
        if req.finished and self.reqs.get(req.kv) is req:
            self.probes.drop(req)
            del self.reqs[req.kv]
