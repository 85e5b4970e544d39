"""The tier's read-only views: pending work, ``stats`` and ``state_sizes``.

``needs_engine``, ``has_pending_work`` and ``stats`` are called every engine step (or every
millisecond from vLLM's tier-poll thread); they visit only the sessions that may be working
or are in their handshake (:mod:`.table`), never every session. ``state_sizes`` is a debug
view and walks everything.

Threading: driver thread only.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.call_guard import GuardedDataTransport
from p2pkv.idle_reaper import IdleReaper
from p2pkv.session.admission import Admission
from p2pkv.session.env import SessionEnv
from p2pkv.session.pause import PauseDetector
from p2pkv.tiering.accept_room import AcceptRoom
from p2pkv.tiering.dialer import Dialer
from p2pkv.tiering.domains import FailureDomains
from p2pkv.tiering.table import SessionTable
from p2pkv.tiering.warm import WarmSet

__all__ = ["Isolation", "PeerRoles", "TierViews"]

_REQUEST_SIZES = (
    "consumer_requests",
    "consumer_rounds",
    "reads",
    "queued_rounds",
    "lookups",
    "probes",
    "producer_requests",
    "producer_rounds",
    "producer_jobs",
    "supply",
    "demand",
    "pins",
    "serves",
)


@dataclass(frozen=True)
class Isolation:
    """The tier's guards whose counters ``stats`` reports (docs/reliability.md).
    ``call_guard`` is the guard the tier built around its data transport: tests may swap
    ``env.data`` for a wrapper, and the overruns are still read from the guard."""

    call_guard: GuardedDataTransport
    pauses: PauseDetector


@dataclass(frozen=True)
class PeerRoles:
    """The roles that decide which peers have sessions, whose ``peers_*`` ``stats`` reports."""

    dialer: Dialer
    warm: WarmSet
    domains: FailureDomains
    idle: IdleReaper
    room: AcceptRoom


class TierViews:
    """Reads the roles' state; changes nothing but the table's lazily pruned sets."""

    def __init__(
        self,
        env: SessionEnv,
        table: SessionTable,
        admission: Admission,
        peers: PeerRoles,
        isolation: Isolation,
    ) -> None:
        self._env = env
        self._table = table
        self._admission = admission
        dialer = peers.dialer
        self._policy = dialer.policy
        self._backoff = dialer.backoff
        self._queue = dialer.queue
        self._warm = peers.warm
        self._domains = peers.domains
        self._idle = peers.idle
        self._room = peers.room
        self._isolation = isolation

    def needs_engine(self) -> bool:
        """See ``P2PTier.needs_engine``."""
        env = self._env
        ledger = env.ledger
        if ledger.pending or ledger.undelivered or len(env.lookup_ends):
            return True
        return self._table.any_working()

    def has_pending_work(self) -> bool:
        """See ``P2PTier.has_pending_work``."""
        return (
            bool(len(self._admission))
            or self.needs_engine()
            or self._table.any_handshaking()
            or bool(len(self._queue))
        )

    def stats(self) -> dict[str, int]:
        """See ``P2PTier.stats``."""
        env, table = self._env, self._table
        c = env.counters
        block_len = env.local.block_len
        out = {f"jobs_{o.value}": n for o, n in env.ledger.outcomes.items()}
        out.update(
            jobs_pending=env.ledger.pending,
            sessions=len(table),
            sessions_ready=table.ready_count(),
            sessions_closing=len(table.lingering),
            in_flight_transfers=len(env.owners),
            parked_stores=env.producers.parked_count,
            loads_queued=sum(s.consumer.window.waiting for s in table.working()),
            frames_delayed=c["frames_delayed"],
            reads_waiting=env.reads.waiting,
            blocks_sent=c["blocks_sent"],
            bytes_sent=c["blocks_sent"] * block_len,
            blocks_read=c["blocks_read"],
            bytes_read=c["blocks_read"] * block_len,
            transfers_failed=c["transfers_failed"],
            submit_failures=c["submit_failures"],
            protocol_errors=c["protocol_errors"],
            handshake_rejections=c["handshake_rejections"],
            data_held=sum(env.data.held().values()),
            data_calls_over_bound=self._isolation.call_guard.overruns,
            slow_ticks=self._isolation.pauses.slow_ticks,
            **self._peer_stats(),
        )
        descriptors = env.data.descriptors_posted
        if descriptors is not None:
            out["descriptors_posted"] = descriptors
        return out

    def _peer_stats(self) -> dict[str, int]:
        """The ``peers_*`` counters and gauges (docs/observability.md, "Peer policy")."""
        policy, domains = self._policy, self._domains
        return {
            "peers_refused": policy.refused,
            "peers_evicted": policy.evicted,
            "peers_gave_way": policy.gave_way,
            "peers_over_cap": policy.over_cap,
            "peers_backed_off": self._backoff.refused,
            "peers_reaped": self._idle.reaped,
            "peers_warm": len(self._warm),
            "peers_warm_ready": self._warm.ready(),
            "peers_dialing": len(self._table.unheard),
            "peers_waiting": len(self._queue),
            "peers_waited": self._queue.queued,
            "peers_wait_failed": self._queue.failed,
            "peers_suspected": domains.suspected,
            "peers_probed": domains.probed,
            **self._room.stats(),
        }

    def state_sizes(self) -> dict[str, int]:
        """See ``P2PTier.state_sizes``."""
        table, env = self._table, self._env
        sizes: dict[str, int] = dict.fromkeys(_REQUEST_SIZES, 0)
        for session in [*table.sessions.values(), *table.lingering]:
            for k, v in session.state_sizes().items():
                sizes[k] += v
        sizes.update(env.producers.state_sizes())
        sizes.update(
            failed_ids=len(env.failed_loads),
            deferred_ends=len(env.lookup_ends),
            jobs_open=env.ledger.pending,
            results_waiting=env.ledger.undelivered,
            owners=len(env.owners),
            timers=len(env.deadlines),
            sessions_lingering=len(table.lingering),
            newcomers=len(self._admission),
            dial_queue=len(self._queue),
            dial_queue_loads=self._queue.loads(),
            reads_waiting=env.reads.waiting,
            frames_held=sum(len(s.outbox) for s in env.congested),
        )
        return sizes
