"""vLLM-free half of the adapter: config, request contexts, jobs, and the hit source.

Everything here works on duck-typed vLLM objects, so it is unit-tested without vLLM; the
vLLM-bound half (``p2pkv_vllm.adapter``) only injects vLLM's classes and enums.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from p2pkv.config import TierConfig, config_fingerprint
from p2pkv.errors import ConfigError
from p2pkv.types import Job, LookupResult, RequestContext

__all__ = [
    "HOST_ENV",
    "PORT_ENV",
    "ParentHitSource",
    "context_of",
    "job_of",
    "resolve_hash_seed",
    "tier_config_from_keys",
]

HOST_ENV = ("VLLM_P2P_SIDE_CHANNEL_HOST", "P2PKV_HOST")
"""Environment variables for the bind/advertised host, first set one wins (vLLM's name first)."""
PORT_ENV = ("VLLM_P2P_SIDE_CHANNEL_PORT", "P2PKV_PORT")
"""Environment variables for the base port; the bound port is base + DP rank."""

_DERIVED_KEYS = ("fingerprint", "hash_seed")
"""TierConfig keys the adapter derives from the engine; an explicit tier key still wins."""


def tier_config_from_keys(
    tier_keys: Mapping[str, Any],
    *,
    dp_rank: int,
    run_config: Mapping[str, Any],
    hash_seed: str,
    environ: Mapping[str, str] | None = None,
) -> TierConfig:
    """The ``TierConfig`` for the keys of one ``secondary_tiers`` entry.

    ``tier_keys`` is what vLLM's factory passes on (``type``, ``module_path``,
    ``backpressure`` and ``locality`` already removed). The fingerprint is derived from
    ``run_config`` and ``hash_seed`` from the engine unless the keys set them. Raises
    ``ConfigError`` naming any unknown or invalid key.
    """
    keys = dict(tier_keys)
    derived = {"fingerprint": config_fingerprint(run_config), "hash_seed": hash_seed}
    for name in _DERIVED_KEYS:
        keys.setdefault(name, derived[name])
    try:
        return TierConfig.from_dict(
            keys, dp_rank=dp_rank, environ=environ, host_env=HOST_ENV, port_env=PORT_ENV
        )
    except ConfigError as exc:
        raise ConfigError(f"P2PKVTier secondary_tiers entry: {exc}") from None


def resolve_hash_seed(engine_seed: str, environ: Mapping[str, str] | None = None) -> str:
    """The seed vLLM derives block hashes from: ``PYTHONHASHSEED`` if set, else the engine's.

    vLLM builds the tier before it seeds its block hashes, so ``engine_seed`` (vLLM's
    ``get_none_hash_seed()`` at construction) is its cryptographic-hash default; the adapter
    re-checks once the engine runs (see ``P2PKVTier``).
    """
    env = os.environ if environ is None else environ
    return env.get("PYTHONHASHSEED") or engine_seed


def context_of(req_context: Any) -> RequestContext:
    """The one p2pkv context of a vLLM request, kept in the request's own scratch state.

    vLLM's ``ReqContext`` stores per-type state (``set_state``/``get_state``), so the p2pkv
    context lives and dies with the vLLM request and needs no table of its own.
    """
    ctx: RequestContext | None = req_context.get_state(RequestContext)
    if ctx is None:
        ctx = RequestContext(req_context.req_id, req_context.kv_transfer_params)
        req_context.set_state(ctx)
    return ctx


def job_of(transfer_job: Any, ctx: RequestContext) -> Job:
    """A vLLM ``TransferJob`` as a p2pkv ``Job``.

    ``chunk_ids`` (a numpy array) is passed as is: ``P2PTier`` normalises the block ids of
    submitted jobs itself, so they are converted exactly once.
    """
    keys = transfer_job.keys
    return Job(
        job_id=transfer_job.job_id,
        keys=keys if isinstance(keys, Sequence) else list(keys),
        block_ids=transfer_job.chunk_ids,
        is_load=bool(transfer_job.is_promotion),
        ctx=ctx,
    )


class ParentHitSource:
    """``p2pkv.tier.LocalHitSource`` over vLLM's ``ParentManager`` (symmetric serving).

    Each served remote request gets a synthetic vLLM request context with a unique id (vLLM
    keys per-request state by id). Valid only during the ``serve_external_requests`` call
    that built it, like the parent itself.
    """

    def __init__(
        self,
        parent: Any,
        *,
        new_context: Callable[[str], Any],
        results: Mapping[Any, LookupResult],
        serial: itertools.count[int],
    ) -> None:
        self._parent = parent
        self._new_context = new_context
        self._results = results
        self._serial = serial

    def begin(self, kv_request_id: str) -> object:
        req_context = self._new_context(f"p2pkv-serve-{next(self._serial)}-{kv_request_id}")
        self._parent.on_new_request(req_context)
        return req_context

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        """HIT and MISS as the parent says; anything pending (HIT_PENDING, RETRY) is RETRY."""
        return self._results.get(self._parent.lookup(key, handle), LookupResult.RETRY)

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        """The parent's store job over ``keys`` (block ids as plain ints: pinned jobs are not
        normalised by the tier)."""
        transfer_job = self._parent.create_store_job(keys, handle)
        return Job(transfer_job.job_id, list(transfer_job.keys),
                   transfer_job.chunk_ids.tolist(), False, context_of(handle))

    def end(self, handle: object) -> None:
        self._parent.on_request_finished(handle)
