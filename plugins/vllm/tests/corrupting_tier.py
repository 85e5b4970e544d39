"""Test-only: ``P2PKVTier`` that overwrites every block it loaded with noise (a negative control).

vLLM loads it by ``"type": "CorruptingP2PKVTier", "module_path": "corrupting_tier"`` (on
0.27.1, which has no ``module_path``, ``llm_host.register_test_tiers`` registers it). Each
load runs unchanged through p2pkv; only once it succeeded, and before vLLM sees the result,
the landed chunks in vLLM's primary tier are replaced by seeded random bytes. vLLM's hit
counters are unchanged, so a decoder whose tokens still matched would prove nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import numpy as np
from p2pkv_vllm.adapter import P2PKVTier
from p2pkv_vllm.bridge import slots_of

__all__ = ["CorruptingP2PKVTier"]


class CorruptingP2PKVTier(P2PKVTier):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._load_chunks: dict[int, list[int]] = {}
        self._noise = np.random.default_rng(0)

    def submit_load(self, job_metadata: Any) -> None:
        self._load_chunks[job_metadata.job_id] = [int(c) for c in slots_of(job_metadata)]
        super().submit_load(job_metadata)

    def get_finished_jobs(self) -> Iterable[Any]:
        results = list(super().get_finished_jobs())
        size = self.block_size_bytes
        for result in results:
            chunks = self._load_chunks.pop(result.job_id, [])
            if not result.success or not chunks:
                continue
            with self._primary_kv_view.cast("B") as flat:
                region = np.frombuffer(flat, dtype=np.uint8)
                for chunk in chunks:
                    region[chunk * size : (chunk + 1) * size] = self._noise.integers(
                        0, 256, size, dtype=np.uint8
                    )
                del region
        return results
