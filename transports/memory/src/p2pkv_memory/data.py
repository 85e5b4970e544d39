"""The ``memory`` data transport: block copies between regions registered in one process.

Each :class:`MemoryDataTransport` registers its region in a process-local table under a
random id; ``descriptor()`` is msgpack ``{"transport": "memory", "region": id,
"num_blocks": n, "block_len": b}``. A write is one numpy fancy-indexed copy between the two
``(num_blocks, block_len)`` uint8 views (no per-block Python objects).

Timing is counted in polls, never in seconds, so tests are deterministic: with the option
``completion_polls`` = N, a transfer stays in flight for N polls that examine it (``poll(peer)``
or ``poll(None)``) and completes on the next one. N = 0 (default) copies at submit and reports
done on the next poll; N > 0 copies when it completes. A transfer whose target region was
deregistered meanwhile fails instead of writing.

``cancel(WAIT)`` stops every transfer that has not been reported (the ids are forgotten) unless
the option ``wait_cancel_refuses`` is True: then WAIT keeps every id in flight, like a backend
that cannot confirm a stop. ``remove_peer`` and ``close`` wait-cancel and then poll what is left
at most ``drain_polls`` times (default 100); ids still in flight are returned.

Threading: one driver thread per transport; the region table has its own lock, so transports
on different threads of one process may write into each other.
"""

from __future__ import annotations

import itertools
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import msgpack
import numpy as np
import numpy.typing as npt
from p2pkv.contracts import (
    EMPTY_POLL,
    CancelMode,
    Capabilities,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError

from p2pkv_memory.options import read_options

__all__ = ["MemoryDataTransport"]

_DEFAULT_OPTIONS = {"completion_polls": 0, "wait_cancel_refuses": False, "drain_polls": 100}

_REGIONS: dict[str, npt.NDArray[np.uint8]] = {}
_REGIONS_LOCK = threading.Lock()

Blocks = npt.NDArray[np.uint8]
Indexes = npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Peer:
    region: str
    num_blocks: int


class _Transfer:
    __slots__ = ("copied", "local", "peer", "polls_left", "region", "remote")

    def __init__(
        self, peer: str, region: str, local: Indexes, remote: Indexes, polls_left: int
    ) -> None:
        self.peer = peer
        self.region = region
        self.local = local
        self.remote = remote
        self.polls_left = polls_left
        self.copied = False


class MemoryDataTransport(DataTransport):
    """In-process data transport (see the module docstring).

    Options (``data_options``): ``completion_polls`` (int >= 0, default 0),
    ``wait_cancel_refuses`` (bool, default False), ``drain_polls`` (int >= 0, default 100).
    """

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        opts = read_options("memory data", settings.options, _DEFAULT_OPTIONS)
        for key in ("completion_polls", "drain_polls"):
            if opts[key] < 0:
                raise ConfigError(f"memory data option {key!r} must be >= 0, got {opts[key]}")
        self._completion_polls: int = opts["completion_polls"]
        self._wait_cancel_refuses: bool = opts["wait_cancel_refuses"]
        self._drain_polls: int = opts["drain_polls"]
        self._blocks = _region_view(settings)
        self._num_blocks, self._block_len = (int(n) for n in self._blocks.shape)
        self._region_id = uuid.uuid4().hex
        self._peers: dict[str, _Peer] = {}
        self._transfers: dict[int, _Transfer] = {}
        self._by_peer: dict[str, dict[int, _Transfer]] = {}
        self._ids = itertools.count(1)
        self._closed = False
        with _REGIONS_LOCK:
            _REGIONS[self._region_id] = self._blocks

    @classmethod
    def create(cls, settings: DataSettings) -> MemoryDataTransport:
        return cls(settings)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def descriptor(self) -> bytes:
        packed: bytes = msgpack.packb(
            {
                "transport": "memory",
                "region": self._region_id,
                "num_blocks": self.num_blocks,
                "block_len": self.block_len,
            }
        )
        return packed

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        try:
            desc: Any = msgpack.unpackb(descriptor, raw=False)
        except Exception as exc:
            raise PeerRejected(f"peer {peer_id!r}: malformed memory descriptor: {exc}") from None
        if not isinstance(desc, dict) or desc.get("transport") != "memory":
            raise PeerRejected(f"peer {peer_id!r}: not a memory transport descriptor")
        region, num_blocks, block_len = (
            desc.get("region"), desc.get("num_blocks"), desc.get("block_len")
        )
        if not (isinstance(region, str) and _is_count(num_blocks) and _is_count(block_len)):
            raise PeerRejected(
                f"peer {peer_id!r}: memory descriptor needs region (str), num_blocks and "
                f"block_len (positive ints), got {desc!r}"
            )
        if block_len != self.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {block_len} does not match ours ({self.block_len})"
            )
        with _REGIONS_LOCK:
            target = _REGIONS.get(region)
        if target is None:
            raise PeerRejected(
                f"peer {peer_id!r}: region {region} is not registered in this process "
                f"(the memory transport is process-local)"
            )
        if target.shape != (num_blocks, block_len):
            raise PeerRejected(
                f"peer {peer_id!r}: descriptor says {num_blocks}x{block_len} but the region "
                f"is {target.shape[0]}x{target.shape[1]}"
            )
        self._peers[peer_id] = _Peer(region, num_blocks)

    def remove_peer(self, peer_id: str) -> list[int]:
        self._peers.pop(peer_id, None)
        self.cancel(list(self._by_peer.get(peer_id, ())), CancelMode.WAIT)
        for _ in range(self._drain_polls):
            if not self._by_peer.get(peer_id):
                break
            self.poll(peer_id)
        return sorted(self._by_peer.get(peer_id, ()))

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        if self._closed:
            raise TransferSubmitError("memory data transport is closed")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        local = _indexes(local_idxs, self.num_blocks, "local")
        remote = _indexes(remote_idxs, peer.num_blocks, f"remote (peer {peer_id!r})")
        if len(local) != len(remote):
            raise TransferSubmitError(
                f"{len(local)} local but {len(remote)} remote block indexes"
            )
        tid = next(self._ids)
        transfer = _Transfer(peer_id, peer.region, local, remote, self._completion_polls)
        if self._completion_polls == 0 and not self._copy(transfer):
            raise TransferSubmitError(f"peer {peer_id!r}: its region is no longer registered")
        self._transfers[tid] = transfer
        self._by_peer.setdefault(peer_id, {})[tid] = transfer
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        if peer_id is None:
            tables = list(self._by_peer.values())
        else:
            table = self._by_peer.get(peer_id)
            if not table:
                return EMPTY_POLL
            tables = [table]
        done: list[int] = []
        failed: list[int] = []
        for table in tables:
            for tid, transfer in list(table.items()):
                if transfer.polls_left > 0:
                    transfer.polls_left -= 1
                    continue
                ok = transfer.copied or self._copy(transfer)
                (done if ok else failed).append(tid)
                self._forget(tid)
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode) -> list[int]:
        known = [tid for tid in transfer_ids if tid in self._transfers]
        if mode is CancelMode.WAIT and self._wait_cancel_refuses:
            return known
        for tid in known:
            self._forget(tid)
        return []

    def close(self) -> list[int]:
        self._closed = True
        self.cancel(list(self._transfers), CancelMode.WAIT)
        for _ in range(self._drain_polls):
            if not self._transfers:
                break
            self.poll(None)
        if self._transfers:
            return sorted(self._transfers)  # region stays registered: never freed under DMA
        self._peers.clear()
        with _REGIONS_LOCK:
            _REGIONS.pop(self._region_id, None)
        # the caller's region is theirs again: keep no view of it
        self._blocks = np.empty((0, self._block_len), np.uint8)
        return []

    # -- internals ------------------------------------------------------------------------

    def _copy(self, transfer: _Transfer) -> bool:
        with _REGIONS_LOCK:
            target = _REGIONS.get(transfer.region)
            if target is None:
                return False
            target[transfer.remote] = self._blocks[transfer.local]
        transfer.copied = True
        return True

    def _forget(self, tid: int) -> None:
        transfer = self._transfers.pop(tid)
        table = self._by_peer[transfer.peer]
        del table[tid]
        if not table:
            del self._by_peer[transfer.peer]


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _region_view(settings: DataSettings) -> Blocks:
    region, block_len = settings.region, settings.block_len
    if not isinstance(region, memoryview):
        raise ConfigError(f"region must be a memoryview, got {type(region).__name__}")
    if region.readonly or not region.c_contiguous:
        raise ConfigError("region must be a writable, C-contiguous buffer")
    if not _is_count(block_len):
        raise ConfigError(f"block_len must be a positive integer, got {block_len!r}")
    if region.nbytes == 0 or region.nbytes % block_len:
        raise ConfigError(
            f"region of {region.nbytes} bytes is not a positive multiple of block_len {block_len}"
        )
    flat = np.frombuffer(region.cast("B"), dtype=np.uint8)
    return flat.reshape(-1, block_len)


def _indexes(idxs: Sequence[int], num_blocks: int, what: str) -> Indexes:
    arr = np.asarray(idxs)
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TransferSubmitError(f"{what} block indexes must be a flat list of integers")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise TransferSubmitError(
            f"{what} block index {bad} is outside 0..{num_blocks - 1}"
        )
    return arr.astype(np.int64, copy=True)
