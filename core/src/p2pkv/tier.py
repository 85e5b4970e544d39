"""``P2PTier``: the engine-facing manager of the P2P KV tier (DESIGN §5).

STUB: signatures and contracts are fixed; the implementation lands with the session protocol.

Threading: every method is called from one driver thread (the engine's scheduler). Nothing
here blocks except ``drain_jobs`` and ``shutdown``, which are bounded by deadlines.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from p2pkv.config import TierConfig
from p2pkv.contracts import ControlTransport, DataTransport
from p2pkv.registry import Registry
from p2pkv.types import Job, JobResult, LookupResult, RequestContext

__all__ = ["LocalHitSource", "P2PTier"]


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
        raise NotImplementedError

    @property
    def local_address(self) -> str:
        """The dialable control address consumers put in ``remote_host``/``remote_port``."""
        raise NotImplementedError

    def on_new_request(self, ctx: RequestContext) -> bool:
        """Parse routing; a consumer starts connecting to its producer now.

        Returns True when the engine should store *every* block of the request to this tier,
        prefix hits included (producer requests), False for chunk-level (only new blocks).
        """
        raise NotImplementedError

    def lookup(self, key: bytes, ctx: RequestContext) -> LookupResult:
        """PD consumer: HIT at once. Symmetric consumer: RETRY until the batched probe sent at
        ``on_schedule_end`` is answered, then HIT/MISS. No consumer routing, or a failed
        ``kv_request_id``: MISS."""
        raise NotImplementedError

    def submit_store(self, job: Job) -> None:
        """Offer blocks to the consumer named by the request's producer routing. Non-blocking."""
        raise NotImplementedError

    def submit_load(self, job: Job) -> None:
        """Ask the producer to write ``job.keys`` into our slots ``job.block_ids``."""
        raise NotImplementedError

    def get_finished_jobs(self) -> list[JobResult]:
        """Run one tick of I/O and hand over every result produced since the last call."""
        raise NotImplementedError

    def tick(self, timeout: float = 0.0) -> None:
        """One tick of control and data I/O (waits at most ``timeout`` for control I/O)."""
        raise NotImplementedError

    def on_request_finished(self, ctx: RequestContext) -> None:
        """No more submits for this request; in-flight jobs still get their results."""
        raise NotImplementedError

    def on_schedule_end(self) -> None:
        """Once per engine step: flush batched lookups, report gauges."""
        raise NotImplementedError

    def serve_lookups(self, source: LocalHitSource) -> None:
        """Answer pending symmetric lookups from ``source`` (valid only during this call)."""
        raise NotImplementedError

    def has_pending_work(self) -> bool:
        """True while any job, transfer, parked store, probe or handshake is outstanding."""
        raise NotImplementedError

    def drain_jobs(self, timeout: float | None = None) -> None:
        """Tick until every submitted job has a result (never aborts anything)."""
        raise NotImplementedError

    def shutdown(self) -> list[JobResult]:
        """Fail what is left, wait for the data plane to go quiescent, close transports.

        Returns the results not yet handed over (every job still gets exactly one)."""
        raise NotImplementedError

    def stats(self) -> dict[str, int]:
        """Counters and gauges (jobs by outcome, bytes, sessions, in-flight transfers)."""
        raise NotImplementedError
