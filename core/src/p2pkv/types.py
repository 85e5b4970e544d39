"""Engine-facing value types of :class:`p2pkv.tier.P2PTier`.

They mirror what serving engines pass to a secondary KV tier; engine adapters (for example
``p2pkv-vllm``) map their own types onto these. Keys are opaque ``bytes`` (block hash plus
whatever the engine appends); block ids are slot indexes in the tier's region.
:class:`LocalHitSource` is the one interface the engine implements for the tier (a producer's
answers to symmetric lookups).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


class LookupResult(enum.Enum):
    """Answer to ``P2PTier.lookup``: present, absent, or ask again after ``on_schedule_end``."""

    MISS = "miss"
    HIT = "hit"
    RETRY = "retry"


class Outcome(str, enum.Enum):
    """Why a job finished. Exactly one per job; ``DONE`` is the only success."""

    DONE = "done"
    NOTHING_TO_DO = "nothing_to_do"
    NO_ROUTE = "no_route"
    TRANSFER_FAILED = "transfer_failed"
    SUBMIT_FAILED = "submit_failed"
    DEMAND_UNMET = "demand_unmet"
    REQUEST_FINISHED = "request_finished"
    LOAD_TIMEOUT = "load_timeout"
    ABORTED = "aborted"
    STORE_TIMEOUT = "store_timeout"
    UNBOUND_TIMEOUT = "unbound_timeout"
    PEER_DEAD = "peer_dead"
    PEER_REJECTED = "peer_rejected"
    PROTOCOL_ERROR = "protocol_error"
    REQUEST_CONFLICT = "request_conflict"
    """The job conflicts with another open job of the same request (the same keys loaded
    twice at once, or a load after the request was ended); only this job fails."""
    SHUTDOWN = "shutdown"

    @property
    def success(self) -> bool:
        return self in (Outcome.DONE, Outcome.NOTHING_TO_DO)


@dataclass(eq=False)
class RequestContext:
    """One engine request as the tier sees it.

    ``kv_transfer_params`` carries the routing dicts (see ``p2pkv.routing``). The tier caches
    its parsed routing in ``routing``; adapters must pass the same object for the same request
    (or an equal one: parsing is deterministic).
    """

    req_id: str
    kv_transfer_params: Mapping[str, Any] | None = None
    routing: Any = field(default=None, repr=False)


@dataclass(eq=False)
class Job:
    """A store (our region -> a consumer) or a load (a producer -> our region).

    ``keys[i]`` lives in (store) or must land in (load) slot ``block_ids[i]`` of the tier's
    region. For a store the slots stay pinned by the engine until the job's result; for a load
    they are reserved for it until the result.
    """

    job_id: int
    keys: Sequence[bytes]
    block_ids: Sequence[int]
    is_load: bool
    ctx: RequestContext


@dataclass(frozen=True)
class JobResult:
    """The single result of a job."""

    job_id: int
    outcome: Outcome
    detail: str = ""

    @property
    def success(self) -> bool:
        return self.outcome.success


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
