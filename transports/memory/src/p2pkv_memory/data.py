"""The ``memory`` data transport: block reads between regions registered in one process.

Each :class:`MemoryDataTransport` registers its region in a process-local table under a
random id; ``descriptor()`` is msgpack ``{"transport": "memory", "region": id,
"num_blocks": n, "block_len": b}``. A read is one numpy fancy-indexed copy from the peer's
``(num_blocks, block_len)`` uint8 view into ours (no per-block Python objects). The consumer
owns every write into its region: only reads this transport posted ever copy into it.

Timing is counted in polls, never in seconds, so tests are deterministic: with the option
``completion_polls`` = N, a read stays in flight for N polls that examine it (``poll(peer)`` or
``poll(None)``) and completes on the next one. N = 0 (default) copies at submit and reports
done on the next poll; N > 0 copies when the read completes, so a slow read lands late (and a
test can model a source that changed meanwhile). A read whose source region was deregistered
before it copied fails instead.

``cancel``, ``remove_peer``, re-adding a peer and ``close`` end reads finally: the read is
forgotten, it never copies afterwards and is never reported. The transport has no internal
transfers, so ``remove_peer`` and ``close`` always return ``[]``. After ``close``,
``read_blocks`` and ``add_peer`` raise and everything else does nothing.

Threading: one driver thread per transport; the region table has its own lock, so transports
on different threads of one process may read from each other.
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
from p2pkv.contracts import EMPTY_POLL, Capabilities, DataSettings, DataTransport, PollResult
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError

from p2pkv_memory.options import read_options

__all__ = ["MemoryDataTransport"]

_DEFAULT_OPTIONS = {"completion_polls": 0}

_REGIONS: dict[str, npt.NDArray[np.uint8]] = {}
_REGIONS_LOCK = threading.Lock()

Blocks = npt.NDArray[np.uint8]
Indexes = npt.NDArray[np.int64]


@dataclass(frozen=True)
class _Peer:
    region: str
    num_blocks: int


class _Read:
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

    Options (``data_options``): ``completion_polls`` (int >= 0, default 0).
    """

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        opts = read_options("memory data", settings.options, _DEFAULT_OPTIONS)
        if opts["completion_polls"] < 0:
            raise ConfigError(
                f"memory data option 'completion_polls' must be >= 0, "
                f"got {opts['completion_polls']}"
            )
        self._completion_polls: int = opts["completion_polls"]
        self._blocks = _region_view(settings)
        self._num_blocks, self._block_len = (int(n) for n in self._blocks.shape)
        self._region_id = uuid.uuid4().hex
        self._peers: dict[str, _Peer] = {}
        self._reads: dict[int, _Read] = {}
        self._by_peer: dict[str, dict[int, _Read]] = {}
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
        """Register the peer's region; a known peer's reads end first (as ``cancel``)."""
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the memory data transport is closed")
        peer = _parse_peer(peer_id, descriptor, self.block_len)
        self._end_peer(peer_id)
        self._peers[peer_id] = peer

    def remove_peer(self, peer_id: str) -> list[int]:
        """Forget the peer and end its reads finally; no internal transfers: always ``[]``."""
        self._peers.pop(peer_id, None)
        self._end_peer(peer_id)
        return []

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Check everything, then post (N = 0: copy now). ``TransferSubmitError`` otherwise."""
        if self._closed:
            raise TransferSubmitError("memory data transport is closed")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        local = _indexes(local_idxs, self.num_blocks, "local")
        remote = _indexes(remote_idxs, peer.num_blocks, f"remote (peer {peer_id!r})")
        _check_pairing(local, remote)
        read = _Read(peer_id, peer.region, local, remote, self._completion_polls)
        if self._completion_polls == 0 and not self._copy(read):
            raise TransferSubmitError(f"peer {peer_id!r}: its region is no longer registered")
        tid = next(self._ids)
        self._reads[tid] = read
        self._by_peer.setdefault(peer_id, {})[tid] = read
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Count down, copy and report the reads of ``peer_id`` (``None``: every peer)."""
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
            for tid, read in list(table.items()):
                if read.polls_left > 0:
                    read.polls_left -= 1
                    continue
                ok = read.copied or self._copy(read)
                (done if ok else failed).append(tid)
                self._forget(tid)
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        """Forget the reads: they never copy and are never reported. Unknown ids: ignored."""
        for tid in transfer_ids:
            if tid in self._reads:
                self._forget(tid)

    def close(self) -> list[int]:
        """End every read, deregister the region and drop our view of it; idempotent."""
        self._closed = True
        self._reads.clear()
        self._by_peer.clear()
        self._peers.clear()
        with _REGIONS_LOCK:
            _REGIONS.pop(self._region_id, None)
        # the caller's region is theirs again: keep no view of it
        self._blocks = np.empty((0, self._block_len), np.uint8)
        return []

    # -- internals ------------------------------------------------------------------------

    def _copy(self, read: _Read) -> bool:
        """Copy the read's source blocks into ours; False if the source is gone."""
        with _REGIONS_LOCK:
            source = _REGIONS.get(read.region)
            if source is None:
                return False
            self._blocks[read.local] = source[read.remote]
        read.copied = True
        return True

    def _end_peer(self, peer_id: str) -> None:
        for tid in list(self._by_peer.get(peer_id, ())):
            self._forget(tid)

    def _forget(self, tid: int) -> None:
        read = self._reads.pop(tid)
        table = self._by_peer[read.peer]
        del table[tid]
        if not table:
            del self._by_peer[read.peer]


def _is_count(value: object) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _parse_peer(peer_id: str, descriptor: bytes, block_len: int) -> _Peer:
    """The peer's registration from its descriptor; ``PeerRejected`` with the reason."""
    try:
        desc: Any = msgpack.unpackb(descriptor, raw=False)
    except Exception as exc:
        raise PeerRejected(f"peer {peer_id!r}: malformed memory descriptor: {exc}") from None
    if not isinstance(desc, dict) or desc.get("transport") != "memory":
        raise PeerRejected(f"peer {peer_id!r}: not a memory transport descriptor")
    region, num_blocks, theirs = desc.get("region"), desc.get("num_blocks"), desc.get("block_len")
    if not (isinstance(region, str) and _is_count(num_blocks) and _is_count(theirs)):
        raise PeerRejected(
            f"peer {peer_id!r}: memory descriptor needs region (str), num_blocks and "
            f"block_len (positive ints), got {desc!r}"
        )
    if theirs != block_len:
        raise PeerRejected(
            f"peer {peer_id!r}: block_len {theirs} does not match ours ({block_len})"
        )
    with _REGIONS_LOCK:
        source = _REGIONS.get(region)
    if source is None:
        raise PeerRejected(
            f"peer {peer_id!r}: region {region} is not registered in this process "
            f"(the memory transport is process-local)"
        )
    if source.shape != (num_blocks, theirs):
        raise PeerRejected(
            f"peer {peer_id!r}: descriptor says {num_blocks}x{theirs} but the region "
            f"is {source.shape[0]}x{source.shape[1]}"
        )
    return _Peer(region, num_blocks)


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
    """A flat, non-empty int64 copy of ``idxs`` within ``0..num_blocks-1``."""
    arr = np.asarray(idxs)
    if arr.size == 0:
        raise TransferSubmitError(f"{what} block indexes are empty: a read names >= 1 block")
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TransferSubmitError(f"{what} block indexes must be a flat list of integers")
    low, high = int(arr.min()), int(arr.max())
    if low < 0 or high >= num_blocks:
        bad = low if low < 0 else high
        raise TransferSubmitError(
            f"{what} block index {bad} is outside 0..{num_blocks - 1}"
        )
    return arr.astype(np.int64, copy=True)


def _check_pairing(local: Indexes, remote: Indexes) -> None:
    """Equal lengths, and no local block named twice (two sources for one slot)."""
    if len(local) != len(remote):
        raise TransferSubmitError(
            f"{len(local)} local but {len(remote)} remote block indexes"
        )
    if len(np.unique(local)) != len(local):
        values, counts = np.unique(local, return_counts=True)
        raise TransferSubmitError(
            f"local block index {int(values[counts > 1][0])} is named twice in one read"
        )
