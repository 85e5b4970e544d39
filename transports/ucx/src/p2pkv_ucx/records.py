"""The ``ucx`` transport's records: a peer, our read from it, our sends serving its read, an
ended read whose runs may still arrive (a ghost), one run being received.

Plain data, owned and changed by the transport on the driver thread only; UCX request
objects (``Any``: ucxx has no type stubs) are held here until UCX lets go of them.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes

from p2pkv_ucx import tags, wire
from p2pkv_ucx.staging import Bytes

__all__ = ["OK", "Ghost", "IntArray", "Peer", "Read", "Receive", "Serve"]

IntArray = npt.NDArray[np.int64]
OK = 0
"""The UCX status of a request that completed without error."""


@dataclass(eq=False)
class Peer:
    """One ``add_peer`` of a peer: the base's peer record (``num_blocks``) and its endpoint."""

    peer_id: str
    desc: wire.Descriptor
    ep: Any
    """Our ucxx endpoint to it; None once released (it closes with the object)."""
    link: int
    """Our id for this peer in the DATA tags of the runs it serves us (moves on before its
    read ids wrap)."""
    max_run: int
    """Blocks per message between us: the smaller of both sides' ``max_run``."""
    slices: Indexes
    """The first block of each slice of its region (:func:`p2pkv.runs.slice_starts`), which
    its runs to us never cross."""
    next_rid: int = 0
    dead: bool = False
    live: int = 0
    """Our live reads from it (not yet ended)."""
    serves: dict[int, Serve] = field(default_factory=dict)
    """Internal transfers: our sends serving its reads of our region."""
    ghosts: dict[int, Ghost] = field(default_factory=dict)
    """Our ended reads from it whose runs it may still send (by read key, see ``Ghost``)."""
    drains: list[Any] = field(default_factory=list)
    """Our receives draining its runs of ghosts into scratch (kept while it is retired)."""
    parked: deque[Any] = field(default_factory=deque)
    """Probe handles of its runs for our live reads that wait for its share of staging, in
    order of arrival (:mod:`p2pkv_ucx.receiving`)."""

    @property
    def num_blocks(self) -> int:
        return self.desc.num_blocks

    def unreachable(self) -> bool:
        """True once its endpoint failed (marked dead, or UCX says it is not alive)."""
        return self.dead or self.ep is None or not self.ep.alive


@dataclass(eq=False)
class Read:
    """Our read from a peer (the base's handle). ``outcome`` is set when it ended with one
    (done / failed) and waits for ``poll``; ``ended`` also when it ended without (final)."""

    peer: Peer
    deadline: float
    link: int
    rid: int
    dst: IntArray
    """First destination slot of each run."""
    lengths: IntArray
    taken: npt.NDArray[np.bool_]
    """Runs whose DATA message was taken (received into staging, or being)."""
    landed: int = 0
    """Runs copied into their slots."""
    staged: int = 0
    """Staging bytes held by this read's runs still being received."""
    ended: bool = False
    outcome: bool | None = None

    @property
    def key(self) -> int:
        return tags.read_key(tags.data_tag(self.link, self.rid, 0))


@dataclass(eq=False)
class Serve:
    """Our sends serving one READ of a peer (an internal transfer: nobody is told)."""

    tid: int
    peer: Peer
    deadline: float
    requests: list[Any] = field(default_factory=list)
    front: int = 0
    """``requests[:front]`` have completed."""
    error: str | None = None

    def settle(self) -> bool:
        """Record completions; True when every send has completed (UCX is done with them)."""
        reqs = self.requests
        while self.front < len(reqs) and reqs[self.front].completed:
            status = reqs[self.front].status
            if status != OK and self.error is None:
                self.error = f"UCX status {status}"
            self.front += 1
        return self.front == len(reqs)


@dataclass(eq=False)
class Ghost:
    """An ended read whose runs the producer may still be sending.

    The producer cannot take back a send it posted, and a rendezvous send completes only
    once *we* took part (matched it and answered through our endpoint to the producer). So
    its runs are still drained (into scratch, never the region) and counted, and a removed
    peer keeps its endpoint until every run arrived or ``deadline`` passed; releasing it
    earlier would leave the producer's sends hanging until its drain deadline."""

    peer: Peer
    taken: npt.NDArray[np.bool_]
    """Runs that arrived (staged while the read was live, or drained since)."""
    left: int
    deadline: float


class Receive(NamedTuple):
    read: Read
    run: int
    request: Any
    buffer: Bytes
