"""``P2PTier``: the engine-facing manager of the P2P KV tier (docs/concepts.md, docs/protocol.md).

The tier owns one control and one data transport, a session per peer (both roles in each,
see :mod:`p2pkv.session`), the job ledger (exactly one result per job) and one deadline heap.
Everything is driven by ``tick`` (called from ``get_finished_jobs``, ``drain_jobs`` and by
adapters that want to progress I/O between steps); no thread of its own.

Threading: one caller at a time. The engine may call from different threads (vLLM's
scheduler and tier-poll threads, under one lock), but never two at once: a public method
entered while another thread is inside raises ``ConcurrentCall`` and does nothing
(:mod:`p2pkv.driver`). Nothing here blocks except ``drain_jobs`` and ``shutdown``, which are
bounded by deadlines.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Sequence

from p2pkv.addressing import format_address, parse_address
from p2pkv.call_guard import GuardedDataTransport
from p2pkv.config import TierConfig
from p2pkv.contracts import (
    ControlConnection,
    ControlSettings,
    ControlTransport,
    DataSettings,
    DataTransport,
)
from p2pkv.dial_policy import DialPolicy
from p2pkv.discovery import Discovery
from p2pkv.driver import DriverGuard, driver_call
from p2pkv.errors import ConfigError
from p2pkv.idle_reaper import IdleReaper
from p2pkv.registry import Registry, default_registry
from p2pkv.routing import Routing, parse_routing
from p2pkv.session.admission import Admission
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.env import LocalIdentity, PendingSession, SessionEnv
from p2pkv.session.intake import JobIntake
from p2pkv.session.ledger import JobLedger
from p2pkv.session.pause import PauseDetector
from p2pkv.session.producers import ProducerDirectory
from p2pkv.session.session import Session, State
from p2pkv.types import Job, JobResult, LocalHitSource, LookupResult, Outcome, RequestContext

__all__ = ["LocalHitSource", "P2PTier"]

log = logging.getLogger(__name__)

_DRAIN_WARN_S = 5.0
_DISCOVERY_JOIN = 1.0  # seconds shutdown waits for the resolver thread (a lookup may hang)


class P2PTier:
    """One peer's P2P tier over a control and a data transport chosen by name.

    ``region`` is the engine's KV region (1-D writable bytes, ``num_blocks * block_len``);
    block ids in jobs are slot indexes into it. ``clock`` is injected so timeout tests never
    sleep. ``control``/``data`` may be given pre-built (tests, fault injection); otherwise
    they are built from ``config`` through ``registry``. A bad region or transport config
    raises ``ConfigError`` (the data transport validates the region it is built on).
    """

    def __init__(
        self,
        config: TierConfig,
        region: memoryview,
        block_len: int,
        *,
        registry: Registry | None = None,
        clock: Callable[[], float] = time.monotonic,
        control: ControlTransport | None = None,
        data: DataTransport | None = None,
    ) -> None:
        self._guard = DriverGuard("P2PTier")
        self._config = config
        self._clock = clock
        self._block_len = block_len
        reg = registry if registry is not None else default_registry()
        self._data = self._call_guard = GuardedDataTransport(
            _data_transport(reg, config, region, block_len, data))
        try:
            self._control = control if control is not None else _control_transport(reg, config)
        except BaseException:
            if data is None:
                self._data.close()
            raise
        self._observers = reg.observers
        self._deadlines = Deadlines()
        self._ledger = JobLedger(clock, self._observers)
        self._intake = JobIntake(self._ledger, config.limits, self._data.num_blocks)
        self._env = self._session_env()
        if self._control.batch_sends():  # then frames leave as each public call returns
            self._guard.on_exit = self._env.flush_control = self._control.flush
        self._sessions: dict[str, Session] = {}
        self._lingering: set[Session] = set()
        """Closed sessions with blocks still pinned for their consumer (until the lease)."""
        self._admission = Admission(self._env, self._sessions, start=self._start_session,
                                    close=self._close, close_unusable=self._close_unusable)
        self._pauses = PauseDetector(clock, self._control.silence_timeout)
        self._dial_policy = DialPolicy(config.peers)
        self._discovery = (Discovery(config.peers.connect, config.peers.resolve_interval,
                                     self.local_address) if config.peers.connect else None)
        self._kept: frozenset[str] = frozenset()
        """The addresses ``peers.connect`` last resolved to: never reaped for idleness."""
        self._idle = IdleReaper(config.peers.idle_timeout, clock())
        self._closed = False

    def _session_env(self) -> SessionEnv:
        config, data = self._config, self._data
        return SessionEnv(
            data=data, ledger=self._ledger, deadlines=self._deadlines, clock=self._clock,
            observers=self._observers, timeouts=config.timeouts, limits=config.limits,
            flow=config.flow, local=LocalIdentity(
                address=self._control.local_address, epoch=secrets.randbits(64),
                descriptor=data.descriptor(), num_blocks=data.num_blocks,
                block_len=data.block_len, fingerprint=config.fingerprint,
                hash_seed=config.hash_seed,
            ),
            producers=ProducerDirectory(self._ledger, self._deadlines, self._clock,
                                        config.timeouts, self._observers),
        )

    @property
    def local_address(self) -> str:
        """The dialable control address consumers put in ``remote_host``/``remote_port``."""
        return self._env.local.address

    @driver_call
    def connect(self, address: str) -> bool:
        """Connect to the peer at ``address`` (``host:port``, as routing names it) ahead of its
        first request: the dial, the handshake and the data transport's peer setup happen in
        the next ticks, so that request does not wait for them. Non-blocking; a session
        already there is kept. False (and logged) when the address cannot be dialled, or the
        tier is shut down."""
        if self._closed:
            return False
        try:
            peer = format_address(*parse_address(address))
        except ConfigError:  # not host:port (an in-process name): the transport judges it
            peer = address
        return not isinstance(self._session_for(peer), str)

    # -- engine API -------------------------------------------------------------------------

    @driver_call
    def on_new_request(self, ctx: RequestContext) -> bool:
        """Parse routing; a consumer starts connecting to its producer now.

        Returns True when the engine should store *every* block of the request to this tier,
        prefix hits included (producer requests), False for chunk-level (only new blocks).
        """
        routing = self._routing(ctx)
        if self._closed:
            return False
        consumer = routing.consumer
        if consumer is not None:
            session = self._session_for(consumer.peer)
            if isinstance(session, str):
                self._env.failed_loads.mark(consumer.kv_request_id, session)
            else:
                session.consumer.open_request(consumer.kv_request_id)
        if routing.producer is not None:
            self._env.producers.producer_started(routing.producer.kv_request_id)
            return True
        return False

    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """PD consumer: HIT at once. Symmetric consumer: RETRY until the batched probe sent at
        ``on_schedule_end`` is answered, then HIT/MISS. No consumer routing, or a failed
        ``kv_request_id``: MISS."""
        guard = self._guard  # the hot path, once per block: the guard without a wrapper
        outermost = guard.enter("lookup")
        try:
            routing = ctx.routing
            consumer = (routing if isinstance(routing, Routing) else self._routing(ctx)).consumer
            if (consumer is None or self._closed
                    or consumer.kv_request_id in self._env.failed_loads):
                return LookupResult.MISS
            if not consumer.probe:
                return LookupResult.HIT
            session = self._session_for(consumer.peer)
            if isinstance(session, str):
                return LookupResult.MISS
            return session.consumer.probe(consumer.kv_request_id, key)
        finally:
            guard.exit(outermost)

    @driver_call
    def submit_store(self, job: Job) -> None:
        """Offer blocks to the consumer named by the request's producer routing. Non-blocking."""
        admitted = self._admit(job, load=False)
        if admitted is None:
            return
        job, kv, _ = admitted
        producers = self._env.producers
        producers.store_seen(kv)
        role = producers.bound(kv)
        if role is not None:
            self._ledger.set_peer(job.job_id, role.peer)
            role.add_store(kv, job)
        else:
            producers.park(kv, job)

    @driver_call
    def submit_load(self, job: Job) -> None:
        """Load ``job.keys`` from the producer into our slots ``job.block_ids`` (we read them;
        the result, once reported, is final for the slots' bytes)."""
        admitted = self._admit(job, load=True)
        if admitted is None:
            return
        job, kv, peer = admitted
        failed = self._env.failed_loads.get(kv)
        if failed is not None:
            self._ledger.close(job.job_id, Outcome.SUBMIT_FAILED,
                               f"request {kv!r} already failed ({failed}); its loads cannot "
                               f"succeed any more")
            return
        session = self._session_for(peer)
        if isinstance(session, str):
            self._env.failed_loads.mark(kv, f"{Outcome.PEER_DEAD.value}: {session}")
            self._ledger.close(job.job_id, Outcome.PEER_DEAD, session)
            return
        consumer = self._routing(job.ctx).consumer
        session.consumer.submit(job, kv, pull=consumer is not None and consumer.probe)

    @property
    def producer_requests_open(self) -> int:
        """PD producer requests (``remote_decoder`` routing, or stores under a
        ``kv_request_id``) started and not finished yet; cheap, driver thread."""
        return self._env.producers.active_count

    @driver_call
    def get_finished_jobs(self) -> list[JobResult]:
        """Run one tick of I/O and hand over every result produced since the last call."""
        self.tick()
        return self._ledger.take()

    @driver_call
    def tick(self, timeout: float = 0.0) -> None:
        """One tick of control and data I/O: waits for control I/O at most ``timeout``, and
        never past the tier's next deadline (so a long ``timeout`` delays no timer), unless
        :meth:`interrupt` ends the wait."""
        if self._closed:
            return
        pauses = self._pauses
        gap = pauses.gap()
        if gap is not None:
            self._resumed(gap)
        if timeout > 0.0:
            timeout = self._until_due(timeout)
        accepted = self._control.poll(timeout)
        gap = pauses.gap(allowed=timeout)
        if gap is not None:  # stopped inside the poll: what it brought is stale
            self._resumed(gap)
        for conn in accepted:
            self._admission.accept(conn)
        for session in list(self._sessions.values()):
            if session.state is not State.CLOSED:
                self._receive(session)
        self._reap()
        if self._env.congested:
            self._flush()
        if len(self._admission):
            self._admission.serve()
        self._data_tick()
        self._timers(self._clock())
        if self._env.doomed or self._lingering:  # doomed since the pass above: close them now
            self._reap(self._env.doomed)

    def _until_due(self, timeout: float) -> float:
        """``timeout``, cut to the tier's next deadline."""
        due = self._deadlines.next_due()
        return timeout if due is None else min(timeout, max(0.0, due - self._clock()))

    def _timers(self, now: float) -> None:
        """What a tick does by the clock: due deadlines, the warnings' summary line, and
        sessions to the peers ``peers.connect`` names."""
        self._deadlines.fire_due(now)
        self._env.warnings.flush(now)
        if self._discovery is not None:
            wanted = self._discovery.due(now)
            if wanted:
                self._kept = frozenset(wanted)
            for peer in wanted:
                if not self._closed:
                    self._session_for(peer)
        for session in self._idle.due(now, self._sessions.values(), self._kept):
            reason = f"idle for {self._idle.idle_timeout:g}s (peers.idle_timeout)"
            self._close(session, Outcome.PEER_DEAD, reason, bye=reason)

    def interrupt(self) -> None:
        """End a :meth:`tick` that waits for control I/O now (or the next one at once). The
        one method another thread may call while the driver thread is inside the tier: a
        thread that is to drive the tier next calls it before it waits for the driver's
        tick to return. Never blocks; a control transport without ``interrupt`` ends the
        wait at its timeout instead."""
        self._control.interrupt()

    @driver_call
    def on_request_finished(self, ctx: RequestContext) -> None:
        """No more submits for this request; in-flight jobs still get their results."""
        routing = self._routing(ctx)
        consumer, producer = routing.consumer, routing.producer
        if consumer is not None:
            self._env.failed_loads.forget(consumer.kv_request_id)
            session = self._sessions.get(consumer.peer)
            if session is not None:
                session.consumer.finish(consumer.kv_request_id)
        if producer is not None:
            role = self._env.producers.producer_finished(producer.kv_request_id)
            if role is not None:
                role.producer_finished(producer.kv_request_id)

    @driver_call
    def on_schedule_end(self) -> None:
        """Once per engine step: flush batched lookups, report gauges."""
        for session in self._sessions.values():
            if session.ready:
                session.consumer.flush_lookups()
        self._observers.tier_state(
            in_flight_transfers=self._in_flight(),
            parked_stores=self._env.producers.parked_count,
            sessions=len(self._sessions),
        )

    @driver_call
    def serve_lookups(self, source: LocalHitSource) -> None:
        """Answer pending symmetric lookups from ``source`` (valid only during this call)."""
        ends = self._env.lookup_ends
        ends.source_seen = True
        for handle in ends.take():
            try:
                source.end(handle)
            except Exception:
                log.exception("hit source end() failed for a released lookup")
        for session in list(self._sessions.values()):
            if session.ready:
                session.producer.serve(source)

    @driver_call
    def has_pending_work(self) -> bool:
        """True while any job, transfer, parked store, probe, handshake or held newcomer is
        outstanding."""
        if len(self._admission) or self.needs_engine():
            return True
        # no session is working (needs_engine said so): only a handshake can be left
        return any(s.state is not State.READY for s in self._sessions.values())

    @driver_call
    def needs_engine(self) -> bool:
        """True while the tier has work for its engine's calls: a job outstanding or a result
        to hand over, a peer's lookup to answer or end, a round or a pin open, a probe of
        ours in flight. Unlike :meth:`has_pending_work`, a handshake or a held newcomer does
        not count: a thread that only ticks the tier completes those alone (vLLM's adapter
        lets its engine sleep through them, docs/vllm.md "Idle sources")."""
        if self._ledger.pending or self._ledger.undelivered or len(self._env.lookup_ends):
            return True
        return any(s.working for s in self._sessions.values())

    @driver_call
    def drain_jobs(self, timeout: float | None = None) -> None:
        """Tick until every submitted job has a result (never aborts anything)."""
        t = self._config.timeouts
        budget = timeout if timeout is not None else (
            max(t.lease, t.store, t.unbound_store) + t.shutdown_drain
        )
        start, wall = self._clock(), time.monotonic()
        warned = False
        while self._ledger.pending and not self._closed:
            self.tick(0.001)
            elapsed = max(self._clock() - start, time.monotonic() - wall)
            if elapsed >= budget:
                log.warning("drain_jobs: %d job(s) still pending after %.1fs; returning",
                            self._ledger.pending, elapsed)
                return
            if not warned and elapsed >= _DRAIN_WARN_S:
                warned = True
                log.warning("drain_jobs: still waiting for %d job(s) after %.0fs",
                            self._ledger.pending, elapsed)

    @driver_call
    def shutdown(self) -> list[JobResult]:
        """Wind every session down, close them, close transports; bounded by
        ``timeouts.shutdown_drain`` (docs/protocol.md §10).

        Winding down fails our loads at once (their reads cancelled: nothing can land after)
        and fails the peers' rounds; blocks a consumer may be reading stay pinned until it
        releases them or the budget is spent. Then ``bye`` is said and the region
        deregistered. Returns the results not yet handed over (every job gets exactly one)."""
        if self._closed:
            return self._ledger.take()
        if self._discovery is not None:
            self._discovery.close(_DISCOVERY_JOIN)
        self._wind_down()
        self._drain_sessions()
        self._close_sessions()
        self._close_transports()
        return self._ledger.take()

    def _wind_down(self) -> None:
        """Shutdown step 1-2: refuse connections, fail parked stores, wind sessions down."""
        self._admission.stop()
        self._env.producers.fail_parked(Outcome.SHUTDOWN, "tier shut down")
        for session in self._sessions.values():
            session.wind_down()

    def _drain_sessions(self) -> None:
        """Shutdown step 3: tick until every session is wound down or the budget is spent."""
        drain = self._config.timeouts.shutdown_drain
        start, wall = self._clock(), time.monotonic()
        while (any(not s.wound_down for s in self._sessions.values())
               and max(self._clock() - start, time.monotonic() - wall) < drain):
            self.tick(0.001)

    def _close_sessions(self) -> None:
        """Shutdown step 4: close every session, drop the pins still held, answer every job."""
        for session in list(self._sessions.values()):
            self._close(session, Outcome.SHUTDOWN, "shutdown", bye="shutdown")
        for session in list(self._lingering):
            pinned = session.producer.drop_pins(Outcome.SHUTDOWN, "tier shut down")
            log.warning("shutdown: %d block(s) pinned for %s released before its lease ended",
                        pinned, session.peer)
        self._lingering.clear()
        self._closed = True
        for job_id in self._ledger.open_ids():  # safety net: nothing may stay unanswered
            self._ledger.close(job_id, Outcome.SHUTDOWN, "tier shut down")

    def _close_transports(self) -> None:
        """Shutdown step 5."""
        owed = len(self._env.lookup_ends.take())
        if owed:
            log.info("shutdown: %d lookup handle(s) were never released (no serve_lookups call)",
                     owed)
        self._control.close()
        self._pauses.close()
        undrained = self._data.close()
        if undrained:
            log.error("shutdown: data transport kept its region registered; %d transfer(s) "
                      "never drained: %s", len(undrained), undrained[:16])

    @driver_call
    def stats(self) -> dict[str, int]:
        """Counters and gauges (jobs by outcome, bytes, sessions, in-flight transfers, what
        the data transport still holds for removed peers and its calls over the driver bound,
        slow ticks, and ``descriptors_posted`` when the data transport counts them)."""
        c = self._env.counters
        out = {f"jobs_{o.value}": n for o, n in self._ledger.outcomes.items()}
        out.update(
            jobs_pending=self._ledger.pending,
            sessions=len(self._sessions),
            sessions_ready=sum(1 for s in self._sessions.values() if s.ready),
            sessions_closing=len(self._lingering),
            in_flight_transfers=self._in_flight(),
            parked_stores=self._env.producers.parked_count,
            loads_queued=sum(s.consumer.window.waiting for s in self._sessions.values()),
            frames_delayed=c["frames_delayed"],
            reads_waiting=self._env.reads.waiting,
            blocks_sent=c["blocks_sent"],
            bytes_sent=c["blocks_sent"] * self._block_len,
            blocks_read=c["blocks_read"],
            bytes_read=c["blocks_read"] * self._block_len,
            transfers_failed=c["transfers_failed"],
            submit_failures=c["submit_failures"],
            protocol_errors=c["protocol_errors"],
            handshake_rejections=c["handshake_rejections"],
            peers_refused=self._dial_policy.refused,
            peers_evicted=self._dial_policy.evicted,
            peers_reaped=self._idle.reaped,
            data_held=sum(self._data.held().values()),
            data_calls_over_bound=self._call_guard.overruns,
            slow_ticks=self._pauses.slow_ticks,
        )
        if self._data.descriptors_posted is not None:
            out["descriptors_posted"] = self._data.descriptors_posted
        return out

    @driver_call
    def peer_connection(self, peer: str) -> ControlConnection | None:
        """The control connection of the live session with ``peer`` (``host:port``), or None.

        A debug view for the conformance kit and tests, which close it to inject a dead
        connection: the tier keeps ownership, and a close is handled exactly as the transport
        reporting that connection dead. Never a decision input for production code."""
        session = self._sessions.get(peer)
        return None if session is None else session.conn

    @driver_call
    def state_sizes(self) -> dict[str, int]:
        """The size of every per-request structure, by name (sessions, rounds, supply, demand,
        pins, timers, held frames, ...): a read-only debug view. All are zero once the tier is
        quiescent (no job outstanding, nothing in flight); the conformance kit and the leak
        tests assert exactly that, and name the structure that kept something."""
        sizes: dict[str, int] = dict.fromkeys(
            ("consumer_requests", "consumer_rounds", "reads", "queued_rounds", "lookups",
             "probes", "producer_requests", "producer_rounds", "producer_jobs", "supply",
             "demand", "pins", "serves"), 0)
        for session in [*self._sessions.values(), *self._lingering]:
            for k, v in session.state_sizes().items():
                sizes[k] += v
        env = self._env
        sizes.update(env.producers.state_sizes())
        sizes.update(
            failed_ids=len(env.failed_loads), deferred_ends=len(env.lookup_ends),
            jobs_open=self._ledger.pending, results_waiting=self._ledger.undelivered,
            owners=len(env.owners), timers=len(self._deadlines),
            sessions_lingering=len(self._lingering), newcomers=len(self._admission),
            reads_waiting=env.reads.waiting, frames_held=sum(len(s.outbox) for s in
                                                            env.congested),
        )
        return sizes

    # -- internals --------------------------------------------------------------------------

    def _routing(self, ctx: RequestContext) -> Routing:
        routing = ctx.routing
        if not isinstance(routing, Routing):
            routing = ctx.routing = parse_routing(
                ctx.kv_transfer_params,
                max_request_id_chars=self._config.limits.max_request_id_chars,
                req_id=ctx.req_id,
            )
        return routing

    def _admit(self, job: Job, *, load: bool) -> tuple[Job, str, str] | None:
        return self._intake.admit(job, self._routing(job.ctx), load=load, closed=self._closed)

    def _session_for(self, peer: str) -> Session | str:
        """The usable session to ``peer``, connecting if needed; why not, if we cannot dial
        it."""
        session = self._sessions.get(peer)
        if session is not None:
            if session.usable:
                session.last_active = self._clock()
                return session
            self._close_unusable(session)
        if peer in self._admission:
            return self._admission.promote(peer)
        why = self._dial_policy.admit(peer, len(self._sessions), self._dialed, self._evict)
        if why is not None:
            self._env.warnings.log(self._clock(), logging.WARNING, "not dialing %s: %s", peer,
                                   why)
            return f"not dialing {peer}: {why}"
        try:
            conn = self._control.connect(peer)
        except Exception as exc:
            why = f"cannot connect to {peer}: {exc}"
            self._env.warnings.log(self._clock(), logging.WARNING, "%s", why)
            return why
        return self._new_session(peer, conn, dialed=True)

    def _dialed(self) -> list[tuple[str, bool]]:
        """The sessions this tier dialed, oldest first, as (peer, ready)."""
        return [(other, s.ready) for other, s in self._sessions.items() if s.dialed]

    def _evict(self, peer: str, reason: str) -> None:
        self._close(self._sessions[peer], Outcome.PEER_DEAD, reason)

    def _close_unusable(self, session: Session) -> None:
        doom = session.doomed
        if doom is not None:
            self._close(session, doom.outcome, doom.reason, bye=doom.bye)
        else:
            why = session.conn.close_reason
            self._close(session, Outcome.PEER_DEAD, f"connection to {session.peer} failed: {why}"
                        if why else f"connection to {session.peer} lost")

    def _new_session(self, peer: str, conn: ControlConnection, *,
                     dialed: bool = False) -> Session:
        session = Session(self._env, peer, conn, dialed=dialed)
        self._sessions[peer] = session
        session.start()
        return session

    def _start_session(self, peer: str, conn: ControlConnection,
                       frames: list[bytes] | None) -> Session:
        """A session on an admitted connection, fed the frames it sent while held."""
        session = self._new_session(peer, conn)
        if frames is not None:
            self._receive(session, frames)
        return session

    def _receive(self, session: Session, frames: list[bytes] | None = None) -> None:
        """Hand ``session`` its frames (``frames``, else what its connection holds); a peer
        restart found among them moves the rest to a fresh session."""
        rest = session.receive(frames)
        while rest is not None:
            session = self._restart(session, rest)
            rest = session.receive(rest)

    def _restart(self, old: Session, frames: list[bytes]) -> Session:
        """``old``'s peer restarted (new epoch): fail the old incarnation, start afresh on the
        same connection."""
        log.warning("peer %s restarted (new session epoch); failing its old work", old.peer)
        self._close(old, Outcome.PEER_DEAD, f"{old.peer} restarted", close_conn=False)
        return self._new_session(old.peer, old.conn, dialed=old.dialed)

    def _reap(self, doomed: Sequence[PendingSession] | None = None) -> None:
        """Close the sessions doomed or with a dead connection (of ``doomed`` only, if given);
        drop lingering sessions with no pins left."""
        env = self._env
        candidates = list(self._sessions.values()) if doomed is None else doomed
        env.doomed = []
        for candidate in candidates:
            session = self._sessions.get(candidate.peer)
            if (session is not None and session is candidate
                    and (session.doomed is not None or not session.conn.alive)):
                self._close_unusable(session)
        if self._lingering:
            self._lingering = {s for s in self._lingering if s.producer.n_pins}

    def _close(self, session: Session, outcome: Outcome, reason: str, *,
               bye: str | None = None, close_conn: bool = True) -> None:
        """Close ``session`` (its reads end, finally), remove its data peer, and keep it
        lingering while blocks stay pinned for its consumer."""
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]
        session.close(outcome, reason, bye=bye, close_conn=close_conn)
        if session.producer.n_pins:
            self._lingering.add(session)
        self._release_data_peer(session)

    def _release_data_peer(self, session: Session) -> None:
        """Remove the data peer if ``session`` registered it (a newer session of the same
        address that re-registered it owns it now)."""
        peer = session.peer
        if self._closed or not self._env.data_peers.release(peer, session):
            return
        self._env.flush_control()  # a bye queued for the peer leaves before the drain
        undrained = self._data.remove_peer(peer)
        if undrained:
            log.warning("data peer %s removed with %d internal transfer(s) undrained: %s",
                        peer, len(undrained), undrained[:16])

    def _data_tick(self) -> None:
        data = self._data
        data.progress()
        env = self._env
        if env.owners:
            for session in [s for s in self._sessions.values() if s.consumer.reads]:
                done, failed = data.poll(session.peer)
                if done or failed:
                    self._route(done, failed)
        env.reads.pump()

    def _flush(self) -> None:
        """Send what sessions hold behind full send queues (back-pressure, in order)."""
        congested = self._env.congested
        for session in list(congested):
            if session.flush():
                congested.discard(session)

    def _resumed(self, gap: float) -> None:
        """This process was paused longer than its peers tolerate silence
        (:mod:`p2pkv.session.pause`): they have dropped its sessions, so close them now
        (loads end at once, reads cancelled first; new requests dial afresh)."""
        limit = self._pauses.limit
        if self._sessions:
            log.warning("this tier was not ticked for %.1fs (process paused?), longer than the "
                        "control transport's silence timeout %gs: closing its %d session(s), "
                        "which its peers have dropped", gap, limit, len(self._sessions))
        for session in list(self._sessions.values()):
            self._close(session, Outcome.PEER_DEAD,
                        f"this process was paused {gap:.1f}s (no tick), longer than the "
                        f"control transport's silence timeout {limit:g}s: {session.peer} has "
                        f"dropped the session", bye="paused past the silence timeout")

    def _route(self, done: Sequence[int], failed: Sequence[int]) -> None:
        """Hand terminal read ids to the sessions that posted them."""
        owners = self._env.owners
        for ok, tids in ((True, done), (False, failed)):
            for tid in tids:
                owner = owners.pop(tid, None)
                if owner is not None:
                    owner.on_data(tid, ok)

    def _in_flight(self) -> int:
        return sum(len(s.consumer.reads) for s in self._sessions.values())


def _data_transport(reg: Registry, config: TierConfig, region: memoryview, block_len: int,
                    data: DataTransport | None) -> DataTransport:
    """``data`` if given (its region must be the tier's), else one built over ``region``."""
    if data is None:
        built: DataTransport = reg.transport("data", config.data).create(
            DataSettings(region, block_len, config.data_options)
        )
        return built
    nbytes = memoryview(region).nbytes
    if data.block_len != block_len or data.num_blocks * block_len != nbytes:
        raise ConfigError(f"data transport region is {data.num_blocks}x{data.block_len}, the "
                          f"tier's is {nbytes} bytes in blocks of {block_len}")
    return data


def _control_transport(reg: Registry, config: TierConfig) -> ControlTransport:
    control: ControlTransport = reg.transport("control", config.control).create(ControlSettings(
        config.host, config.port, max_frame_bytes=config.limits.max_frame_bytes,
        options=config.control_options, dp_rank=config.dp_rank,
        handshake_timeout=config.timeouts.handshake,
        host_setting=config.host_setting, port_setting=config.port_setting,
    ))
    return control
