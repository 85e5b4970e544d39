"""The ``loopback`` data transport: reads blocks between regions registered in one process.

A region registers under a random name in a process-wide table; ``descriptor()`` is JSON
``{"loopback": name, "num_blocks": n, "block_len": b}``. ``read_blocks`` validates and queues;
the copy from the peer's region into ours happens in our next ``progress`` or ``poll`` (it
fails if the peer's region is gone), and the next ``poll`` of that peer reports the outcome.
Nothing is ever in flight outside a call, so ``cancel``, ``remove_peer`` and ``close`` end a
read simply by forgetting it: it never copies afterwards and is never reported. There are no
internal transfers, so ``remove_peer`` and ``close`` return ``[]``.
"""

from __future__ import annotations

import itertools
import json
import operator
import uuid
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from p2pkv.contracts import Capabilities, DataSettings, DataTransport, PollResult
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError

__all__ = ["LoopbackDataTransport"]

Blocks = npt.NDArray[np.uint8]

_REGIONS: dict[str, Blocks] = {}


class LoopbackDataTransport(DataTransport):
    """In-process block reads (see the module docstring). No options."""

    name: ClassVar[str] = "loopback"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        if settings.options:
            raise ConfigError(f"loopback data takes no options, got {sorted(settings.options)}")
        region, block_len = settings.region, settings.block_len
        if block_len <= 0 or region.nbytes == 0 or region.nbytes % block_len:
            raise ConfigError(
                f"region of {region.nbytes} bytes is not a positive multiple of {block_len}"
            )
        self._blocks: Blocks | None = np.frombuffer(region, dtype=np.uint8).reshape(-1, block_len)
        self._num_blocks, self._block_len = self._blocks.shape
        self._name = uuid.uuid4().hex
        self._peers: dict[str, tuple[str, int]] = {}
        self._pending: dict[int, tuple[str, str, list[int], list[int]]] = {}
        """Posted reads: id -> (peer, the peer's region name, local, remote)."""
        self._outcome: dict[int, bool] = {}
        """Copied reads (True: done, False: failed) waiting for their peer's poll."""
        self._ids = itertools.count(1)
        _REGIONS[self._name] = self._blocks

    @classmethod
    def create(cls, settings: DataSettings) -> LoopbackDataTransport:
        return cls(settings)

    @property
    def num_blocks(self) -> int:
        return int(self._num_blocks)

    @property
    def block_len(self) -> int:
        return int(self._block_len)

    def descriptor(self) -> bytes:
        desc = {"loopback": self._name, "num_blocks": self.num_blocks, "block_len": self.block_len}
        return json.dumps(desc).encode()

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        try:
            desc: Any = json.loads(descriptor)
            name, num_blocks, block_len = desc["loopback"], desc["num_blocks"], desc["block_len"]
        except (ValueError, TypeError, KeyError) as exc:
            raise PeerRejected(f"peer {peer_id!r}: malformed loopback descriptor ({exc})") from None
        if block_len != self.block_len:
            raise PeerRejected(f"peer {peer_id!r}: block_len {block_len} != ours {self.block_len}")
        if name not in _REGIONS:
            raise PeerRejected(f"peer {peer_id!r}: region {name} is not in this process")
        self._end_peer(peer_id)  # re-adding replaces: the old registration's reads end
        self._peers[peer_id] = (name, int(num_blocks))

    def remove_peer(self, peer_id: str) -> list[int]:
        self._peers.pop(peer_id, None)
        self._end_peer(peer_id)
        return []

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        if self._blocks is None:
            raise TransferSubmitError("loopback data transport is closed")
        if peer_id not in self._peers:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        region, remote_blocks = self._peers[peer_id]
        local = _check(list(local_idxs), self.num_blocks, "local")
        remote = _check(list(remote_idxs), remote_blocks, "remote")
        if not local or len(local) != len(remote):
            raise TransferSubmitError(f"{len(local)} local and {len(remote)} remote indexes")
        if len(set(local)) != len(local):
            raise TransferSubmitError(f"a local block is named twice in {local}")
        tid = next(self._ids)
        self._pending[tid] = (peer_id, region, local, remote)
        return tid

    def progress(self) -> None:
        for tid, (_, region, local, remote) in self._pending.items():
            if tid not in self._outcome:
                self._outcome[tid] = self._copy(region, local, remote)

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.progress()
        done: list[int] = []
        failed: list[int] = []
        for tid, (peer, *_) in list(self._pending.items()):
            if peer_id is not None and peer != peer_id:
                continue
            (done if self._outcome.pop(tid) else failed).append(tid)
            del self._pending[tid]
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        for tid in transfer_ids:
            self._pending.pop(tid, None)
            self._outcome.pop(tid, None)

    def close(self) -> list[int]:
        self._pending.clear()
        self._outcome.clear()
        self._peers.clear()
        _REGIONS.pop(self._name, None)
        self._blocks = None
        return []

    def _end_peer(self, peer_id: str) -> None:
        self.cancel([tid for tid, (peer, *_) in self._pending.items() if peer == peer_id])

    def _copy(self, region: str, local: list[int], remote: list[int]) -> bool:
        source = _REGIONS.get(region)
        if source is None or self._blocks is None:
            return False
        self._blocks[local] = source[remote]
        return True


def _check(idxs: list[Any], num_blocks: int, what: str) -> list[int]:
    """``idxs`` as plain ints, each within ``0..num_blocks-1``, or ``TransferSubmitError``."""
    out = []
    for i in idxs:
        try:
            ok = not isinstance(i, bool) and 0 <= operator.index(i) < num_blocks
        except TypeError:
            ok = False
        if not ok:
            raise TransferSubmitError(f"{what} block index {i!r} is outside 0..{num_blocks - 1}")
        out.append(operator.index(i))
    return out
