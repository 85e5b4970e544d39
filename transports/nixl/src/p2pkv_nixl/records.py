"""The nixl transport's records: a peer's loaded agent, one ``add_peer`` of a peer, a posted
read, a WRITE serving a peer's staged read. Plain state; the transport's role classes
change it, each the parts its docstring names (driver thread only)."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes

from p2pkv_nixl.open_mark import MarkReader

__all__ = ["Lane", "Peer", "Read", "RemoteAgent", "Serving", "Strangers"]

Lane = Literal["direct", "staged"]


class RemoteAgent:
    """A peer's NIXL agent, loaded once however many peer records use it."""

    __slots__ = ("disconnected", "metadata", "name", "pool_dlist", "pool_key", "pool_md", "users")

    def __init__(self, name: str, metadata: bytes) -> None:
        self.name = name
        self.metadata = metadata
        self.users = 0
        self.disconnected = False
        self.pool_md: bytes | None = None
        """The peer's staging-pool metadata we loaded (serving its staged reads)."""
        self.pool_key: tuple[int, int, int] | None = None
        self.pool_dlist: Any = None
        """Prepared descriptor list of the peer's staging pool (WRITE target), for ``pool_key``
        = (base, blocks, blocks per slice)."""


class Read:
    """A posted read (the base's handle for it): a direct one's NIXL READ handle, or a staged
    one's pool blocks ``stage`` and request id (it has no handle of ours: the producer serves
    it with a WRITE). ``ended``/``ok``: a staged read's completion or failure arrived. A direct
    read *held* for its peer's connection wire-up has no handle yet and keeps the peer's
    indexes in ``remote`` until it is posted."""

    __slots__ = ("ended", "handle", "local", "ok", "peer", "remote", "request", "stage")

    def __init__(self, peer: Peer, local: Indexes, stage: npt.NDArray[np.int32] | None) -> None:
        self.peer = peer
        self.local = local
        self.stage = stage
        self.handle: Any = None
        self.remote: Indexes | None = None
        self.request = 0
        self.ended = False
        self.ok = False


class Serving:
    """A WRITE we posted to serve a peer's staged read request (an internal transfer)."""

    __slots__ = ("handle", "request")

    def __init__(self, handle: Any, request: int) -> None:
        self.handle = handle
        self.request = request


class Peer:
    """One ``add_peer``: the peer's prepared descriptor list, its lane, and what still runs
    with it outside the base's reads. ``current`` until the base detaches it; a detached
    record is released once ``quiescent``."""

    __slots__ = (
        "base",
        "current",
        "dlist",
        "lane",
        "mark",
        "num_blocks",
        "peer_id",
        "quarantined",
        "remote",
        "serving",
        "slices",
        "warmup",
        "warmup_id",
        "wired",
    )

    def __init__(
        self,
        peer_id: str,
        remote: RemoteAgent,
        dlist: Any,
        num_blocks: int,
        lane: Lane,
        base: int,
        slices: Indexes,
    ) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self.dlist = dlist
        self.num_blocks = num_blocks
        self.base = base
        """The peer's region address in its process (where our direct READs read)."""
        self.slices = slices
        """The first block of each registration of the peer's region (as it advertised)."""
        self.lane: Lane = lane
        self.mark: MarkReader | None = None
        """Reads the peer's open mark after each direct read (``cma`` peers that have one)."""
        self.current = True
        self.quarantined: dict[int, Read] = {}
        """internal id -> an ended read that may still be written (NIXL has not ended it)."""
        self.warmup: Any = None
        """The connection warm-up READ's handle until it ended and was released."""
        self.warmup_id = 0
        """The warm-up's id (reported only by a ``remove_peer``/``close`` it outlives)."""
        self.wired = False
        """A warm-up READ of this record ended ``DONE``: UCX's endpoint to the peer is wired
        up, so a direct READ posted now executes in our process as it is posted (``cma``)
        rather than waiting, unstoppable, in the endpoint's queue."""
        self.serving: dict[int, Serving] = {}
        """internal id -> a WRITE serving this peer's staged read request, still running."""

    @property
    def quiescent(self) -> bool:
        return self.warmup is None and not self.quarantined and not self.serving

    def running(self, quarantine: bool) -> list[int]:
        """Internal ids still running with this peer (with ``quarantine``: kept reads too)."""
        ids = [*self.serving, *(self.quarantined if quarantine else ())]
        return [self.warmup_id, *ids] if self.warmup is not None else ids


class Strangers:
    """Agents that send us staged requests but are not current peers: ``former`` ones, the
    agents of peers removed here, still loaded (oldest first, at most the transport's bound)
    so their late requests are refused explicitly and their consumers' quarantines end; and
    ``unknown`` ones, whose requests are ignored (each logged once)."""

    __slots__ = ("former", "unknown")

    def __init__(self) -> None:
        self.former: dict[str, RemoteAgent] = {}
        self.unknown: set[str] = set()
