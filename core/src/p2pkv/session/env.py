"""What sessions share with the tier that owns them: transports, ledger, timers, identity.

A session never reaches into the tier directly; it goes through :class:`SessionHost` (the
tier implements it) for everything that spans sessions: parked stores, the
``kv_request_id`` -> session binding, failed consumer ids, deferred lookup-handle releases.

Threading: driver thread only.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from p2pkv.config import Limits, Timeouts
from p2pkv.contracts import DataTransport
from p2pkv.registry import Observers
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.ledger import JobLedger
from p2pkv.types import Job

if TYPE_CHECKING:
    from p2pkv.session.session import Session

__all__ = ["Claim", "LocalIdentity", "SessionEnv", "SessionHost"]


@dataclass(frozen=True)
class LocalIdentity:
    """What our hello says about us."""

    address: str
    epoch: int
    descriptor: bytes
    num_blocks: int
    block_len: int
    fingerprint: str
    hash_seed: str


@dataclass(frozen=True)
class Claim:
    """A producer session takes over ``kv_request_id``: stores parked so far, in submit order,
    and whether more stores may still come (the local producer request is not finished)."""

    parked: Sequence[Job]
    supply_open: bool


class SessionHost(Protocol):
    """Tier services a session calls back into."""

    @property
    def has_hit_source(self) -> bool:
        """True once the engine has offered a ``LocalHitSource`` (``serve_lookups``)."""
        ...

    def claim(self, kv_request_id: str, session: Session, *, by_fetch: bool) -> Claim | str:
        """Bind ``kv_request_id`` to ``session``; a string is the reason it cannot be."""
        ...

    def producer_active(self, kv_request_id: str) -> bool:
        """A local producer request with this id exists and has not finished."""
        ...

    def request_gone(self, kv_request_id: str, session: Session) -> None:
        """``session`` holds no more producer state for ``kv_request_id``."""
        ...

    def mark_failed(self, kv_request_id: str, why: str) -> None:
        """A consumer load of this (unfinished) request failed (``why``: outcome and detail):
        lookups answer MISS, later loads fail at once naming ``why``."""
        ...

    def open_pinned(self, job: Job, kv_request_id: str, peer: str) -> None:
        """Record a store job returned by ``LocalHitSource.pin`` in the ledger."""
        ...

    def defer_end(self, handle: object) -> None:
        """Call ``LocalHitSource.end(handle)`` during the next ``serve_lookups``."""
        ...

    def data_peer_added(self, peer: str, session: Session) -> None:
        """``session`` registered ``peer`` with the data transport (it now owns removal)."""
        ...


@dataclass(eq=False)
class SessionEnv:
    data: DataTransport
    ledger: JobLedger
    deadlines: Deadlines
    clock: Callable[[], float]
    observers: Observers
    timeouts: Timeouts
    limits: Limits
    local: LocalIdentity
    host: SessionHost
    owners: dict[int, Session] = field(default_factory=dict)
    """Read id -> the session that posted it (routes ``data.poll`` results)."""
    counters: Counter[str] = field(default_factory=Counter)
