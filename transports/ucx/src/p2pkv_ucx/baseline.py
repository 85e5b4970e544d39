"""Raw ucxx without p2pkv, the ``ucx`` transport's baseline in ``p2pkv bench``.

:class:`RawUcxxBaseline` is ucxx tag send/receive with no p2pkv, in the transport's
  direction (wire 2: the consumer reads): ``read_blocks`` posts one receive per block straight
  into its slot (tag: read id and position) and sends the source one small request naming the
  source blocks; the source's ``progress``/``poll`` answers with one message per block. No
  staging, no validation, no coalescing. It is duck-typed like a ``DataTransport`` (the
  ``p2pkv_bench_baselines`` hook offers it to ``p2pkv bench`` as ``raw ucx``), with the same
  ``endpoint_error_handling`` as the transport (option, ``P2PKV_UCX_ENDPOINT_ERROR_HANDLING``,
  default on), so the two are compared on the same UCX lanes.

The measuring harness (``run_raw``, ``run_transport``, ``python -m
p2pkv_tools.bench.ucx_baseline``) is p2pkv-tools', which builds on ``p2pkv bench``.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from p2pkv.contracts import DataSettings, PollResult
from p2pkv.errors import TransportUnavailable

from p2pkv_ucx import library
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.transport import UcxDataTransport

__all__ = ["RawUcxxBaseline"]


class RawUcxxBaseline:
    """ucxx without p2pkv, consumer-initiated. Driver-thread only; checks nothing; not for
    production (a request names its sender by an id from its descriptor, trusted as is)."""

    name: ClassVar[str] = "ucx"
    capabilities = UcxDataTransport.capabilities

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> RawUcxxBaseline:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        lib = library.load()
        api = lib.api
        self._error_handling = UcxOptions.from_mapping(settings.options).endpoint_error_handling
        self._api, self._array, self._tag, self._mask = api, lib.array, api.UCXXTag, api.UCXXTagMask
        with library.ucx_environment(lib.env):
            self._ctx: Any = api.UCXContext(feature_flags=(api.Feature.TAG,))
        self._worker: Any = api.UCXWorker(self._ctx)
        self._blocks = np.frombuffer(settings.region, np.uint8).reshape(-1, settings.block_len)
        self._id = int.from_bytes(os.urandom(7), "little") | 1
        self._eps: dict[str, Any] = {}
        self._by_id: dict[int, Any] = {}
        self._links: dict[str, int] = {}
        self._ids = itertools.count(1)
        self._inflight: dict[str, dict[int, list[Any]]] = {}
        self._requests: list[tuple[Any, np.ndarray]] = []
        self._sends: list[Any] = []

    def descriptor(self) -> bytes:
        return self._id.to_bytes(8, "little") + bytes(self._worker.address.tobytes())

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        address = self._api.UCXAddress.create_from_buffer(descriptor[8:])
        ep = self._api.UCXEndpoint.create_from_worker_address(
            self._worker, address, self._error_handling
        )
        self._eps[peer_id] = ep
        self._by_id[int.from_bytes(descriptor[:8], "little")] = ep
        self._links[peer_id] = len(self._links) + 1
        self._inflight.setdefault(peer_id, {})

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Post a receive per block into its slot, then ask the peer for the blocks."""
        ep, array, tag, blocks = self._eps[peer_id], self._array, self._tag, self._blocks
        tid = next(self._ids)
        base = (self._links[peer_id] << 48) | ((tid & 0xFFFFFF) << 24)
        reqs = [ep.tag_recv(array(blocks[i]), tag(base | k)) for k, i in enumerate(local_idxs)]
        head = np.array([self._id, base], np.uint64).view(np.uint8)
        request = np.concatenate([head, np.asarray(remote_idxs, np.uint32).view(np.uint8)])
        self._sends.append((ep.tag_send(array(request), tag(_REQUEST)), request))
        self._inflight[peer_id][tid] = reqs[::-1]  # popped from the end as they complete
        return tid

    def progress(self) -> None:
        """Progress UCX and answer peers' requests with one message per block."""
        worker = self._worker
        worker.progress()
        while True:
            found = worker.tag_probe(self._tag(_REQUEST), self._mask((1 << 64) - 1), remove=True)
            if not found.matched:
                break
            buf = np.empty(found.length, np.uint8)
            self._requests.append((worker.tag_recv_with_handle(self._array(buf), found), buf))
        worker.progress()
        while self._requests and self._requests[0][0].completed:
            self._serve(self._requests.pop(0)[1])
        self._sends = [s for s in self._sends if not s[0].completed]

    def _serve(self, request: np.ndarray) -> None:
        sender, base = (int(v) for v in request[:16].view(np.uint64))
        ep, array, tag, blocks = self._by_id[sender], self._array, self._tag, self._blocks
        for k, j in enumerate(request[16:].view(np.uint32).tolist()):
            self._sends.append((ep.tag_send(array(blocks[j]), tag(base | k)), None))

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.progress()
        done: list[int] = []
        failed: list[int] = []
        for pid, transfers in self._inflight.items():
            if peer_id is not None and pid != peer_id:
                continue
            for tid, reqs in list(transfers.items()):
                while reqs and reqs[-1].completed:
                    if reqs.pop().status != 0:
                        failed.append(tid)
                        reqs.clear()
                if not reqs:
                    del transfers[tid]
                    if tid not in failed:
                        done.append(tid)
        return PollResult(done, failed)

    def close(self) -> list[int]:
        left = sorted(tid for transfers in self._inflight.values() for tid in transfers)
        if not left and not self._sends:
            self._eps.clear()
            self._by_id.clear()
            self._worker = self._ctx = None
        return left


_REQUEST = 1 << 63
"""Tag of a raw read request (a data tag is link << 48 | read << 24 | position, below it)."""
