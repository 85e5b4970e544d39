"""``P2PTier``: the engine-facing manager of the P2P KV tier (docs/concepts.md, docs/protocol.md).

The tier owns one control and one data transport, a session per peer (both roles in each,
see :mod:`p2pkv.session`), the job ledger (exactly one result per job) and the deadline
heaps. It is a facade: each public method delegates to one of the role objects of
:mod:`p2pkv.tiering` (the session table, the tick pipeline, the request router, the dialer
with its peer policy, the warm set, failure domains, shutdown, the views). Everything is
driven by ``tick`` (called from ``get_finished_jobs``, ``drain_jobs`` and by adapters that
want to progress I/O between steps); no thread of its own.

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
from collections.abc import Callable

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
from p2pkv.driver import DriverGuard, FlushPoint, driver_call
from p2pkv.errors import ConfigError
from p2pkv.idle_reaper import IdleReaper
from p2pkv.registry import Registry, default_registry
from p2pkv.session.admission import Admission
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.env import LocalIdentity, SessionEnv
from p2pkv.session.intake import JobIntake
from p2pkv.session.ledger import JobLedger
from p2pkv.session.pause import PauseDetector
from p2pkv.session.producers import ProducerDirectory
from p2pkv.session.session import Session
from p2pkv.tiering.accept_room import AcceptRoom
from p2pkv.tiering.backoff import DialBackoff
from p2pkv.tiering.dial_queue import DialQueue
from p2pkv.tiering.dialer import Dialer, DialKind
from p2pkv.tiering.domains import FailureDomains
from p2pkv.tiering.requests import RequestRouter
from p2pkv.tiering.shutdown import Shutdown
from p2pkv.tiering.table import SessionTable
from p2pkv.tiering.tick import TickPipeline
from p2pkv.tiering.views import Isolation, PeerRoles, TierViews
from p2pkv.tiering.warm import WarmSet
from p2pkv.types import Job, JobResult, LocalHitSource, LookupResult, Outcome, RequestContext

__all__ = ["LocalHitSource", "P2PTier"]

log = logging.getLogger(__name__)

_DRAIN_WARN_S = 5.0


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
        reg = registry if registry is not None else default_registry()
        self._data = self._call_guard = GuardedDataTransport(
            _data_transport(reg, config, region, block_len, data)
        )
        try:
            self._control = control if control is not None else _control_transport(reg, config)
        except BaseException:
            if data is None:
                self._data.close()
            raise
        self._observers = reg.observers
        self._ledger = JobLedger(clock, self._observers)
        self._env = self._session_env(Deadlines())
        if self._control.batch_sends():  # then frames leave as the call that sent returns
            self._guard.flush = self._env.flush_control = FlushPoint(self._control.flush)
        self._table = SessionTable(self._env)
        self._admission = Admission(
            self._env,
            self._table.sessions,
            start=self._table.start,
            close=self._table.close,
            close_unusable=self._table.close_unusable,
        )
        self._build_roles()

    def _session_env(self, deadlines: Deadlines) -> SessionEnv:
        config, data = self._config, self._data
        return SessionEnv(
            data=data,
            ledger=self._ledger,
            deadlines=deadlines,
            clock=self._clock,
            observers=self._observers,
            timeouts=config.timeouts,
            limits=config.limits,
            flow=config.flow,
            local=LocalIdentity(
                address=self._control.local_address,
                epoch=secrets.randbits(64),
                descriptor=data.descriptor(),
                num_blocks=data.num_blocks,
                block_len=data.block_len,
                fingerprint=config.fingerprint,
                hash_seed=config.hash_seed,
            ),
            producers=ProducerDirectory(
                self._ledger, deadlines, self._clock, config.timeouts, self._observers
            ),
        )

    def _build_roles(self) -> None:
        """The roles over the table (:mod:`p2pkv.tiering`), wired to each other."""
        config, env, table, clock = self._config, self._env, self._table, self._clock
        peers, peer_timers = config.peers, Deadlines()
        backoff = DialBackoff(peers.dial_backoff)
        warm = WarmSet(peers.warm, peers.max_handshakes, table, peer_timers, clock, backoff)
        queue = DialQueue(env, peers.max_dialed, peer_timers, warm.listed)
        dialer = Dialer(
            self._control,
            table,
            self._admission,
            env,
            DialPolicy(peers, clock()),
            backoff,
            queue,
            peer_timers,
        )
        domains = FailureDomains(table, clock, config.timeouts.handshake)
        idle = IdleReaper(peers.idle_timeout, peer_timers, clock, self._reap, warm.__contains__)
        dialer.warm, dialer.handshake_timeout = warm, domains.handshake_timeout
        warm.dial = lambda peer: dialer.own_dial(peer, DialKind.WARM)
        domains.redial = lambda peer: dialer.own_dial(peer, DialKind.PROBE)
        room = AcceptRoom(self._control, table, self._reap)
        table.watchers.extend((dialer, warm, domains, idle, room))
        discovery = (
            Discovery(peers.connect, peers.resolve_interval, self.local_address)
            if peers.connect
            else None
        )
        periodic = [env.warnings.flush, dialer.drain, room.check]
        if discovery is not None:
            periodic.append(lambda now: _discovered(discovery, warm, now))
        self._dialer = dialer
        self._requests = RequestRouter(
            config,
            env,
            JobIntake(self._ledger, config.limits, self._data.num_blocks),
            table,
            dialer,
            warm,
            self._observers,
        )
        pauses = PauseDetector(clock, self._control.silence_timeout)
        self._ticker = TickPipeline(
            self._control, env, table, self._admission, pauses, peer_timers, periodic
        )
        self._shutdown = Shutdown(
            self._control,
            env,
            table,
            self._admission,
            discovery,
            queue,
            self._ticker.tick,
            pauses.close,
        )
        self._views = TierViews(
            env,
            table,
            self._admission,
            PeerRoles(dialer, warm, domains, idle, room),
            Isolation(self._call_guard, pauses),
        )

    def _reap(self, session: Session, reason: str) -> None:
        self._table.close(session, Outcome.PEER_DEAD, reason, bye=reason)

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
        if self._table.closed:
            return False
        try:
            peer = format_address(*parse_address(address))
        except ConfigError:  # not host:port (an in-process name): the transport judges it
            peer = address
        return not isinstance(self._dialer.session_for(peer, DialKind.REQUEST), str)

    # -- engine API -------------------------------------------------------------------------

    @driver_call
    def on_new_request(self, ctx: RequestContext) -> bool:
        """Parse routing; a consumer starts connecting to its producer now.

        Returns True when the engine should store *every* block of the request to this tier,
        prefix hits included (producer requests), False for chunk-level (only new blocks).
        """
        return self._requests.on_new_request(ctx)

    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """PD consumer: HIT at once. Symmetric consumer: RETRY until the batched probe sent at
        ``on_schedule_end`` is answered, then HIT/MISS. No consumer routing, or a failed
        ``kv_request_id``: MISS."""
        guard = self._guard  # the hot path, once per block: the guard without a wrapper
        outermost = guard.enter("lookup")
        try:
            return self._requests.lookup(key, ctx)
        finally:
            guard.exit(outermost)

    @driver_call
    def submit_store(self, job: Job) -> None:
        """Offer blocks to the consumer named by the request's producer routing. Non-blocking."""
        self._requests.submit_store(job)

    @driver_call
    def submit_load(self, job: Job) -> None:
        """Load ``job.keys`` from the producer into our slots ``job.block_ids`` (we read them;
        the result, once reported, is final for the slots' bytes)."""
        self._requests.submit_load(job)

    @property
    def producer_requests_open(self) -> int:
        """PD producer requests (``remote_decoder`` routing, or stores under a
        ``kv_request_id``) started and not finished yet; cheap, driver thread."""
        return self._env.producers.active_count

    @driver_call
    def get_finished_jobs(self) -> list[JobResult]:
        """Run one tick of I/O and hand over every result produced since the last call."""
        self._ticker.tick(0.0)
        return self._ledger.take()

    @driver_call
    def tick(self, timeout: float = 0.0) -> None:
        """One tick of control and data I/O: waits for control I/O at most ``timeout``, and
        never past the tier's next deadline (so a long ``timeout`` delays no timer), unless
        :meth:`interrupt` ends the wait. Its work is proportional to what is due (frames,
        timers, open jobs), not to the sessions open (:mod:`p2pkv.tiering.tick`)."""
        self._ticker.tick(timeout)

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
        self._requests.on_request_finished(ctx)

    @driver_call
    def on_schedule_end(self) -> None:
        """Once per engine step: flush batched lookups, report gauges."""
        self._requests.on_schedule_end()

    @driver_call
    def serve_lookups(self, source: LocalHitSource) -> None:
        """Answer pending symmetric lookups from ``source`` (valid only during this call)."""
        self._requests.serve_lookups(source)

    @driver_call
    def has_pending_work(self) -> bool:
        """True while any job, transfer, parked store, probe, handshake or held newcomer is
        outstanding."""
        return self._views.has_pending_work()

    @driver_call
    def needs_engine(self) -> bool:
        """True while the tier has work for its engine's calls: a job outstanding or a result
        to hand over, a peer's lookup to answer or end, a round or a pin open, a probe of
        ours in flight. Unlike :meth:`has_pending_work`, a handshake or a held newcomer does
        not count: a thread that only ticks the tier completes those alone (vLLM's adapter
        lets its engine sleep through them, docs/vllm.md "Idle sources")."""
        return self._views.needs_engine()

    @driver_call
    def drain_jobs(self, timeout: float | None = None) -> None:
        """Tick until every submitted job has a result (never aborts anything)."""
        t = self._config.timeouts
        budget = (
            timeout
            if timeout is not None
            else (max(t.lease, t.store, t.unbound_store) + t.shutdown_drain)
        )
        start, wall = self._clock(), time.monotonic()
        warned = False
        while self._ledger.pending and not self._table.closed:
            self._ticker.tick(0.001)
            elapsed = max(self._clock() - start, time.monotonic() - wall)
            if elapsed >= budget:
                log.warning(
                    "drain_jobs: %d job(s) still pending after %.1fs; returning",
                    self._ledger.pending,
                    elapsed,
                )
                return
            if not warned and elapsed >= _DRAIN_WARN_S:
                warned = True
                log.warning(
                    "drain_jobs: still waiting for %d job(s) after %.0fs",
                    self._ledger.pending,
                    elapsed,
                )

    @driver_call
    def shutdown(self) -> list[JobResult]:
        """Wind every session down, close them, close transports; bounded by
        ``timeouts.shutdown_drain`` (docs/protocol.md §10).

        Winding down fails our loads at once (their reads cancelled: nothing can land after)
        and fails the peers' rounds; blocks a consumer may be reading stay pinned until it
        releases them or the budget is spent. Then ``bye`` is said and the region
        deregistered. Returns the results not yet handed over (every job gets exactly one)."""
        if not self._table.closed:
            self._shutdown.run()
        return self._ledger.take()

    @driver_call
    def stats(self) -> dict[str, int]:
        """Counters and gauges (jobs by outcome, bytes, sessions, in-flight transfers, the
        peer policy's ``peers_*``, what the data transport still holds for removed peers and
        its calls over the driver bound, slow ticks, and ``descriptors_posted`` when the data
        transport counts them; docs/observability.md)."""
        return self._views.stats()

    @driver_call
    def peer_connection(self, peer: str) -> ControlConnection | None:
        """The control connection of the live session with ``peer`` (``host:port``), or None.

        A debug view for the conformance kit and tests, which close it to inject a dead
        connection: the tier keeps ownership, and a close is handled exactly as the transport
        reporting that connection dead. Never a decision input for production code."""
        session = self._table.get(peer)
        return None if session is None else session.conn

    @driver_call
    def state_sizes(self) -> dict[str, int]:
        """The size of every per-request structure, by name (sessions, rounds, supply, demand,
        pins, timers, held frames, ...): a read-only debug view. All are zero once the tier is
        quiescent (no job outstanding, nothing in flight); the conformance kit and the leak
        tests assert exactly that, and name the structure that kept something."""
        return self._views.state_sizes()


def _discovered(discovery: Discovery, warm: WarmSet, now: float) -> None:
    """Hand ``peers.connect``'s latest answer to the warm set, when one is due."""
    wanted = discovery.due(now)
    if wanted:
        warm.discovered(wanted)


def _data_transport(
    reg: Registry,
    config: TierConfig,
    region: memoryview,
    block_len: int,
    data: DataTransport | None,
) -> DataTransport:
    """``data`` if given (its region must be the tier's), else one built over ``region``."""
    if data is None:
        built: DataTransport = reg.transport("data", config.data).create(
            DataSettings(region, block_len, config.data_options)
        )
        return built
    nbytes = memoryview(region).nbytes
    if data.block_len != block_len or data.num_blocks * block_len != nbytes:
        raise ConfigError(
            f"data transport region is {data.num_blocks}x{data.block_len}, the "
            f"tier's is {nbytes} bytes in blocks of {block_len}"
        )
    return data


def _control_transport(reg: Registry, config: TierConfig) -> ControlTransport:
    control: ControlTransport = reg.transport("control", config.control).create(
        ControlSettings(
            config.host,
            config.port,
            max_frame_bytes=config.limits.max_frame_bytes,
            options=config.control_options,
            dp_rank=config.dp_rank,
            handshake_timeout=config.timeouts.handshake,
            host_setting=config.host_setting,
            port_setting=config.port_setting,
        )
    )
    return control
