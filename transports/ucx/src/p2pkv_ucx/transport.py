"""The ``ucx`` data transport: two-sided UCX tag messaging over ucxx, host memory (wire 2).

ucxx's Python API has no RMA (no memory map, rkey or get), so the producer's transport serves
a read with tagged sends. **The consumer owns every write into its region**:

1. The consumer's ``read_blocks(producer, local, remote)`` cuts the read into runs contiguous
   on both sides and within one slice of each (:func:`~p2pkv.runs.coalesce`; data
   option ``slice_bytes``), numbers it (``link``, ``rid``, see
   :mod:`p2pkv_ucx.tags`) and sends the producer a READ naming the *source* runs. It returns
   at once. Destinations never travel: where a run lands is the consumer's decision alone.
2. The producer's transport serves READs on its own, inside ``progress``/``poll``: after each
   batch of arrived notices (so a CANCEL right behind its READ counts), it sends every run
   straight from its region as one DATA message tagged ``(link, rid, run)``. Nobody above it
   is told: those sends are *internal* transfers, reported only by ``remove_peer``/``close``
   when they do not drain.
3. The consumer takes arriving DATA messages with ``tag_probe`` in its ``progress``/``poll``. A
   message of a live read, of its run's exact length and not taken before, is received into a
   **staging buffer**; anything else (a cancelled, failed or unknown read, a wrong length, a
   repeat) is drained into scratch. A staged run is copied into its slots only after UCX
   completed it without error; the read is done once every run was copied.

**Why staging: a cancelled read is final.** ``ucp_request_cancel`` stops only an *unmatched*
receive: a rendezvous receive that matched (over TCP, copy-in copy-out fragments pulled from
the sender) can still complete much later, for example when a SIGSTOPped producer resumes.
Here a receive never targets the region, so ending a read (``cancel``, ``remove_peer``,
``close``, its deadline, a dead peer, a REFUSE) is only forgetting it: at once, without waiting
for UCX. Whatever UCX still delivers for it lands in a staging buffer that is recycled once
UCX lets go of it. Cost: one memcpy of every byte on the consumer (README: measurements) and
at most ``staging_bytes`` of staging memory; a run beyond that budget waits inside UCX (a
rendezvous run moves no payload until it is taken).

Tags carry a link the *consumer* assigned to the producer, so runs from two peers can never be
taken for each other's reads (UCX matches per worker); a link is never reused, and a peer
moves to a fresh link before its read ids would wrap, so no DATA tag repeats in a transport's
lifetime and a stale message can only ever be drained.

The :class:`~p2pkv.contracts.DataTransport` base keeps the books (transfer ids, per-peer read
tables, exactly-once reports, index checks, the re-add and after-close rules); this module
implements its primitives by delegating to one class per role, sharing one
:class:`~p2pkv_ucx.state.UcxState`: :class:`~p2pkv_ucx.peers.Peers` (endpoints, links,
release), :class:`~p2pkv_ucx.reads.Reads` (our reads and their ghosts),
:class:`~p2pkv_ucx.receiving.Receiving` (runs into staging, then the region),
:class:`~p2pkv_ucx.notices.Notices` (peers' READ/CANCEL/REFUSE),
:class:`~p2pkv_ucx.serving.Serving` (sends serving peers' reads) and
:class:`~p2pkv_ucx.teardown.Teardown` (the end). A read's handle is its
:class:`~p2pkv_ucx.records.Read`; serving sends draw their internal ids from the base's id sequence.

Threading and progress: no progress thread. ``poll``/``progress`` call ``worker.progress()``
on the caller's (driver) thread; ucxx never calls back into Python here. Nothing waits for
a peer (the driver bound, :data:`p2pkv.contracts.DRIVER_BOUND`): ``remove_peer`` returns the
sends still serving the peer at once, and later pumps settle them or give them up
``drain_timeout`` later; ``close`` progresses them for :data:`p2pkv.contracts.DRAIN_GRACE`
at most. Reads never wait. :meth:`UcxDataTransport.held` shows what is still held.

Staging is shared by shares (:mod:`p2pkv_ucx.staging`): a peer stopped with runs half
received holds at most its share of ``staging_bytes``, and runs beyond a peer's share wait,
parked, so the other peers' reads keep landing.

Cost of a pump: O(runs being received + sends being served + peers); reads whose data has not
started arriving cost nothing, however many are outstanding. ``poll(peer)`` adds the base's
look at that peer's reads, where a read past its deadline fails.

Slices (data option ``slice_bytes``, for regions of any size): no message crosses a slice
boundary of either side, the producer's (its descriptor advertises its slice size; it refuses
a READ whose run would cross one) or ours. That is the whole of slicing here: ucxx registers
no region (no memory map, no rkey); UCX registers each message's own buffer when it sends it
(zero-copy rendezvous, through its registration cache) and receives land in staging buffers,
so a registration is never larger than one message and never spans a producer's slice.

Memory safety: no UCX request ever writes our region. Receives write staging or scratch; this
thread copies a staging buffer into the region, for a live read, after its receive completed.
Sends read our region; a send UCX cannot finish (a vanished peer without endpoint error
handling) is given up at its deadline and kept as an *orphan* until UCX lets go of it;
``close`` reports orphans and then leaks the region and UCX objects rather than freeing
memory under them.
"""

from __future__ import annotations

import time
from typing import ClassVar

from p2pkv.contracts import DRAIN_GRACE, Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError, TransportUnavailable

from p2pkv_ucx import library, wire
from p2pkv_ucx.notices import Notices
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.peers import Peers
from p2pkv_ucx.reads import Reads
from p2pkv_ucx.receiving import Receiving
from p2pkv_ucx.records import Peer, Read
from p2pkv_ucx.serving import Serving
from p2pkv_ucx.state import UcxState
from p2pkv_ucx.teardown import Teardown

__all__ = ["MAX_BLOCKS", "UcxDataTransport"]

MAX_BLOCKS = 1 << 32
"""Blocks a region may hold (indexes travel as uint32)."""


class UcxDataTransport(DataTransport):
    """``DataTransport`` over ucxx tag send/receive (see the module docstring).

    A composition: the base's primitives delegate to the role classes, which share the
    ``_state`` (:class:`~p2pkv_ucx.state.UcxState`); this class only orders them (the pump)
    and passes the base's ``_closed`` to the roles that act on it.

    ``descriptors_posted`` (the base's counter) counts the DATA messages (runs) this transport
    posted: sends serving peers' reads and receives of runs (into staging or scratch).
    Coalescing shows in it: a read contiguous on both sides travels as one message per
    ``max_message_bytes``.
    """

    name: ClassVar[str] = "ucx"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True,
        cross_host=True,
        memory_kinds=frozenset({"DRAM"}),
        two_sided=True,
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    def __init__(self, settings: DataSettings) -> None:
        """Check the options and the region (``ConfigError``), load ucxx
        (``TransportUnavailable``) and start our UCX context and worker."""
        options = UcxOptions.from_mapping(settings.options)
        super().__init__(settings)
        if self.num_blocks > MAX_BLOCKS:
            raise ConfigError(
                f"the ucx transport addresses at most {MAX_BLOCKS} blocks, the region has "
                f"{self.num_blocks}: use larger blocks"
            )
        self._state = s = UcxState(library.load(), options, self._blocks, self._transfer_ids)
        self._descriptor = wire.encode_descriptor(
            wire.Descriptor(
                s.address,
                s.instance,
                self.num_blocks,
                self.block_len,
                s.max_run,
                options.endpoint_error_handling,
                s.slice_blocks,
            )
        )
        self._reads = Reads(s)
        self._receiving = Receiving(s, self._reads)
        self._notices = Notices(s, self._reads)
        self._peers = Peers(s, self._reads)
        self._serving = Serving(s, self._peers)
        self._teardown = Teardown(s)

    @property
    def state(self) -> UcxState:
        """The state the roles share (UCX worker, tables, region layout), for diagnostics and
        tests: read it; changing it is the roles' job."""
        return self._state

    @property
    def descriptors_posted(self) -> int:
        """DATA messages posted, counted by the roles in the state (read and written through,
        as the base's attribute)."""
        return self._state.posted

    @descriptors_posted.setter
    def descriptors_posted(self, value: int) -> None:
        self._state.posted = value

    def descriptor(self) -> bytes:
        return self._descriptor

    # -- peers ------------------------------------------------------------------------------

    def _peer_usable(self, peer: Peer) -> bool:
        """False behind a failed endpoint (the peer was paused or cut off past UCX's
        keepalive): re-adding it with the same descriptor (it came back with the same worker)
        then makes a fresh endpoint; keeping the dead one would fail every read forever."""
        return not peer.unreachable()

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Peer:
        """A fresh endpoint and link to the peer; notices it sent before are applied."""
        peer = self._peers.attach(peer_id, descriptor)
        for notice in self._state.early.pop(peer.desc.instance, []):
            self._notices.apply(notice)
        self._serving.serve_pending(closing=False)
        return peer

    def _detach_peer(self, peer: Peer) -> list[int]:
        """Stop serving the peer (its reads have ended, their producer was told) and return
        the ids of our sends still serving it, without waiting for them (later pumps settle
        them, or orphan them ``drain_timeout`` from now). Its endpoint stays (retired) until
        UCX is done with them and the runs of its ghosts arrived or expired."""
        self._peers.forget(peer)
        kept = self._serving.let_go(list(peer.serves.values()))
        self._peers.retire(peer)
        return kept

    # -- reads ------------------------------------------------------------------------------

    def _post_read(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        """Send the peer a READ for ``remote`` cut into runs; they land in ``local`` in later
        pumps. ``TransferSubmitError``: the peer is unreachable, or too many runs."""
        return self._reads.post(peer, local, remote)

    def _read_state(self, read: Read) -> ReadState:
        """A live read past its deadline fails here (finally: its runs go to scratch)."""
        return self._reads.state(read)

    def _end_reads(self, handles: list[Read]) -> None:
        """End reads at once, without waiting for UCX (see ``Reads.end_reads``)."""
        self._reads.end_reads(handles, closing=self._closed)

    # -- progress and the end ---------------------------------------------------------------

    def _progress(self) -> None:
        """Serve peers' reads and take arriving runs."""
        self._pump()

    def _shutdown(self) -> list[int]:
        """Drain our serving sends for ``DRAIN_GRACE`` at most (``drain_timeout`` if
        shorter), then release UCX; if a send is still live, return the ids and keep the
        region and UCX objects on purpose."""
        s = self._state
        s.pending.clear()
        grace = min(s.opts.drain_timeout, DRAIN_GRACE)
        kept = self._serving.drain(list(s.serves.values()), self._pump, grace)
        self._receiving.drop_parked()
        return self._teardown.finish(kept)

    def _held(self) -> dict[str, int]:
        """Sends still serving removed peers, sends given up and kept until UCX lets go
        (orphans), removed peers' endpoints kept for them, ended reads whose runs are still
        awaited (ghosts) or still being received, receives draining into scratch, and
        ``leaked`` once a ``close`` kept the region and UCX objects."""
        s = self._state
        return {
            "sends_to_removed_peers": sum(len(peer.serves) for peer in s.retired),
            "orphaned_sends": len(s.orphans),
            "retired_endpoints": len(s.retired),
            "ghost_reads": len(s.ghosts),
            "ended_receives": sum(1 for r in s.receiving if r.read.ended),
            "draining_receives": len(s.drains),
            "leaked": int(self._teardown.leaked),
        }

    def _pump(self) -> None:
        """All I/O: progress UCX, take notices and runs, serve reads, land completed runs."""
        s = self._state
        worker = s.worker
        worker.progress()
        self._notices.take()
        self._receiving.take()
        worker.progress()
        self._notices.handle()
        if self._serving.serve_pending(closing=self._closed):
            worker.progress()
        self._receiving.land()
        self._serving.settle()
        self._sweep()

    def _sweep(self) -> None:
        """Notice failed endpoints; forget requests UCX let go of, overdue ghosts, and
        removed peers whose endpoints are no longer needed."""
        s = self._state
        self._peers.check_endpoints()
        s.forget_released()
        if s.ghosts:
            self._reads.expire_ghosts(time.monotonic())
        if s.retired:
            self._peers.sweep_retired()
