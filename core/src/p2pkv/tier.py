"""``P2PTier``: the engine-facing manager of the P2P KV tier (DESIGN §5).

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
import operator
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from p2pkv.config import TierConfig
from p2pkv.contracts import (
    ControlConnection,
    ControlSettings,
    ControlTransport,
    DataSettings,
    DataTransport,
)
from p2pkv.driver import DriverGuard, driver_call
from p2pkv.errors import ConfigError, ProtocolError
from p2pkv.protocol import Hello, decode
from p2pkv.registry import Registry, default_registry
from p2pkv.routing import ConsumerRoute, Routing, parse_routing
from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.directory import Directory
from p2pkv.session.env import LocalIdentity, SessionEnv
from p2pkv.session.ledger import JobLedger
from p2pkv.session.session import Session, State
from p2pkv.types import Job, JobResult, LookupResult, Outcome, RequestContext

__all__ = ["LocalHitSource", "P2PTier"]

log = logging.getLogger(__name__)

_DRAIN_WARN_S = 5.0
_INT_TYPES = frozenset({int})
_NEWCOMER_MAX_FRAMES = 4
"""Frames a held newcomer may send: a conforming peer sends its hello and waits for ours."""


class LocalHitSource(Protocol):
    """What a producer consults to answer a symmetric consumer's lookup (engine-supplied).

    Valid only during the ``P2PTier.serve_lookups`` call it is passed to. Order per remote
    request: ``begin`` -> ``lookup``* -> ``pin``* -> ``end`` (always, even with no hits).
    """

    def begin(self, kv_request_id: str) -> object:
        """Start serving a remote request; returns an opaque handle."""
        ...

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        """HIT (present and ready), MISS, or RETRY (ask again next step)."""
        ...

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        """Pin the slots of HIT keys and return a store job over them; its result is reported
        through ``get_finished_jobs`` like any store job."""
        ...

    def end(self, handle: object) -> None:
        """The remote request is over; release what ``begin`` took."""
        ...



class _Newcomer:
    """A new inbound connection claiming the address of a live session, held unserved."""

    __slots__ = ("conn", "frames", "timer")

    def __init__(self, conn: ControlConnection, timer: Timer) -> None:
        self.conn = conn
        self.frames: list[bytes] = []
        self.timer = timer


class P2PTier:
    """One peer's P2P tier over a control and a data transport chosen by name.

    ``region`` is the engine's KV region (1-D writable bytes, ``num_blocks * block_len``);
    block ids in jobs are slot indexes into it. ``clock`` is injected so timeout tests never
    sleep. ``control``/``data`` may be given pre-built (tests, fault injection); otherwise
    they are built from ``config`` through ``registry``.
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
        if isinstance(block_len, bool) or not isinstance(block_len, int) or block_len <= 0:
            raise ConfigError(f"block_len must be a positive integer, got {block_len!r}")
        if not isinstance(region, memoryview):
            raise ConfigError(f"region must be a memoryview, got {type(region).__name__}")
        if region.nbytes == 0 or region.nbytes % block_len:
            raise ConfigError(
                f"region of {region.nbytes} bytes is not a positive multiple of "
                f"block_len {block_len}"
            )
        self._guard = DriverGuard("P2PTier")
        self._config = config
        self._clock = clock
        self._num_blocks = region.nbytes // block_len
        self._block_len = block_len
        reg = registry if registry is not None else default_registry()
        built_data = data is None
        if data is None:
            data = reg.transport("data", config.data).create(
                DataSettings(region, block_len, config.data_options)
            )
        try:
            if data.block_len != block_len or data.num_blocks != self._num_blocks:
                raise ConfigError(
                    f"data transport region is {data.num_blocks}x{data.block_len}, the tier's "
                    f"is {self._num_blocks}x{block_len}"
                )
            if control is None:
                control = reg.transport("control", config.control).create(ControlSettings(
                    config.host, config.port, max_frame_bytes=config.limits.max_frame_bytes,
                    options=config.control_options, dp_rank=config.dp_rank,
                    handshake_timeout=config.timeouts.handshake,
                    host_setting=config.host_setting, port_setting=config.port_setting,
                ))
        except BaseException:
            if built_data:
                data.close()
            raise
        self._control: ControlTransport = control
        self._data: DataTransport = data
        observers = reg.observers
        self._observers = observers
        self._deadlines = Deadlines()
        self._ledger = JobLedger(clock, observers)
        self._dir = Directory(self._ledger, self._deadlines, clock, config.timeouts, observers)
        self._env = SessionEnv(
            data=data, ledger=self._ledger, deadlines=self._deadlines, clock=clock,
            observers=observers, timeouts=config.timeouts, limits=config.limits,
            local=LocalIdentity(
                address=control.local_address, epoch=secrets.randbits(64),
                descriptor=data.descriptor(), num_blocks=self._num_blocks, block_len=block_len,
                fingerprint=config.fingerprint, hash_seed=config.hash_seed,
            ),
            host=self._dir,
        )
        self._sessions: dict[str, Session] = {}
        self._lingering: set[Session] = set()
        """Closed sessions with blocks still pinned for their consumer (until the lease)."""
        self._newcomers: dict[str, _Newcomer] = {}
        """New connections claiming a live session's address, by address (§4.1 item 6)."""
        self._stopping = False
        self._closed = False

    @property
    def local_address(self) -> str:
        """The dialable control address consumers put in ``remote_host``/``remote_port``."""
        return self._env.local.address

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
                self._dir.mark_failed(consumer.kv_request_id, session)
            else:
                session.client.open_request(consumer.kv_request_id)
        if routing.producer is not None:
            self._dir.producer_started(routing.producer.kv_request_id)
            return True
        return False

    @driver_call
    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """PD consumer: HIT at once. Symmetric consumer: RETRY until the batched probe sent at
        ``on_schedule_end`` is answered, then HIT/MISS. No consumer routing, or a failed
        ``kv_request_id``: MISS."""
        consumer = self._routing(ctx).consumer
        if consumer is None or self._closed or consumer.kv_request_id in self._dir.failed:
            return LookupResult.MISS
        if not consumer.probe:
            return LookupResult.HIT
        session = self._session_for(consumer.peer)
        if isinstance(session, str):
            return LookupResult.MISS
        return session.client.probe(consumer.kv_request_id, key)

    @driver_call
    def submit_store(self, job: Job) -> None:
        """Offer blocks to the consumer named by the request's producer routing. Non-blocking."""
        admitted = self._admit(job, load=False)
        if admitted is None:
            return
        job, kv, _ = admitted
        d = self._dir
        if kv not in d.producers and kv not in d.tombstones:
            d.producer_started(kv)
        session = d.bindings.get(kv)
        if session is not None:
            self._ledger.set_peer(job.job_id, session.peer)
            session.server.add_store(kv, job)
        else:
            d.park(kv, job)

    @driver_call
    def submit_load(self, job: Job) -> None:
        """Load ``job.keys`` from the producer into our slots ``job.block_ids`` (we read them;
        the result, once reported, is final for the slots' bytes)."""
        admitted = self._admit(job, load=True)
        if admitted is None:
            return
        job, kv, peer = admitted
        failed = self._dir.failed.get(kv)
        if failed is not None:
            self._ledger.close(job.job_id, Outcome.SUBMIT_FAILED,
                               f"request {kv!r} already failed ({failed}); its loads cannot "
                               f"succeed any more")
            return
        session = self._session_for(peer)
        if isinstance(session, str):
            self._dir.mark_failed(kv, f"{Outcome.PEER_DEAD.value}: {session}")
            self._ledger.close(job.job_id, Outcome.PEER_DEAD, session)
            return
        session.client.submit(job, kv)

    @driver_call
    def get_finished_jobs(self) -> list[JobResult]:
        """Run one tick of I/O and hand over every result produced since the last call."""
        self.tick()
        return self._ledger.take()

    @driver_call
    def tick(self, timeout: float = 0.0) -> None:
        """One tick of control and data I/O (waits at most ``timeout`` for control I/O)."""
        if self._closed:
            return
        for conn in self._control.poll(timeout):
            self._accept(conn)
        for session in list(self._sessions.values()):
            if session.state is State.HANDSHAKE or session.state is State.READY:
                self._receive(session)
        self._reap()
        if self._newcomers:
            self._serve_newcomers()
        self._data_tick()
        self._deadlines.fire_due(self._clock())
        self._reap()

    @driver_call
    def on_request_finished(self, ctx: RequestContext) -> None:
        """No more submits for this request; in-flight jobs still get their results."""
        routing = self._routing(ctx)
        consumer, producer = routing.consumer, routing.producer
        if consumer is not None:
            self._dir.failed.pop(consumer.kv_request_id, None)
            session = self._sessions.get(consumer.peer)
            if session is not None:
                session.client.finish(consumer.kv_request_id)
        if producer is not None:
            session = self._dir.producer_finished(producer.kv_request_id)
            if session is not None:
                session.server.producer_finished(producer.kv_request_id)

    @driver_call
    def on_schedule_end(self) -> None:
        """Once per engine step: flush batched lookups, report gauges."""
        for session in self._sessions.values():
            if session.ready:
                session.client.flush_lookups()
        if self._observers.enabled:
            self._observers.tier_state(
                in_flight_transfers=self._in_flight(), parked_stores=self._dir.parked_count,
                sessions=len(self._sessions),
            )

    @driver_call
    def serve_lookups(self, source: LocalHitSource) -> None:
        """Answer pending symmetric lookups from ``source`` (valid only during this call)."""
        self._dir.source_seen = True
        for handle in self._dir.take_ends():
            try:
                source.end(handle)
            except Exception:
                log.exception("hit source end() failed for a released lookup")
        for session in list(self._sessions.values()):
            if session.ready:
                session.server.serve(source)

    @driver_call
    def has_pending_work(self) -> bool:
        """True while any job, transfer, parked store, probe, handshake or held newcomer is
        outstanding."""
        if (self._ledger.pending or self._ledger.undelivered or self._dir.ends
                or self._newcomers):
            return True
        return any(s.busy for s in self._sessions.values())

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
        drain = self._config.timeouts.shutdown_drain
        start, wall = self._clock(), time.monotonic()

        def expired() -> bool:
            return max(self._clock() - start, time.monotonic() - wall) >= drain

        self._stopping = True
        self._drop_newcomers()
        self._dir.fail_parked(Outcome.SHUTDOWN, "tier shut down")
        for session in self._sessions.values():
            session.wind_down()
        while any(not s.wound_down for s in self._sessions.values()) and not expired():
            self.tick(0.001)
        for session in list(self._sessions.values()):
            self._close(session, Outcome.SHUTDOWN, "shutdown", bye="shutdown")
        for session in list(self._lingering):
            pinned = session.server.drop_pins(Outcome.SHUTDOWN, "tier shut down")
            log.warning("shutdown: %d block(s) pinned for %s released before its lease ended",
                        pinned, session.peer)
        self._lingering.clear()
        self._closed = True
        for job_id in self._ledger.open_ids():  # safety net: nothing may stay unanswered
            self._ledger.close(job_id, Outcome.SHUTDOWN, "tier shut down")
        if self._dir.ends:
            log.info("shutdown: %d lookup handle(s) were never released (no serve_lookups call)",
                     len(self._dir.take_ends()))
        self._control.close()
        undrained = self._data.close()
        if undrained:
            log.error("shutdown: data transport kept its region registered; %d transfer(s) "
                      "never drained: %s", len(undrained), undrained[:16])
        return self._ledger.take()

    @driver_call
    def stats(self) -> dict[str, int]:
        """Counters and gauges (jobs by outcome, bytes, sessions, in-flight transfers)."""
        c = self._env.counters
        out = {f"jobs_{o.value}": n for o, n in self._ledger.outcomes.items()}
        out.update(
            jobs_pending=self._ledger.pending,
            sessions=len(self._sessions),
            sessions_ready=sum(1 for s in self._sessions.values() if s.ready),
            sessions_closing=len(self._lingering),
            in_flight_transfers=self._in_flight(),
            parked_stores=self._dir.parked_count,
            blocks_sent=c["blocks_sent"],
            bytes_sent=c["blocks_sent"] * self._block_len,
            blocks_read=c["blocks_read"],
            bytes_read=c["blocks_read"] * self._block_len,
            transfers_failed=c["transfers_failed"],
            submit_failures=c["submit_failures"],
            protocol_errors=c["protocol_errors"],
            handshake_rejections=c["handshake_rejections"],
        )
        return out

    # -- internals --------------------------------------------------------------------------

    def _state_sizes(self) -> dict[str, int]:
        """Every per-request structure's size (tests assert all zero once quiescent)."""
        sizes: dict[str, int] = dict.fromkeys(
            ("client_requests", "client_rounds", "reads", "lookups", "probes",
             "server_requests", "server_rounds", "server_jobs", "supply", "demand",
             "pins", "serves"), 0)
        for session in [*self._sessions.values(), *self._lingering]:
            for k, v in session.state_sizes().items():
                sizes[k] += v
        sizes.update(self._dir.state_sizes())
        sizes.update(
            jobs_open=self._ledger.pending, results_waiting=self._ledger.undelivered,
            owners=len(self._env.owners), timers=len(self._deadlines),
            sessions_lingering=len(self._lingering), newcomers=len(self._newcomers),
        )
        return sizes

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
        """Validate and record a submitted job: (normalised job, kv_request_id, peer), or None
        when it got its result at once (no route, nothing to move, shut down)."""
        if job.is_load is not load:
            want = "submit_load needs a load" if load else "submit_store needs a store"
            raise ValueError(f"job {job.job_id}: {want} job (is_load={load})")
        routing = self._routing(job.ctx)
        route = routing.consumer if load else routing.producer
        if self._refuse(job, routing, route is None):
            return None
        assert route is not None
        checked = self._checked(job, load=load)
        peer = route.peer if isinstance(route, ConsumerRoute) else ""
        self._ledger.open(job.job_id, load, route.kv_request_id, peer)
        if isinstance(checked, str):
            log.warning("job %d of %r failed: %s", job.job_id, route.kv_request_id, checked)
            self._ledger.close(job.job_id, Outcome.SUBMIT_FAILED, checked)
            return None
        return checked, route.kv_request_id, peer

    def _refuse(self, job: Job, routing: Routing, no_route: bool) -> bool:
        """Answer jobs that cannot go anywhere at once; True if ``job`` got its result."""
        if self._closed:
            outcome, detail = Outcome.SHUTDOWN, "tier shut down"
        elif routing.invalid:
            outcome, detail = Outcome.NO_ROUTE, routing.error
        elif no_route:
            if job.is_load:
                outcome, detail = Outcome.NO_ROUTE, "request has no consumer routing"
            else:
                outcome, detail = Outcome.NOTHING_TO_DO, "request has no producer routing"
        elif not len(job.keys):
            outcome, detail = Outcome.NOTHING_TO_DO, "no blocks"
        else:
            return False
        self._ledger.open(job.job_id, job.is_load)
        self._ledger.close(job.job_id, outcome, detail)
        return True

    def _checked(self, job: Job, *, load: bool) -> Job | str:
        """Validate a job from the engine: a normalised copy (block ids as a list of ints), or
        why it exceeds the configured ``limits`` (the job then fails; the engine goes on).

        A malformed job (an engine bug: mismatched lengths, a slot outside the region, keys
        that are not bytes, duplicates in one load) raises ``ValueError`` and records nothing.
        """
        keys, ids = job.keys, job.block_ids
        if len(keys) != len(ids):
            raise ValueError(f"job {job.job_id}: {len(keys)} keys but {len(ids)} block ids")
        slots = _slot_list(job.job_id, ids, self._num_blocks)
        cap = self._config.limits.max_key_bytes
        if set(map(type, keys)) != {bytes}:
            bad_key = next(k for k in keys if type(k) is not bytes)
            raise ValueError(f"job {job.job_id}: keys must be bytes, got {bad_key!r:.60}")
        lens = list(map(len, keys))
        if min(lens) < 1 or max(lens) > cap:
            raise ValueError(f"job {job.job_id}: keys must be 1..{cap} bytes long")
        if load:
            if len(set(keys)) != len(keys):
                raise ValueError(f"job {job.job_id}: duplicate keys in one load")
            if len(set(slots)) != len(slots):
                raise ValueError(f"job {job.job_id}: duplicate block ids in one load")
        over = self._over_limits(lens, load=load)
        if over:
            return over
        key_list = keys if type(keys) is list else list(keys)
        return Job(job.job_id, key_list, slots, job.is_load, job.ctx)

    def _over_limits(self, key_lens: list[int], *, load: bool) -> str:
        """Why a job whose keys have lengths ``key_lens`` cannot travel under the configured
        limits, or ``""``."""
        limits = self._config.limits
        nkeys = len(key_lens)
        if nkeys > limits.max_keys_per_message:
            return (f"{nkeys} blocks exceed limits.max_keys_per_message="
                    f"{limits.max_keys_per_message}; raise it to at least {nkeys} (on both "
                    f"peers) or use larger blocks")
        if load and sum(key_lens) + 16 * nkeys + 512 > limits.max_frame_bytes:
            return (f"a fetch for {nkeys} blocks would exceed limits.max_frame_bytes="
                    f"{limits.max_frame_bytes}; raise it (on both peers)")
        return ""

    def _session_for(self, peer: str) -> Session | str:
        """The usable session to ``peer``, connecting if needed; why not, if we cannot dial
        it."""
        session = self._sessions.get(peer)
        if session is not None:
            if session.usable:
                return session
            self._close_unusable(session)
        if peer in self._newcomers:
            return self._promote(peer)
        try:
            conn = self._control.connect(peer)
        except Exception as exc:
            why = f"cannot connect to {peer}: {exc}"
            log.warning("%s", why)
            return why
        return self._new_session(peer, conn)

    def _close_unusable(self, session: Session) -> None:
        doom = session.doomed
        if doom is not None:
            self._close(session, doom.outcome, doom.reason, bye=doom.bye)
        else:
            why = session.conn.close_reason
            self._close(session, Outcome.PEER_DEAD, f"connection to {session.peer} failed: {why}"
                        if why else f"connection to {session.peer} lost")

    def _new_session(self, peer: str, conn: ControlConnection) -> Session:
        session = Session(self._env, peer, conn)
        self._sessions[peer] = session
        session.start()
        return session

    def _receive(self, session: Session, frames: list[bytes] | None = None) -> None:
        """Hand ``session`` its frames (``frames``, else what its connection holds); a peer
        restart found among them moves the rest to a fresh session."""
        rest = session.receive(frames)
        while rest is not None:
            session = self._restart(session, rest)
            rest = session.receive(rest)

    def _accept(self, conn: ControlConnection) -> None:
        """A new inbound connection. One claiming the address of a usable session does not
        replace it (anyone reaching the port could claim any address): it is held, unserved,
        until that session's connection ends -- a restarted peer's old connection ends by
        itself -- or ``timeouts.handshake`` passes (docs/protocol.md §4.1 item 6)."""
        peer = conn.peer_address
        if self._stopping:
            conn.close()
            return
        old = self._sessions.get(peer)
        if old is not None:
            if old.conn is conn:
                return
            if old.usable:
                self._hold(peer, conn)
                return
            self._close_unusable(old)
        self._new_session(peer, conn)

    def _hold(self, peer: str, conn: ControlConnection) -> None:
        previous = self._newcomers.pop(peer, None)
        if previous is not None:
            self._drop_newcomer(peer, previous, "a newer connection claims the same address")
        wait = self._config.timeouts.handshake
        log.warning("a new connection claims the address of live peer %s; it is held until "
                    "that peer's connection ends (at most %.1fs)", peer, wait)
        timer = self._deadlines.at(self._clock() + wait, self._newcomer_expired, peer)
        self._newcomers[peer] = _Newcomer(conn, timer)

    def _serve_newcomers(self) -> None:
        """Read held newcomers (a few frames at most) and start the session of each whose
        address has no usable session any more."""
        for peer, newcomer in list(self._newcomers.items()):
            conn = newcomer.conn
            if not conn.alive:
                self._drop_newcomer(peer, newcomer, "its connection ended", level=logging.INFO)
                continue
            newcomer.frames += conn.recv()
            if len(newcomer.frames) > _NEWCOMER_MAX_FRAMES:
                self._drop_newcomer(peer, newcomer, f"it sent {len(newcomer.frames)} frames "
                                    "before its session could start")
                continue
            old = self._sessions.get(peer)
            if old is not None and old.usable and self._redials(old, newcomer.frames):
                self._close(old, Outcome.PEER_DEAD,
                            f"{peer} dialled again with the same epoch: it had given this "
                            f"session up (paused or cut off for longer than its timeouts?)")
            if old is None or not old.usable:
                self._promote(peer)

    def _redials(self, old: Session, frames: list[bytes]) -> bool:
        """The held newcomer is ``old``'s peer itself, re-dialling: its hello carries the
        epoch of ``old``'s peer. A tier keeps one session per peer, so that peer has given
        ``old`` up (it paused or was cut off past a timeout and resumed, while our side of
        the connection still looks alive). The 64-bit epoch is random per incarnation and
        sent only to its peer (under CURVE, encrypted): a claimant that is not that peer
        cannot show it."""
        known = old.peer_hello
        if known is None or not frames:
            return False
        try:
            hello = decode(frames[0], self._config.limits)
        except ProtocolError:
            return False  # its session will say why, if it ever starts
        return isinstance(hello, Hello) and hello.epoch == known.epoch

    def _promote(self, peer: str) -> Session:
        """Start the held newcomer's session, the old one (unusable or gone) closed first."""
        newcomer = self._newcomers.pop(peer)
        self._deadlines.cancel(newcomer.timer)
        old = self._sessions.get(peer)
        if old is not None:
            self._close_unusable(old)
        log.info("the held connection from %s takes over: its previous connection ended", peer)
        session = self._new_session(peer, newcomer.conn)
        self._receive(session, newcomer.frames)
        return session

    def _newcomer_expired(self, peer: str) -> None:
        wait = self._config.timeouts.handshake
        self._drop_newcomer(peer, self._newcomers[peer], "the live session with that address "
                            f"did not end within {wait}s (an impostor?)")

    def _drop_newcomer(self, peer: str, newcomer: _Newcomer, why: str, *,
                       level: int = logging.WARNING) -> None:
        self._newcomers.pop(peer, None)
        self._deadlines.cancel(newcomer.timer)
        newcomer.conn.close()
        log.log(level, "closed a held connection claiming address %s: %s", peer, why)

    def _drop_newcomers(self) -> None:
        for peer, newcomer in list(self._newcomers.items()):
            self._drop_newcomer(peer, newcomer, "tier shut down", level=logging.INFO)

    def _restart(self, old: Session, frames: list[bytes]) -> Session:
        """``old``'s peer restarted (new epoch): fail the old incarnation, start afresh on the
        same connection."""
        log.warning("peer %s restarted (new session epoch); failing its old work", old.peer)
        self._close(old, Outcome.PEER_DEAD, f"{old.peer} restarted", close_conn=False)
        return self._new_session(old.peer, old.conn)

    def _reap(self) -> None:
        for session in list(self._sessions.values()):
            if session.doomed is not None or not session.conn.alive:
                self._close_unusable(session)
        if self._lingering:
            self._lingering = {s for s in self._lingering if s.server.n_pins}

    def _close(self, session: Session, outcome: Outcome, reason: str, *,
               bye: str | None = None, close_conn: bool = True) -> None:
        """Close ``session`` (its reads end, finally), remove its data peer, and keep it
        lingering while blocks stay pinned for its consumer."""
        if self._sessions.get(session.peer) is session:
            del self._sessions[session.peer]
        session.close(outcome, reason, bye=bye, close_conn=close_conn)
        if session.server.n_pins:
            self._lingering.add(session)
        self._release_data_peer(session)

    def _release_data_peer(self, session: Session) -> None:
        """Remove the data peer if ``session`` registered it (a newer session of the same
        address that re-registered it owns it now)."""
        peer = session.peer
        if self._dir.data_owner.get(peer) is not session or self._closed:
            return
        del self._dir.data_owner[peer]
        undrained = self._data.remove_peer(peer)
        if undrained:
            log.warning("data peer %s removed with %d internal transfer(s) undrained: %s",
                        peer, len(undrained), undrained[:16])

    def _data_tick(self) -> None:
        data = self._data
        data.progress()
        if not self._env.owners:
            return
        for session in [s for s in self._sessions.values() if s.client.reads]:
            done, failed = data.poll(session.peer)
            if done or failed:
                self._route(done, failed)

    def _route(self, done: Sequence[int], failed: Sequence[int]) -> None:
        """Hand terminal read ids to the sessions that posted them."""
        owners = self._env.owners
        for ok, tids in ((True, done), (False, failed)):
            for tid in tids:
                owner = owners.pop(tid, None)
                if owner is not None:
                    owner.on_data(tid, ok)

    def _in_flight(self) -> int:
        return sum(len(s.client.reads) for s in self._sessions.values())


def _slot_list(job_id: int, ids: Sequence[int], num_blocks: int) -> list[int]:
    """``ids`` as a list of Python ints within ``0..num_blocks-1``; numpy arrays and numpy
    integers (anything ``operator.index`` takes) are accepted like ints; bools and floats
    raise ``ValueError``."""
    tolist = getattr(ids, "tolist", None)
    slots: list[int] = tolist() if tolist is not None else list(ids)
    if not slots:
        return slots
    if set(map(type, slots)) != _INT_TYPES:
        bad = next((s for s in slots if isinstance(s, bool) or not _is_index(s)), None)
        if bad is not None:
            raise ValueError(f"job {job_id}: block id {bad!r} is not an integer")
        slots = list(map(operator.index, slots))
    if min(slots) < 0 or max(slots) >= num_blocks:
        bad = next(s for s in slots if not 0 <= s < num_blocks)
        raise ValueError(f"job {job_id}: block id {bad!r} is not a slot in "
                         f"0..{num_blocks - 1}")
    return slots


def _is_index(value: object) -> bool:
    try:
        operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return False
    return True
