"""The engine's calls about requests: routing, lookups, jobs, and the per-step hooks.

Each call finds the sessions it concerns (the dialer, by the peer the routing names; the
producer directory, by ``kv_request_id``) and marks them touched in the table, so the tier's
views of pending work visit only sessions something happened to. A consumer request naming
a peer of ``peers.connect`` also makes it a member of the warm set. A request whose peer
waits for a dial (:mod:`.dial_queue`) waits with it: its PD lookups hit, its symmetric
lookups say RETRY, its loads stay open within their deadlines.

Threading: driver thread only (``P2PTier`` holds the guard).
"""

from __future__ import annotations

import logging

from p2pkv.config import TierConfig
from p2pkv.observers import Observers
from p2pkv.routing import ConsumerRoute, Routing, parse_routing
from p2pkv.session.env import SessionEnv
from p2pkv.session.intake import JobIntake
from p2pkv.session.session import Session
from p2pkv.tiering.dialer import Dialer, DialKind, Queued, Refusal
from p2pkv.tiering.table import SessionTable
from p2pkv.tiering.warm import WarmSet
from p2pkv.types import Job, LocalHitSource, LookupResult, Outcome, RequestContext

__all__ = ["RequestRouter"]

log = logging.getLogger("p2pkv.tier")


class RequestRouter:
    """Routes the engine's request calls to sessions (see the module docstring)."""

    def __init__(
        self,
        config: TierConfig,
        env: SessionEnv,
        intake: JobIntake,
        table: SessionTable,
        dialer: Dialer,
        warm: WarmSet,
        observers: Observers,
    ) -> None:
        self._config = config
        self._env = env
        self._intake = intake
        self._table = table
        self._dialer = dialer
        self._warm = warm
        self._observers = observers
        self._reported: tuple[int, int, int] | None = None
        """The gauges ``tier_state`` last reported (None: not yet)."""

    def routing(self, ctx: RequestContext) -> Routing:
        """The request's routing, parsed once and kept on ``ctx``."""
        routing = ctx.routing
        if not isinstance(routing, Routing):
            routing = ctx.routing = parse_routing(
                ctx.kv_transfer_params,
                max_request_id_chars=self._config.limits.max_request_id_chars,
                req_id=ctx.req_id,
            )
        return routing

    def session_for(self, consumer: ConsumerRoute) -> Session | str | Queued:
        """The session to the request's producer (dialing it if needed), why not, or
        ``QUEUED``: the request waits for the dial."""
        self._warm.named(consumer.peer)
        kind = DialKind.REQUEST if consumer.probe else DialKind.PD
        return self._dialer.session_for(consumer.peer, kind, consumer.kv_request_id)

    def on_new_request(self, ctx: RequestContext) -> bool:
        """See ``P2PTier.on_new_request``."""
        routing = self.routing(ctx)
        if self._table.closed:
            return False
        consumer = routing.consumer
        if consumer is not None:
            session = self.session_for(consumer)
            if isinstance(session, str):
                if not (isinstance(session, Refusal) and session.passing):
                    self._env.failed_loads.mark(consumer.kv_request_id, session)
                # else: backed off; its loads fail peer_dead at submit, for as long as it is
            elif session is not Queued.QUEUED:
                session.consumer.open_request(consumer.kv_request_id)
        if routing.producer is not None:
            self._env.producers.producer_started(routing.producer.kv_request_id)
            return True
        return False

    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """See ``P2PTier.lookup``."""
        routing = ctx.routing
        consumer = (routing if isinstance(routing, Routing) else self.routing(ctx)).consumer
        if (
            consumer is None
            or self._table.closed
            or consumer.kv_request_id in self._env.failed_loads
        ):
            return LookupResult.MISS
        if not consumer.probe:
            return LookupResult.HIT
        session = self.session_for(consumer)
        if isinstance(session, str):
            return LookupResult.MISS
        if session is Queued.QUEUED:
            return LookupResult.RETRY
        result = session.consumer.probe(consumer.kv_request_id, key)
        if result is LookupResult.RETRY:
            self._table.probing[session] = None
        return result

    def submit_store(self, job: Job) -> None:
        """See ``P2PTier.submit_store``."""
        admitted = self._admit(job, load=False)
        if admitted is None:
            return
        job, kv, _ = admitted
        producers = self._env.producers
        producers.store_seen(kv)
        role = producers.bound(kv)
        if role is not None:
            self._env.ledger.set_peer(job.job_id, role.peer)
            role.add_store(kv, job)
            session = self._table.get(role.peer)
            if session is not None:
                self._table.touch(session)
        else:
            producers.park(kv, job)

    def submit_load(self, job: Job) -> None:
        """See ``P2PTier.submit_load``."""
        admitted = self._admit(job, load=True)
        if admitted is None:
            return
        job, kv, peer = admitted
        env = self._env
        failed = env.failed_loads.get(kv)
        if failed is not None:
            env.ledger.close(
                job.job_id,
                Outcome.SUBMIT_FAILED,
                f"request {kv!r} already failed ({failed}); its loads cannot succeed any more",
            )
            return
        consumer: ConsumerRoute = job.ctx.routing.consumer  # parsed by ``_admit``
        queue = self._dialer.queue
        if queue.add_load(peer, kv, job, consumer.probe):  # it waits for a dial: so does the load
            return
        session = self.session_for(consumer)
        if isinstance(session, str):
            env.failed_loads.mark(kv, f"{Outcome.PEER_DEAD.value}: {session}")
            env.ledger.close(job.job_id, Outcome.PEER_DEAD, session)
        elif session is Queued.QUEUED:
            queue.add_load(peer, kv, job, consumer.probe)
        else:
            session.consumer.submit(job, kv, pull=consumer.probe)

    def _admit(self, job: Job, *, load: bool) -> tuple[Job, str, str] | None:
        return self._intake.admit(job, self.routing(job.ctx), load=load, closed=self._table.closed)

    def on_request_finished(self, ctx: RequestContext) -> None:
        """See ``P2PTier.on_request_finished``."""
        routing = self.routing(ctx)
        consumer, producer = routing.consumer, routing.producer
        if consumer is not None:
            self._env.failed_loads.forget(consumer.kv_request_id)
            session = self._table.get(consumer.peer)
            if session is not None:
                session.consumer.finish(consumer.kv_request_id)
            elif consumer.peer in self._dialer.queue:
                self._dialer.queue.finish(consumer.peer, consumer.kv_request_id)
        if producer is not None:
            role = self._env.producers.producer_finished(producer.kv_request_id)
            if role is not None:
                role.producer_finished(producer.kv_request_id)

    def on_schedule_end(self) -> None:
        """See ``P2PTier.on_schedule_end``: sessions with lookups of ours queued send them
        (those still in their handshake keep them for later); the gauges are reported when
        one changed since the last report."""
        probing = self._table.probing
        if probing:
            for session in [s for s in probing if s.ready]:
                session.consumer.flush_lookups()
                del probing[session]
        state = (len(self._env.owners), self._env.producers.parked_count, len(self._table))
        if state != self._reported:  # gauges: an unchanged value needs no report
            self._reported = state
            self._observers.tier_state(
                in_flight_transfers=state[0], parked_stores=state[1], sessions=state[2]
            )

    def serve_lookups(self, source: LocalHitSource) -> None:
        """See ``P2PTier.serve_lookups``: only sessions with peers' lookups waiting."""
        ends = self._env.lookup_ends
        ends.source_seen = True
        for handle in ends.take():
            try:
                source.end(handle)
            except Exception:
                log.exception("hit source end() failed for a released lookup")
        serving = self._table.serving
        if not serving:
            return
        for session in list(serving):
            if session.ready:
                session.producer.serve(source)
            if not session.producer.lookups_waiting:
                del serving[session]
