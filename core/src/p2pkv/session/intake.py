"""Job intake: check a job the engine submits, answer at once the ones that cannot go
anywhere, and record the rest in the ledger.

A malformed job is an engine bug (mismatched lengths, a slot outside the region, keys that
are not bytes, duplicates in one load, a store passed as a load): it raises
:class:`p2pkv.errors.UsageError` and records nothing. A job that is valid but exceeds the
configured ``limits`` fails ``submit_failed``; the engine goes on.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
import operator
from collections.abc import Sequence

import msgspec

from p2pkv.config import Limits
from p2pkv.errors import UsageError
from p2pkv.routing import ConsumerRoute, Routing
from p2pkv.session.ledger import JobLedger
from p2pkv.types import Job, Outcome

log = logging.getLogger(__name__)

_BYTES_TYPES = frozenset({bytes})
_INTS = list[int]
"""Block ids as msgspec checks them (a plain alias: its hash costs no Python call)."""


class JobIntake:
    def __init__(self, ledger: JobLedger, limits: Limits, num_blocks: int) -> None:
        self._ledger = ledger
        self._limits = limits
        self._num_blocks = num_blocks

    def admit(
        self, job: Job, routing: Routing, *, load: bool, closed: bool
    ) -> tuple[Job, str, str] | None:
        """Check and record a submitted job: (normalised job, kv_request_id, peer), or None
        when it got its result at once (no route, nothing to move, shut down, over limits)."""
        if job.is_load is not load:
            want = "submit_load needs a load" if load else "submit_store needs a store"
            raise UsageError(f"job {job.job_id}: {want} job (is_load={load})")
        route = routing.consumer if load else routing.producer
        if (closed or route is None or not len(job.keys)) and self._refuse(
            job, routing, route is None, closed
        ):
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

    def _refuse(self, job: Job, routing: Routing, no_route: bool, closed: bool) -> bool:
        """Answer jobs that cannot go anywhere at once; True if ``job`` got its result."""
        if closed:
            outcome, detail = Outcome.SHUTDOWN, "tier shut down"
        elif routing.error:
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
        """A normalised copy of ``job`` (block ids as a list of ints), or why it exceeds the
        configured ``limits``; ``UsageError`` for a malformed job. A few C-level passes."""
        keys, ids = job.keys, job.block_ids
        n = len(keys)
        if n != len(ids):
            raise UsageError(f"job {job.job_id}: {n} keys but {len(ids)} block ids")
        slots = _slot_list(job.job_id, ids, self._num_blocks)
        if set(map(type, keys)) != _BYTES_TYPES:
            bad_key = next(k for k in keys if type(k) is not bytes)
            raise UsageError(f"job {job.job_id}: keys must be bytes, got {bad_key!r:.60}")
        cap = self._limits.max_key_bytes
        longest = max(map(len, keys))
        if longest > cap or b"" in keys:
            raise UsageError(f"job {job.job_id}: keys must be 1..{cap} bytes long")
        if load and n > 1:  # one block cannot repeat itself
            if len(set(keys)) != n:
                raise UsageError(f"job {job.job_id}: duplicate keys in one load")
            if len(set(slots)) != n:
                raise UsageError(f"job {job.job_id}: duplicate block ids in one load")
        over = self._over_limits(keys, longest, load=load)
        if over:
            return over
        key_list = keys if type(keys) is list else list(keys)
        return Job(job.job_id, key_list, slots, job.is_load, job.ctx)

    def _over_limits(self, keys: Sequence[bytes], longest: int, *, load: bool) -> str:
        """Why a job with ``keys`` (the longest ``longest`` bytes) cannot travel under the
        configured limits, or ``""``."""
        limits = self._limits
        nkeys = len(keys)
        if nkeys > limits.max_keys_per_message:
            return (
                f"{nkeys} blocks exceed limits.max_keys_per_message="
                f"{limits.max_keys_per_message}; raise it to at least {nkeys} (on both "
                f"peers) or use larger blocks"
            )
        cap = limits.max_frame_bytes - 16 * nkeys - 512
        if load and longest * nkeys > cap and len(b"".join(keys)) > cap:
            return (
                f"a fetch for {nkeys} blocks would exceed limits.max_frame_bytes="
                f"{limits.max_frame_bytes}; raise it (on both peers)"
            )
        return ""


def _slot_list(job_id: int, ids: Sequence[int], num_blocks: int) -> list[int]:
    """``ids`` as a new list of Python ints within ``0..num_blocks-1`` (checked in one
    C-level pass and a bounds check); numpy arrays and numpy integers (anything
    ``operator.index`` takes) are accepted like ints; bools and floats raise
    ``UsageError``."""
    try:
        slots: list[int] = msgspec.convert(ids, _INTS)
    except msgspec.ValidationError:
        pass  # not a plain list of ints: the slow path converts it or says why
    else:
        if not slots or (min(slots) >= 0 and max(slots) < num_blocks):
            return slots
    tolist = getattr(ids, "tolist", None)
    raw = tolist() if tolist is not None else list(ids)
    bad = next((s for s in raw if isinstance(s, bool) or not hasattr(type(s), "__index__")), None)
    if bad is not None:
        raise UsageError(f"job {job_id}: block id {bad!r} is not an integer")
    slots = list(map(operator.index, raw))
    bad = next((s for s in slots if not 0 <= s < num_blocks), None)
    if bad is not None:
        raise UsageError(f"job {job_id}: block id {bad!r} is not a slot in 0..{num_blocks - 1}")
    return slots
