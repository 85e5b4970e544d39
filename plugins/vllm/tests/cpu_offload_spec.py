"""Test-only: vLLM's ``TieringOffloadingSpec`` on the CPU platform (not part of the product).

vLLM's CPU offloading worker copies device<->host with CUDA streams and refuses the CPU
platform (``CPU Offloading is currently only supported on CUDA-alike and XPU GPUs``). On a
CPU-only machine the "device" KV cache is host memory too, so this spec keeps everything of
the tiering spec (scheduler side, primary tier, secondary tiers, shared offload region) and
swaps in a worker that copies each KV page with a memcpy, synchronously, at submit time.

Loaded by vLLM itself through ``kv_connector_extra_config``::

    "spec_name": "CpuTieringOffloadingSpec", "spec_module_path": "cpu_offload_spec"

The copy follows vLLM's own pointer arithmetic (``compute_sub_block_ptrs``: a CPU chunk holds
``blocks_per_chunk`` device pages; the first and last chunk of a group may be partial), so a
block lands where vLLM's CUDA worker would put it. The canonical layout is not supported.

Works on vLLM 0.27.1 to 0.33: the region's constructor and view method were renamed between
them (blocks became chunks); :func:`_worker_region` and :func:`_worker_view` pick the release's
spelling by feature, not by version number.
"""

from __future__ import annotations

import ctypes
import inspect
from typing import Any

import numpy as np
import torch
from vllm.utils.math_utils import cdiv
from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.gpu_worker import compute_sub_block_ptrs
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

__all__ = ["CpuTieringOffloadingSpec", "MemcpyOffloadingWorker"]

_REGION_IN_CHUNKS = "num_chunks" in inspect.signature(SharedOffloadRegion).parameters
"""vLLM 0.31+ sizes the shared region in chunks; 0.27.1-0.30 call the same thing blocks."""


def _worker_region(spec: TieringOffloadingSpec, rank: int) -> SharedOffloadRegion:
    """This worker's slot (``rank``) of ``spec``'s shared offload region, in the release's
    spelling."""
    if _REGION_IN_CHUNKS:
        return SharedOffloadRegion(
            engine_id=spec._engine_id,
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
    return SharedOffloadRegion(
        engine_id=spec._engine_id,  # type: ignore[call-arg]
        num_blocks=spec.num_blocks,  # type: ignore[attr-defined]
        rank=rank,
        kv_bytes_per_block=spec.kv_bytes_per_chunk,
        cpu_page_size=spec.cpu_page_size_per_worker,
    )


def _worker_view(region: SharedOffloadRegion, tensor_page_bytes: int) -> torch.Tensor:
    """The next per-tensor view of this worker's slot (0.31+: ``create_next_worker_view``;
    earlier: ``create_next_view``)."""
    create = getattr(region, "create_next_worker_view", None) or region.create_next_view
    view: torch.Tensor = create(tensor_page_bytes)
    return view


class MemcpyOffloadingWorker(OffloadingWorker):
    """Copies KV pages between the engine's (host) KV cache and the offload region.

    Every transfer completes inside ``submit_*``; ``get_finished`` reports it on the next
    call.
    """

    def __init__(
        self, kv_caches: CanonicalKVCaches, blocks_per_chunk: int, region: SharedOffloadRegion
    ) -> None:
        self._region = region
        self._blocks_per_chunk = blocks_per_chunk
        self._refs = kv_caches.group_data_refs
        self._device: list[torch.Tensor] = []
        self._host: list[torch.Tensor] = []
        for kv in kv_caches.tensors:
            self._device.append(kv.tensor.view(torch.int8).view((-1, kv.page_size_bytes)))
            self._host.append(_worker_view(region, kv.page_size_bytes * blocks_per_chunk))
        self._finished: list[TransferResult] = []

    def submit_store(self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: Any) -> bool:
        """Device -> host, done before returning."""
        size = self._copy(src_spec, dst_spec, to_host=True)
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def submit_load(self, job_id: int, src_spec: Any, dst_spec: GPULoadStoreSpec) -> bool:
        """Host -> device, done before returning."""
        size = self._copy(src_spec, dst_spec, to_host=False)
        self._finished.append(TransferResult(job_id, True, size, 0.0))
        return True

    def get_finished(self) -> list[TransferResult]:
        done, self._finished = self._finished, []
        return done

    def wait(self, job_ids: set[int]) -> None:
        """Nothing to wait for: every copy finished at submit."""

    def shutdown(self) -> None:
        self._device.clear()
        self._host.clear()
        self._region.cleanup()

    def _copy(
        self, src_spec: BlockIDsLoadStoreSpec, dst_spec: BlockIDsLoadStoreSpec, *, to_host: bool
    ) -> int:
        """Copy every group's pages from src to dst blocks; returns the bytes copied."""
        device_spec = src_spec if to_host else dst_spec
        assert isinstance(device_spec, GPULoadStoreSpec)
        src_tensors, dst_tensors = (
            (self._device, self._host) if to_host else (self._host, self._device)
        )
        src_per_chunk = 1 if to_host else self._blocks_per_chunk
        dst_per_chunk = self._blocks_per_chunk if to_host else 1
        src_at = dst_at = copied = 0
        for group, (size, first) in enumerate(
            zip(device_spec.group_sizes, device_spec.block_indices, strict=True)
        ):
            if size == 0:
                continue
            src_skip, dst_skip = first % src_per_chunk, first % dst_per_chunk
            src_n = cdiv(size + src_skip, src_per_chunk)
            dst_n = cdiv(size + dst_skip, dst_per_chunk)
            for ref in self._refs[group]:
                src_ptrs = np.empty(size, dtype=np.uint64)
                dst_ptrs = np.empty(size, dtype=np.uint64)
                compute_sub_block_ptrs(
                    src_spec.block_ids[src_at : src_at + src_n],
                    src_per_chunk,
                    src_ptrs,
                    src_tensors[ref.tensor_idx],
                    src_skip,
                )
                compute_sub_block_ptrs(
                    dst_spec.block_ids[dst_at : dst_at + dst_n],
                    dst_per_chunk,
                    dst_ptrs,
                    dst_tensors[ref.tensor_idx],
                    dst_skip,
                )
                for src, dst in zip(src_ptrs.tolist(), dst_ptrs.tolist(), strict=True):
                    ctypes.memmove(dst, src, ref.page_size_bytes)
                copied += size * ref.page_size_bytes
            src_at += src_n
            dst_at += dst_n
        assert src_at == len(src_spec.block_ids) and dst_at == len(dst_spec.block_ids)
        return copied


class CpuTieringOffloadingSpec(TieringOffloadingSpec):
    """``TieringOffloadingSpec`` whose worker is :class:`MemcpyOffloadingWorker`."""

    _worker: OffloadingWorker | None
    """Set by vLLM's base; built here on first use."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if getattr(self.config, "canonical_layout", False):  # 0.31+ only
            raise NotImplementedError("CpuTieringOffloadingSpec: no canonical layout")
        if not self._worker:
            rank = 0 if self.replicated_layout else self.config.parallel.rank
            region = _worker_region(self, rank)
            try:
                self._worker = MemcpyOffloadingWorker(kv_caches, self.blocks_per_chunk, region)
            except BaseException:
                region.cleanup()
                raise
        return self._worker
