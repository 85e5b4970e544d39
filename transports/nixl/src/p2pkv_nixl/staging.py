"""The staging pool: registered blocks of our own that staged reads land in before the slots.

Why: over any UCX lane but ``cma`` (``tcp``, RDMA) NIXL cannot stop a posted transfer.
Releasing a READ's handle makes UCX "cancel" it and report success, yet the peer's bytes keep
arriving once the peer (or the network) moves again: measured here, a 256 MiB READ over
``UCX_TLS=tcp`` from a SIGSTOPped producer landed in full after ``release()`` and
``remove_remote_agent()`` once the producer resumed. So a staged read lands in pool blocks,
and only a *valid completion* copies them into the caller's slots, with one numpy
fancy-indexed assignment, before the read is reported done. A cancelled staged read never
touches the slots.

How a staged read moves (see :mod:`p2pkv_nixl.transport`): the consumer asks, the producer
WRITEs into this pool. The pool's registration is shared with the producer inside each
request (:attr:`StagingPool.metadata`, NIXL's partial agent metadata: its remote keys only),
and the producer's WRITE carries a completion notification naming the request; that
notification (or the producer's failure notification) is the valid completion.

Quarantine rule: the blocks of a cancelled staged read are not reused while the producer may
still write into them. They return to the pool only once the producer's completion (or
failure) notification for that request arrived: it is sent after the WRITE ended, on the same
connection as the WRITE's data, so nothing of that WRITE arrives after it. Or once NIXL
reports the producer's agent disconnected: UCX has then failed our endpoint to it (its
process died, or the connection broke), the producer's WRITEs to us complete with an error on
its side, and NIXL never reposts a failed WRITE; a restarted producer is a new agent that has
never seen our request. Removing the peer, or its agent from ours, proves nothing on its own
(an RDMA WRITE needs no endpoint of ours, only the pool's remote key, which stays valid while
the pool is registered), so the transport does neither to end a quarantine; it keeps the
peer's agent loaded (so its notifications still arrive) while a quarantine holds. A request
the producer never answers (a peer stopped for good on a live connection, or one that never
added us) keeps its blocks quarantined for the transport's lifetime, counted in
:attr:`StagingPool.quarantined`.

Memory: ``capacity * block_len`` bytes, allocated and registered on first use (a transport
whose peers all read directly never pays for it), kept registered until the transport's clean
``close``; registered in slices of at most ``slice_blocks`` blocks like the region
(:mod:`p2pkv_nixl.slices`), which each request names so the producer's WRITE keeps within
them. Driver-thread only.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
from p2pkv.data_base import Indexes
from p2pkv.errors import TransferBusy, TransferSubmitError
from p2pkv.runs import region_slice_starts, slice_counts

from p2pkv_nixl.agent import LOCAL, block_dlist, register_slices

__all__ = ["StagingPool"]


class StagingPool:
    """``capacity`` blocks registered with ``agent``; hands out and takes back block sets.

    Every block is in exactly one state: free, *reading* (a live staged read's), or
    *quarantined* (a cancelled staged read's whose handle has not ended).
    """

    def __init__(self, agent: Any, block_len: int, capacity: int, slice_blocks: int) -> None:
        """Allocate and register the pool in slices of ``slice_blocks`` blocks. Raises what
        NIXL raises (the caller explains)."""
        self.capacity = capacity
        self.block_len = block_len
        self.slice_blocks = min(slice_blocks, capacity)
        slices = slice_counts(capacity, self.slice_blocks)
        self.slice_starts = region_slice_starts(capacity, self.slice_blocks)
        """The pool's slice starts, for :func:`p2pkv.runs.coalesce` (computed once)."""
        self.array = np.zeros(capacity * block_len, dtype=np.uint8)
        self.blocks = self.array.reshape(capacity, block_len)
        base = int(self.array.ctypes.data)
        self.base = base
        """The pool's address in our process (a producer's WRITE target, see the transport)."""
        self.registration = register_slices(agent, base, slices, block_len)
        try:
            self.dlist = agent.prep_xfer_dlist(LOCAL, block_dlist(base, slices, block_len), "DRAM")
            self.metadata: bytes = agent.get_partial_agent_metadata(self.registration, False)
            """NIXL metadata of the pool's registration alone (its remote keys, no connection
            info): a producer loads it into its view of our agent to WRITE into the pool."""
        except Exception:
            agent.deregister_memory(self.registration)
            raise
        self._free = np.ones(capacity, dtype=bool)
        self.quarantined = 0
        """Blocks held by cancelled reads whose NIXL handle has not ended."""

    @property
    def free(self) -> int:
        return int(np.count_nonzero(self._free))

    def take(self, count: int) -> npt.NDArray[np.int32]:
        """``count`` free blocks (lowest first, so runs stay contiguous), now *reading*.

        ``TransferSubmitError`` naming the ``staging_blocks`` option when the pool cannot
        hold ``count`` blocks at all; ``TransferBusy`` (back-pressure: retry once reads
        ended) when it has fewer free now."""
        if count > self.capacity:
            raise TransferSubmitError(
                f"a staged read of {count} blocks exceeds the staging pool ({self.capacity} "
                f"blocks); raise nixl data option 'staging_blocks' or read in smaller parts"
            )
        found = np.flatnonzero(self._free)[:count]
        if len(found) < count:
            raise TransferBusy(
                f"the staging pool has {len(found)} free blocks of {self.capacity} "
                f"({self.quarantined} quarantined by cancelled reads still running), a read "
                f"needs {count}; raise nixl data option 'staging_blocks'"
            )
        self._free[found] = False
        return found.astype(np.int32)

    def give_back(self, stage: npt.NDArray[np.int32], quarantined: bool = False) -> None:
        """Return *reading* (or, with ``quarantined``, quarantined) blocks to the free set;
        only once nothing can write into them any more."""
        self._free[stage] = True
        if quarantined:
            self.quarantined -= len(stage)

    def quarantine(self, stage: npt.NDArray[np.int32]) -> None:
        """Blocks of a cancelled read whose handle still runs: neither free nor copied."""
        self.quarantined += len(stage)

    def copy_out(
        self, stage: npt.NDArray[np.int32], dest: npt.NDArray[np.uint8], local: Indexes
    ) -> None:
        """``dest[local[i]] = block stage[i]``: one fancy-indexed assignment (a contiguous
        run of pool blocks is taken as a view, so the bytes are copied once)."""
        first, last = int(stage[0]), int(stage[-1])
        if last - first == len(stage) - 1:
            dest[local] = self.blocks[first : last + 1]
        else:
            dest[local] = self.blocks[stage]

    def release(self, agent: Any) -> None:
        """Release the descriptor list and deregister (clean ``close`` only)."""
        agent.release_dlist_handle(self.dlist)
        agent.deregister_memory(self.registration)
