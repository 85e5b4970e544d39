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

The :class:`~p2pkv.contracts.DataTransport` base keeps the books (ids, per-peer reads,
index checks, reporting, the after-close rules); this module implements its primitives.
``cancel``, ``remove_peer``, re-adding a peer and ``close`` end reads finally: the base forgets
the read, so it never copies afterwards and is never reported. The transport has no internal
transfers, so ``remove_peer`` and ``close`` always return ``[]``.

Threading: one driver thread per transport; the region table has its own lock, so transports
on different threads of one process may read from each other.
"""

from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar, TypeGuard

import msgpack
import numpy as np
import numpy.typing as npt

from p2pkv.contracts import Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import PeerRejected, TransferBusy, TransferSubmitError
from p2pkv.options import parse_options
from p2pkv.reference.options import MemoryDataOptions

_REGIONS: dict[str, npt.NDArray[np.uint8]] = {}
_REGIONS_LOCK = threading.Lock()


@dataclass(frozen=True)
class _Peer:
    region: str
    num_blocks: int


class _Read:
    __slots__ = ("copied", "ended", "local", "polls_left", "region", "remote")

    def __init__(self, region: str, local: Indexes, remote: Indexes, polls_left: int) -> None:
        self.region = region
        self.local = local
        self.remote = remote
        self.polls_left = polls_left
        self.copied = False
        self.ended = False


class MemoryDataTransport(DataTransport):
    """In-process data transport (see the module docstring).

    Options (``data_options``): ``completion_polls`` (int >= 0, default 0) and
    ``read_capacity`` (int >= 0, default 0: unbounded; see :class:`MemoryDataOptions`).
    """

    name: ClassVar[str] = "memory"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        opts = parse_options(MemoryDataOptions, settings.options, "memory data option")
        super().__init__(settings)
        self._completion_polls = opts.completion_polls
        self._capacity = opts.read_capacity
        self._in_flight = 0
        """Blocks of reads posted and not ended (counted only with a ``read_capacity``)."""
        self._region_id = uuid.uuid4().hex
        with _REGIONS_LOCK:
            _REGIONS[self._region_id] = self._blocks

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

    # -- primitives of the DataTransport base ----------------------------------------------

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> _Peer:
        return _parse_peer(peer_id, descriptor, self.block_len)

    def read_capacity(self, peer_id: str) -> int | None:
        return self._capacity or None

    def _post_read(self, peer: _Peer, local: Indexes, remote: Indexes) -> _Read:
        """Post (N = 0: copy now; ``TransferSubmitError`` if the source is gone)."""
        if self._capacity:
            self._admit(len(local))
        read = _Read(peer.region, local, remote, self._completion_polls)
        if self._completion_polls == 0 and not self._copy(read):
            self._end(read)
            raise TransferSubmitError("the peer's region is no longer registered")
        return read

    def _admit(self, nblocks: int) -> None:
        """Count ``nblocks`` in flight, or refuse: for now, or (too large) for good."""
        if nblocks > self._capacity:
            raise TransferSubmitError(
                f"a read of {nblocks} blocks exceeds memory data option "
                f"read_capacity={self._capacity}"
            )
        if self._in_flight + nblocks > self._capacity:
            raise TransferBusy(
                f"{self._in_flight} of read_capacity={self._capacity} blocks "
                f"are in flight, a read needs {nblocks}"
            )
        self._in_flight += nblocks

    def _end(self, read: _Read) -> None:
        if self._capacity and not read.ended:
            self._in_flight -= len(read.local)
        read.ended = True

    def _read_state(self, read: _Read) -> ReadState:
        """Count one examining poll down; at zero, copy (if not yet) and end the read."""
        if read.polls_left > 0:
            read.polls_left -= 1
            return ReadState.PENDING
        self._end(read)
        return ReadState.DONE if read.copied or self._copy(read) else ReadState.FAILED

    def _end_reads(self, handles: list[_Read]) -> None:
        for read in handles:
            self._end(read)

    def _shutdown(self) -> list[int]:
        """Deregister the region; nothing runs in the background: always ``[]``."""
        with _REGIONS_LOCK:
            _REGIONS.pop(self._region_id, None)
        return []

    def _copy(self, read: _Read) -> bool:
        """Copy the read's source blocks into ours; False if the source is gone."""
        with _REGIONS_LOCK:
            source = _REGIONS.get(read.region)
            if source is None:
                return False
            _copy_blocks(self._blocks, read.local, source, read.remote)
        read.copied = True
        return True


def _run_start(idxs: Indexes) -> int:
    """``idxs[0]`` when ``idxs`` is one ascending run (``i, i+1, ...``), else -1."""
    first = int(idxs[0])
    n = len(idxs)
    if n == 1 or (int(idxs[-1]) - first == n - 1 and bool((idxs[1:] > idxs[:-1]).all())):
        return first
    return -1


def _copy_blocks(
    dst: npt.NDArray[np.uint8], local: Indexes, src: npt.NDArray[np.uint8], remote: Indexes
) -> None:
    """``dst[local] = src[remote]`` (checked indexes), in one pass over the bytes when either
    side is one run of blocks (no temporary copy of the source blocks)."""
    n = len(local)
    start = _run_start(local)
    if start >= 0:  # mode="clip": the indexes are checked; "raise" would buffer the output
        np.take(src, remote, axis=0, out=dst[start : start + n], mode="clip")
        return
    start = _run_start(remote)
    if start >= 0:
        dst[local] = src[start : start + n]
    else:
        dst[local] = src[remote]


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
