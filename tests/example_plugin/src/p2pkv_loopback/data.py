"""The ``loopback`` data transport: reads blocks between regions registered in one process.

The worked example of ``docs/plugin-authors.md``: the :class:`p2pkv.DataTransport`
base keeps the books (transfer ids, per-peer reads, exactly-once reports, index checks, ending
reads, close), so this module only describes its region, attaches peers, posts reads,
progresses them and tells their state.

A region registers under a random name in a process-wide table; ``descriptor()`` is JSON
``{"loopback": name, "num_blocks": n, "block_len": b}``. A posted read copies from the peer's
region into ours in our next ``progress`` or ``poll`` (it fails if the peer's region is gone:
once a peer closed, reads of its region fail); the next ``poll`` of that peer reports it.
``progress`` finds the reads through the base (``_reads_in_flight``) and nothing runs outside
a call, so ending a read needs no ``_end_reads``: the base forgets it and ``progress`` never
sees it again. A backend that keeps reads anywhere else (a queue of its own, a thread, its
library) must implement ``_end_reads``, or a cancelled read still lands. No internal
transfers, so ``remove_peer`` and ``close`` return ``[]``; ``close`` removes the region from
the table, so peers' reads of it fail from then on.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from p2pkv import (
    Capabilities,
    ConfigError,
    DataSettings,
    DataTransport,
    Indexes,
    PeerRejected,
    ReadState,
)

__all__ = ["LoopbackDataTransport"]

_REGIONS: dict[str, npt.NDArray[np.uint8]] = {}


@dataclass(frozen=True)
class _Peer:
    region: str
    num_blocks: int


@dataclass
class _Read:
    region: str
    local: Indexes
    remote: Indexes
    copied: bool | None = None
    """None until ``progress`` copied it; then True (done) or False (the source was gone)."""


class LoopbackDataTransport(DataTransport):
    """In-process block reads (see the module docstring). No options."""

    name: ClassVar[str] = "loopback"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        if settings.options:
            raise ConfigError(f"loopback data takes no options, got {sorted(settings.options)}")
        super().__init__(settings)  # checks the region, sets self._blocks
        self._name = uuid.uuid4().hex
        _REGIONS[self._name] = self._blocks

    def descriptor(self) -> bytes:
        desc = {"loopback": self._name, "num_blocks": self.num_blocks, "block_len": self.block_len}
        return json.dumps(desc).encode()

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> _Peer:
        try:
            desc: Any = json.loads(descriptor)
            name, num_blocks, block_len = desc["loopback"], desc["num_blocks"], desc["block_len"]
        except (ValueError, TypeError, KeyError) as exc:
            raise PeerRejected(f"peer {peer_id!r}: malformed loopback descriptor ({exc})") from None
        if block_len != self.block_len:
            raise PeerRejected(f"peer {peer_id!r}: block_len {block_len} != ours {self.block_len}")
        source = _REGIONS.get(name) if isinstance(name, str) else None
        if source is None or source.shape[0] != num_blocks:
            raise PeerRejected(f"peer {peer_id!r}: no region {name} of {num_blocks} blocks here")
        return _Peer(name, source.shape[0])

    def _post_read(self, peer: _Peer, local: Indexes, remote: Indexes) -> _Read:
        return _Read(peer.region, local, remote)

    def _progress(self) -> None:
        for read in self._reads_in_flight():
            if read.copied is None:
                read.copied = self._copy(read)

    def _read_state(self, read: _Read) -> ReadState:
        if read.copied is None:
            return ReadState.PENDING
        return ReadState.DONE if read.copied else ReadState.FAILED

    def _shutdown(self) -> list[int]:
        del _REGIONS[self._name]
        return []

    def _copy(self, read: _Read) -> bool:
        source = _REGIONS.get(read.region)
        if source is None:
            return False
        self._blocks[read.local] = source[read.remote]
        return True
