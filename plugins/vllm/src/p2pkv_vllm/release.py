"""What the running vLLM release offers the tier, decided once at import (vLLM 0.27.1-0.33).

The tier API moved between the releases the field runs; the adapter uses these names
instead of importing the moving ones itself:

- the policy "store only newly computed blocks": ``OffloadPolicy.CHUNK_LEVEL`` (0.30 and
  later) or ``BLOCK_LEVEL`` (0.27.1);
- the transfer-job record: ``TransferJob`` with ``chunk_ids`` (0.30 and later) or
  ``JobMetadata`` with ``block_ids`` (0.27.1);
- ``CacheHitSource`` (0.32 and later): which source a cache hit is attributed to in vLLM's
  metrics; absent before, and the tier then declares none;
- ``get_none_hash_seed`` (0.32 and later): the seed vLLM derived its block hashes from;
  before, vLLM seeds them from ``PYTHONHASHSEED`` or, unset, from random bytes per process;

This module imports vLLM; ``import p2pkv_vllm`` does not.
"""

from __future__ import annotations

import os
from typing import Any

from vllm.v1.kv_offload.base import OffloadPolicy
from vllm.v1.kv_offload.tiering import base as _tiering

__all__ = ["HIT_SOURCE", "NEW_BLOCKS_ONLY", "RANDOM_SEED", "TransferJob", "none_hash_seed"]

NEW_BLOCKS_ONLY: Any = getattr(OffloadPolicy, "CHUNK_LEVEL", None) or OffloadPolicy.BLOCK_LEVEL
"""The offload policy "store only newly computed blocks" (``BLOCK_LEVEL`` before 0.30)."""
TransferJob: Any = getattr(_tiering, "TransferJob", None) or _tiering.JobMetadata
"""vLLM's transfer-job record (``JobMetadata`` before 0.30; its slots: ``bridge.slots_of``)."""

try:
    from vllm.v1.metrics.cache_hit_source import CacheHitSource as _HitSource

    HIT_SOURCE: Any = _HitSource.P2P
    """The cache-hit source the tier declares (None: this vLLM attributes none)."""
except ImportError:  # before 0.32
    HIT_SOURCE = None

try:
    from vllm.v1.core.kv_cache_utils import get_none_hash_seed as _engine_seed
except ImportError:  # before 0.32: NONE_HASH comes from PYTHONHASHSEED or os.urandom
    _engine_seed = None

RANDOM_SEED = "<random per process>"
"""What :func:`none_hash_seed` says for a release that seeds block hashes from random bytes
(no ``PYTHONHASHSEED``): no peer can match such an instance's blocks."""


def none_hash_seed() -> str:
    """The seed vLLM derives (or will derive) its block hashes from."""
    if _engine_seed is not None:
        return str(_engine_seed())
    return os.environ.get("PYTHONHASHSEED") or RANDOM_SEED
