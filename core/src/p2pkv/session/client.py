"""Consumer role of a session: load rounds, the reads into our slots, probes, release.

Each ``submit_load`` becomes one **round** of its ``kv_request_id`` (rounds are numbered per
request and session and complete independently). The consumer owns every write into its
region (docs/protocol.md §5): it sends ``fetch``; the producer answers ``ready`` (which keys
sit in which of its slots, pinned for the lease) and **we post the reads**
(``DataTransport.read_blocks``, through the tier's :class:`~p2pkv.session.reads.ReadGate`). A
round is ``done`` once every block was read **and** each read completed within the lease of
the moment we sent the fetch, on our own clock; then we send ``release(read=True)``.

Flow control: a round's fetch goes out only once the session's
:class:`~p2pkv.session.window.LoadWindow` has room (``flow.window_rounds`` /
``flow.window_blocks``); until then it waits in the tier, PD loads before prefix pulls, within
its own load deadline (a timeout there names the queue). A read the data transport has no room
for yet (``TransferBusy``) waits in the read gate the same way.

On any failure (load deadline, request finished, the producer's ``round_failed``, a failed
read, session death, shutdown) we cancel our reads first (``cancel`` is final: no byte can
land afterwards), report the result at once, and send ``release(read=False)`` when the
session still carries messages. So a result, once reported, is final for the bytes too: the
engine may reuse the slots the moment it sees it, and nothing needs fencing.

When a request is finished (or one of its loads failed) and no round is open, the consumer
sends one **terminal fetch** (empty keys) so the producer releases what it still holds.

Threading: driver thread only.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Sequence

from p2pkv.errors import ProtocolError
from p2pkv.protocol import Fetch, Lookup, LookupResp, Ready, Release, RoundFailed
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv, SessionLink
from p2pkv.session.reads import HeldRead
from p2pkv.session.window import LoadWindow
from p2pkv.types import Job, LookupResult, Outcome

__all__ = ["LEASE_DRIFT", "ClientRole", "failure_outcome"]

log = logging.getLogger(__name__)

LEASE_DRIFT = 0.01
"""Share of the lease kept back for the producer's clock running faster than ours."""

_FAILURES = {o.value: o for o in Outcome if not o.success}


class Phase(enum.IntEnum):
    """Where a load round is: waiting for READY, fetch sent, ended."""

    UNSENT = 0
    ACTIVE = 1
    DONE = 2


class Probe(enum.IntEnum):
    """Where a probed key is: not sent yet, asked, answered."""

    PENDING = 0
    INFLIGHT = 1
    MISS = 2
    HIT = 3


def _first_bad_position(pos: list[int], n: int, announced: set[int]) -> int:
    """The first of ``pos`` outside ``0..n-1`` or named before (earlier in ``pos`` too)."""
    seen = set(announced)
    for p in pos:
        if p >= n or p in seen:
            return p
        seen.add(p)
    raise AssertionError("no bad position")


def failure_outcome(value: str) -> Outcome:
    """The failure ``Outcome`` named by a ``round_failed.outcome`` (else TRANSFER_FAILED)."""
    return _FAILURES.get(value, Outcome.TRANSFER_FAILED)


class LoadRound:
    __slots__ = ("announced", "held", "job_id", "keys", "no", "opened", "phase", "reads", "req",
                 "sent_at", "slots", "timer", "unread")

    def __init__(self, req: ConsumerRequest, no: int, job: Job) -> None:
        self.req = req
        self.no = no
        self.job_id = job.job_id
        self.keys: Sequence[bytes] = job.keys
        self.slots = job.block_ids
        self.phase = Phase.UNSENT
        self.opened = False
        """Counted open in the session's load window (from its turn until it ends)."""
        self.held: list[HeldRead] = []
        """Reads announced by a ``ready`` and waiting in the read gate for room."""
        self.sent_at = 0.0
        """Our clock when the fetch went out: the lease is counted from here."""
        self.announced: set[int] = set()
        """Key positions a ``ready`` named."""
        self.unread = len(job.keys)
        """Blocks whose read has not completed."""
        self.reads: dict[int, tuple[int, float]] = {}
        """Our reads in flight: transfer id -> (blocks, when posted)."""
        self.timer: Timer | None = None

    @property
    def nblocks(self) -> int:
        return len(self.keys)


class ConsumerRequest:
    __slots__ = ("contacted", "failed", "finished", "kv", "loaded", "next_round", "open_keys",
                 "probes", "released", "rounds", "unsent_keys")

    def __init__(self, kv: str) -> None:
        self.kv = kv
        self.next_round = 0
        self.rounds: dict[int, LoadRound] = {}
        self.open_keys: set[bytes] = set()
        """Keys of the open rounds: a load may not ask for one again (request conflict)."""
        self.loaded: dict[int, Sequence[bytes]] = {}
        """Job id -> keys of rounds done whose result the engine may not have taken yet: a
        load of one of those keys conflicts too, until the engine has the result."""
        self.contacted = False
        """A fetch or lookup for this request was sent to the peer."""
        self.finished = False
        self.failed = False
        self.released = False
        self.probes: dict[bytes, Probe] = {}
        self.unsent_keys: list[bytes] = []


class ClientRole:
    """The consumer half of one session (see the module docstring)."""

    def __init__(self, env: SessionEnv, session: SessionLink) -> None:
        self.env = env
        self.session = session
        self.peer = session.peer
        self.reqs: dict[str, ConsumerRequest] = {}
        self.window: LoadWindow[LoadRound] = LoadWindow(env.flow.window_rounds,
                                                        env.flow.window_blocks)
        self.reads: dict[int, LoadRound] = {}
        """Our reads in flight, by transfer id."""
        self.lookups: dict[int, tuple[ConsumerRequest, list[bytes], Timer]] = {}
        self.probing: dict[str, ConsumerRequest] = {}
        """Requests with probe keys not yet sent (flushed at ``on_schedule_end``)."""
        self.next_seq = 0
        self.n_rounds = 0
        self.closing = False
        self._on_load_timeout = self._load_timeout
        """Bound once: arming a load deadline allocates no method object."""

    # -- engine side ------------------------------------------------------------------------

    def open_request(self, kv: str) -> None:
        """Track ``kv`` from ``on_new_request`` on (so a session death marks it failed)."""
        if kv not in self.reqs:
            self.reqs[kv] = ConsumerRequest(kv)

    def submit(self, job: Job, kv: str, *, pull: bool = False) -> None:
        """Start a load round for ``job`` (already recorded in the ledger); ``pull``: a
        prefix pull (``remote_kv_source``), which waits behind PD loads for the window."""
        req = self.reqs.get(kv)
        if req is None:
            req = self.reqs[kv] = ConsumerRequest(kv)
        conflict = self._conflict(req, job)
        if conflict:
            self.env.ledger.close(job.job_id, Outcome.REQUEST_CONFLICT, conflict)
            return
        req.open_keys.update(job.keys)
        rnd = LoadRound(req, req.next_round, job)
        req.next_round += 1
        req.rounds[rnd.no] = rnd
        self.n_rounds += 1
        env = self.env
        rnd.timer = env.deadlines.at(env.clock() + env.timeouts.load, self._on_load_timeout, rnd)
        self.window.wait(rnd, pull=pull)
        self._open_rounds()

    def _conflict(self, req: ConsumerRequest, job: Job) -> str:
        """Why ``job`` cannot be a new round of ``req`` (only this job fails), or ``""``."""
        if req.released:
            return (f"request {req.kv!r} was already ended with its producer (finished or an "
                    f"earlier load failed); a new load needs a new kv_request_id")
        if req.open_keys and not req.open_keys.isdisjoint(job.keys):
            wanted = set(job.keys)
            busy = next(r for r in req.rounds.values() if not wanted.isdisjoint(r.keys))
            return (f"{len(req.open_keys.intersection(job.keys))} of its blocks are already "
                    f"being loaded for request {req.kv!r} by job {busy.job_id}")
        ledger = self.env.ledger
        for job_id, keys in list(req.loaded.items()):
            if not ledger.not_taken(job_id):
                del req.loaded[job_id]
            elif not set(keys).isdisjoint(job.keys):
                return (f"its blocks were just loaded for request {req.kv!r} by job {job_id}, "
                        f"whose result the engine has not taken yet")
        return ""

    def _open_rounds(self) -> None:
        """Send the fetches of waiting rounds the window has room for (once ready)."""
        if not self.session.ready or not self.window.waiting:
            return
        now = self.env.clock()
        for rnd in self.window.admit(lambda r: r.timer is not None and r.timer[0] <= now):
            rnd.opened = True
            self._send_round(rnd)

    def finish(self, kv: str) -> None:
        """The engine finished ``kv``: its open rounds fail REQUEST_FINISHED now."""
        req = self.reqs.get(kv)
        if req is None:
            return
        req.finished = True
        self._drop_probes(req)
        self._end_rounds(req, Outcome.REQUEST_FINISHED, "request finished during the load")
        self._maybe_release(req)

    def wind_down(self) -> None:
        """The tier is shutting down: every round fails SHUTDOWN now (reads cancelled)."""
        for req in list(self.reqs.values()):
            self._drop_probes(req)
            self._end_rounds(req, Outcome.SHUTDOWN, "tier shut down during the load")

    def _end_rounds(self, req: ConsumerRequest, why: Outcome, detail: str) -> None:
        for rnd in list(req.rounds.values()):
            self._fail(rnd, why, detail)

    def probe(self, kv: str, key: bytes) -> LookupResult:
        """Symmetric lookup: RETRY until the batched probe is answered, then HIT/MISS."""
        req = self.reqs.get(kv)
        if req is None:
            req = self.reqs[kv] = ConsumerRequest(kv)
        state = req.probes.get(key)
        if state is None:
            if req.finished:
                return LookupResult.MISS
            req.probes[key] = Probe.PENDING
            req.unsent_keys.append(key)
            self.probing[kv] = req
            return LookupResult.RETRY
        if state is Probe.HIT:
            return LookupResult.HIT
        if state is Probe.MISS:
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
                probes[k] = Probe.INFLIGHT
            req.contacted = True
            self.lookups[seq] = (req, keys, env.deadlines.at(deadline, self._lookup_timeout, seq))
            if not self.session.send(Lookup(seq, req.kv, keys)):
                self._unanswered(seq)  # too many keys for one frame: they are misses
        self.probing.clear()

    # -- messages ---------------------------------------------------------------------------

    def on_ready(self, msg: Ready, peer_num_blocks: int) -> None:
        """The producer pinned some of the round's blocks: read them into our slots."""
        top = max(msg.slots)
        if top >= peer_num_blocks:
            raise ProtocolError(f"ready.slots: slot {top} is outside the producer's region "
                                f"0..{peer_num_blocks - 1}")
        rnd = self._round(msg.kv_request_id, msg.round, "ready")
        if rnd is None:  # the round ended here meanwhile (we sent, or will send, release)
            return
        n = len(rnd.keys)
        pos, announced = msg.pos, rnd.announced
        if max(pos) >= n or len(set(pos)) != len(pos) or not announced.isdisjoint(pos):
            bad = _first_bad_position(pos, n, announced)
            raise ProtocolError(f"ready.pos: position {bad} is outside the round's {n} "
                                f"key(s) or was already announced")
        announced.update(pos)
        gate = self.env.reads
        for local, remote in gate.split(self.peer, list(map(rnd.slots.__getitem__, pos)),
                                        msg.slots):
            held = HeldRead(self, rnd, self.peer, local, remote)
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
            env.observers.transfer_submitted(peer=self.peer, transfer_id=rid, blocks=nblocks,
                                             nbytes=nblocks * env.local.block_len)

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
            env.observers.transfer_finished(peer=self.peer, transfer_id=rid,
                                            success=ok and not late,
                                            nbytes=nblocks * env.local.block_len,
                                            seconds=now - posted)
        if not ok:
            env.counters["transfers_failed"] += 1
            self._fail(rnd, Outcome.TRANSFER_FAILED, f"read {rid} failed")
            return
        if late:
            env.counters["transfers_failed"] += 1
            self._fail(rnd, Outcome.TRANSFER_FAILED,
                       f"read {rid} completed {now - rnd.sent_at:.1f}s after the fetch, past "
                       f"the producer's lease ({window:.1f}s usable): its source may have "
                       f"changed")
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
            if probes.get(k) is Probe.INFLIGHT:
                probes[k] = Probe.HIT if hit else Probe.MISS

    def on_session_ready(self) -> None:
        """The handshake completed: send the rounds submitted before it (the window's
        worth)."""
        self._open_rounds()

    # -- internals --------------------------------------------------------------------------

    def _round(self, kv: str, no: int, what: str) -> LoadRound | None:
        req = self.reqs.get(kv)
        if req is None:
            return None
        if no >= req.next_round:
            raise ProtocolError(f"{what}.round: round {no} of {kv!r} was never sent")
        return req.rounds.get(no)

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
                waited = (f"; {len(rnd.held)} read(s) waited for room in the data transport "
                          f"({env.reads.busy})")
            detail = (f"{rnd.unread} of {len(rnd.keys)} block(s) not read within {load}s"
                      f"{waited}")
        elif not self.session.ready:
            detail = "never sent: handshake not complete"
        else:
            window = self.window
            detail = (f"waited {load}s in the flow-control queue for {self.peer} behind "
                      f"{window.ahead_of(rnd)} load(s); the window was full: {window.rounds} "
                      f"round(s) of flow.window_rounds={window.max_rounds} and {window.blocks} "
                      f"block(s) of flow.window_blocks={window.max_blocks} open")
        self._fail(rnd, Outcome.LOAD_TIMEOUT, detail)

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
                self.session.send(Fetch(req.kv, req.next_round, []))
                req.next_round += 1
        if req.finished and self.reqs.get(req.kv) is req:
            self._drop_probes(req)
            del self.reqs[req.kv]

    def _drop_probes(self, req: ConsumerRequest) -> None:
        if req.probes:
            req.probes.clear()
            req.unsent_keys = []
            self.probing.pop(req.kv, None)
            for seq in [s for s, e in self.lookups.items() if e[0] is req]:
                self.env.deadlines.cancel(self.lookups.pop(seq)[2])

    def _lookup_timeout(self, seq: int) -> None:
        entry = self.lookups.get(seq)
        if entry is not None:
            self.env.observers.timeout(kind="lookup", kv_request_id=entry[0].kv,
                                       peer=self.peer)
            self._unanswered(seq)

    def _unanswered(self, seq: int) -> None:
        """Lookup ``seq`` gets no answer: its keys still asked are misses."""
        req, keys, timer = self.lookups.pop(seq)
        self.env.deadlines.cancel(timer)
        probes = req.probes
        for k in keys:
            if probes.get(k) is Probe.INFLIGHT:
                probes[k] = Probe.MISS

    # -- lifecycle --------------------------------------------------------------------------

    def close(self, outcome: Outcome, reason: str) -> None:
        """The session is over: every round fails with ``outcome`` now (its reads cancelled,
        finally); unfinished requests are marked failed."""
        env = self.env
        self.closing = True
        for _, _, timer in self.lookups.values():
            env.deadlines.cancel(timer)
        self.lookups.clear()
        self.probing.clear()
        for req in list(self.reqs.values()):
            for rnd in list(req.rounds.values()):
                self._fail(rnd, outcome, reason)
            if not req.finished and not req.failed:
                req.failed = True
                env.failed_loads.mark(req.kv, f"{outcome.value}: {reason}")
        self.reqs.clear()

    @property
    def busy(self) -> bool:
        return bool(self.n_rounds or self.lookups or self.probing)

    def state_sizes(self) -> dict[str, int]:
        return {
            "client_requests": len(self.reqs),
            "client_rounds": self.n_rounds,
            "reads": len(self.reads),
            "queued_rounds": self.window.waiting,
            "lookups": len(self.lookups),
            "probes": sum(len(r.probes) for r in self.reqs.values()),
        }
