"""The ``ucx`` data transport: two-sided UCX tag messaging over ucxx, host memory (wire 2).

ucxx's Python API has no RMA (no memory map, rkey or get), so the producer's transport serves
a read with tagged sends. **The consumer owns every write into its region**:

1. The consumer's ``read_blocks(producer, local, remote)`` cuts the read into runs contiguous
   on both sides and within one slice of each (:func:`~p2pkv_ucx.runs.plan_runs`; data
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
implements its primitives. A read's handle is its :class:`~p2pkv_ucx.records.Read`; serving
sends draw their internal ids from the base's id sequence.

Threading and progress: no progress thread. ``poll``/``progress`` call ``worker.progress()``
on the caller's (driver) thread; ucxx never calls back into Python here. Nothing blocks
except ``remove_peer`` and ``close``, which progress unfinished *sends* for at most
``drain_timeout``; reads never wait.

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

import ctypes
import itertools
import math
import secrets
import time
from collections import deque
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from p2pkv.contracts import Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError, TransportUnavailable
from p2pkv.logs import module_logger
from p2pkv.runs import coalesce, per_slice, region_slice_starts

from p2pkv_ucx import library, tags, wire
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.records import OK, Ghost, Peer, Read, Receive, Serve
from p2pkv_ucx.staging import Bytes, Staging

__all__ = ["MAX_BLOCKS", "UcxDataTransport"]

log = module_logger(__name__)

_BATCH = 256
"""Messages taken from UCX per kind per pump (the rest wait for the next pump)."""
_EARLY_LIMIT = 64
"""Notices kept per not-yet-added sender, and senders kept (older ones are dropped)."""
_GHOST_LINGER = 60.0
"""Seconds an ended read's runs are awaited when reads have no deadline (``transfer_timeout``
0); otherwise until the read's own deadline."""
MAX_BLOCKS = 1 << 32
"""Blocks a region may hold (indexes travel as uint32)."""


class UcxDataTransport(DataTransport):
    """``DataTransport`` over ucxx tag send/receive (see the module docstring).

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
        self._lib = library.load()
        self._opts = options
        api = self._lib.api
        self._tag, self._mask, self._array = api.UCXXTag, api.UCXXTagMask, self._lib.array
        address = self._start_ucx(api, options)
        self._max_run = (
            max(1, options.max_message_bytes // self.block_len) if options.coalesce else 1
        )
        self._slice_blocks = min(per_slice(options.slice_bytes, self.block_len), self.num_blocks)
        """Blocks per slice of our region (``num_blocks``: one slice); sends never cross one."""
        self._slices = region_slice_starts(self.num_blocks, self._slice_blocks)
        self._instance = secrets.randbits(62) | 1
        self._descriptor = wire.encode_descriptor(wire.Descriptor(
            address, self._instance, self.num_blocks, self.block_len,
            self._max_run, options.endpoint_error_handling,
            self._slice_blocks,
        ))
        self._timeout = options.transfer_timeout if options.transfer_timeout > 0 else math.inf
        self._links = itertools.count(1)
        self._init_tables()
        self.descriptors_posted: int = 0

    def _init_tables(self) -> None:
        self._peers: set[Peer] = set()
        """Peer records the base holds (added, not yet removed or replaced)."""
        self._retired: set[Peer] = set()
        """Removed peers whose endpoints are still needed (sends serving them, ghosts)."""
        self._by_instance: dict[int, Peer] = {}
        self._early: dict[int, list[wire.Notice]] = {}
        self._live: dict[int, Read] = {}
        """Live reads by (link, rid) key: what an arriving DATA message may belong to."""
        self._ghosts: dict[int, Ghost] = {}
        """Ended reads whose runs may still arrive, by read key, in order of ending."""
        self._serves: dict[int, Serve] = {}
        self._pending: dict[tuple[int, int, int], tuple[Peer, wire.Read]] = {}
        """READs of this pump's notices, served after the batch (a CANCEL may follow)."""
        self._receiving: list[Receive] = []
        self._staging = Staging(self.block_len, self._opts.staging_bytes,
                                self._max_run * self.block_len)
        self._inbox: deque[tuple[Any, Bytes]] = deque()
        self._drains: list[Any] = []
        self._scratch: Bytes | None = None
        self._orphans: list[Serve] = []
        self._loose: list[tuple[Any, Any]] = []
        self._control_limit = 64 + 12 * self.num_blocks

    def _start_ucx(self, api: Any, options: UcxOptions) -> bytes:
        """Create our UCX context and worker; returns the worker's address."""
        config = {k.removeprefix("UCX_"): v for k, v in options.ucx_config.items()}
        try:
            with library.ucx_environment(self._lib.env):
                self._ctx: Any = api.UCXContext(
                    config_dict=config, feature_flags=(api.Feature.TAG,)
                )
            self._worker: Any = api.UCXWorker(self._ctx)
            return bytes(self._worker.address.tobytes())
        except Exception as exc:
            raise ConfigError(f"UCX refused to start ({type(exc).__name__}: {exc})") from exc

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
        desc = self._check_descriptor(peer_id, descriptor)
        link = next(self._links)
        if link > tags.MAX_LINK:
            raise PeerRejected(f"peer {peer_id!r}: link ids exhausted; recreate the transport")
        api = self._lib.api
        try:
            address = api.UCXAddress.create_from_buffer(desc.address)
            ep = api.UCXEndpoint.create_from_worker_address(
                self._worker, address, self._opts.endpoint_error_handling
            )
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: UCX cannot reach its worker ({type(exc).__name__}: {exc})"
            ) from None
        peer = Peer(peer_id, desc, ep, link, min(self._max_run, desc.max_run),
                    region_slice_starts(desc.num_blocks, desc.slice_blocks))
        self._control_limit = max(self._control_limit, 64 + 12 * desc.num_blocks)
        self._peers.add(peer)
        self._by_instance[desc.instance] = peer
        for notice in self._early.pop(desc.instance, []):
            self._on_notice(notice)
        self._serve_pending()
        return peer

    def _check_descriptor(self, peer_id: str, descriptor: bytes) -> wire.Descriptor:
        try:
            desc = wire.decode_descriptor(descriptor)
        except ValueError as exc:
            raise PeerRejected(f"peer {peer_id!r}: {exc}") from None
        if desc.block_len != self.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self.block_len})"
            )
        if desc.error_handling != self._opts.endpoint_error_handling:
            raise PeerRejected(
                f"peer {peer_id!r}: endpoint_error_handling is {desc.error_handling} there and "
                f"{self._opts.endpoint_error_handling} here; UCX cannot connect the two modes "
                f"(set the same data option on every peer)"
            )
        return desc

    def _detach_peer(self, peer: Peer) -> list[int]:
        """Stop serving the peer (its reads have ended, their producer was told); progress
        our sends serving its reads up to ``drain_timeout`` and return the ids of those still
        live. Its endpoint stays (retired) until UCX is done with them and the runs of its
        ghosts arrived or expired."""
        self._peers.discard(peer)
        if self._by_instance.get(peer.desc.instance) is peer:
            del self._by_instance[peer.desc.instance]
        kept = self._drain(list(peer.serves.values()))
        if peer.ep is not None:
            if self._releasable(peer):
                self._release(peer)
            else:
                self._retired.add(peer)
        return kept

    # -- reads ------------------------------------------------------------------------------

    def _post_read(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        """Send the peer a READ for ``remote`` cut into runs; they land in ``local`` in later
        pumps. ``TransferSubmitError``: the peer is unreachable, or too many runs."""
        if not peer.dead and peer.unreachable():
            self._mark_dead(peer)
        if peer.dead:
            raise TransferSubmitError(
                f"peer {peer.peer_id!r} is unreachable (UCX endpoint failed)"
            )
        if len(local) > tags.MAX_RUNS:
            raise TransferSubmitError(f"at most {tags.MAX_RUNS} blocks per read")
        starts, dsts, lengths = coalesce(remote, local, peer.slices, self._slices, peer.max_run)
        link, rid = self._next_rid(peer)
        self._loose.append(
            self._notify(peer, wire.encode_read(self._instance, link, rid, starts, lengths))
        )
        read = Read(peer, time.monotonic() + self._timeout, link, rid, dsts, lengths,
                    np.zeros(len(lengths), np.bool_))
        self._live[read.key] = read
        peer.live += 1
        return read

    def _read_state(self, read: Read) -> ReadState:
        """A live read past its deadline fails here (finally: its runs go to scratch)."""
        if read.outcome is None and time.monotonic() > read.deadline:
            self._fail(read, "timed out")
        if read.outcome is None:
            return ReadState.PENDING
        return ReadState.DONE if read.outcome else ReadState.FAILED

    def _end_reads(self, handles: list[Read]) -> None:
        """End reads at once, without waiting for UCX: forgotten here, their later runs are
        drained into scratch and runs being received land in staging only. Their producers
        are told to skip what they have not sent (not while closing)."""
        ended = [read for read in handles if not read.ended]
        for read in ended:
            self._end(read, None)
        self._tell_cancelled(ended)

    def _progress(self) -> None:
        """Serve peers' reads and take arriving runs."""
        self._pump()

    def _shutdown(self) -> list[int]:
        """Drain our serving sends up to ``drain_timeout``, then release UCX; if a send is
        still live, return the ids and keep the region and UCX objects on purpose."""
        self._pending.clear()
        kept = self._drain(list(self._serves.values()))
        self._orphans = [s for s in self._orphans if not s.settle()]
        undrained = sorted({*kept, *(s.tid for s in self._orphans)})
        if undrained:
            log.warning(
                "ucx transport closed with %d sends UCX has not released; keeping its "
                "region and UCX objects alive on purpose", len(undrained)
            )
            _leak(self)
        else:
            self._teardown()
        return undrained

    # -- internals: reads -------------------------------------------------------------------

    def _next_rid(self, peer: Peer) -> tuple[int, int]:
        """The (link, rid) of a new read from ``peer``; a fresh link before rids wrap."""
        if peer.next_rid >= tags.RID_LIMIT:
            link = next(self._links)
            if link > tags.MAX_LINK:
                raise TransferSubmitError("link ids exhausted; recreate the transport")
            peer.link, peer.next_rid = link, 0
        rid = peer.next_rid
        peer.next_rid += 1
        return peer.link, rid

    def _end(self, read: Read, outcome: bool | None, *, coming: bool = True) -> None:
        """End a live read (once): its later runs are drained, its runs being received
        land in staging only. ``outcome`` (done / failed) waits for ``poll``; None: ended
        finally by the base, never reported. ``coming``: its producer may still send runs
        (not after a REFUSE), so they are awaited as a ghost (drained, see ``Ghost``)."""
        if read.ended:
            return
        read.ended = True
        read.outcome = outcome
        del self._live[read.key]
        peer = read.peer
        peer.live -= 1
        self._staging.release(read.staged)
        read.staged = 0
        left = len(read.taken) - int(np.count_nonzero(read.taken))
        if coming and left and not self._closed and not peer.dead and peer.ep is not None:
            deadline = read.deadline if math.isfinite(read.deadline) else (
                time.monotonic() + _GHOST_LINGER)
            ghost = Ghost(peer, read.taken, left, deadline)
            self._ghosts[read.key] = ghost
            peer.ghosts[read.key] = ghost

    def _fail(self, read: Read, reason: str, *, coming: bool = True) -> None:
        log.info("ucx: read %d:%d from peer %r failed: %s", read.link, read.rid,
                 read.peer.peer_id, reason)
        self._end(read, False, coming=coming)
        self._tell_cancelled([read])

    def _tell_cancelled(self, reads: Iterable[Read]) -> None:
        """CANCEL ended reads at their producers (a hint: they skip what they have not sent)."""
        if self._closed:
            return
        groups: dict[tuple[int, int], list[Read]] = {}
        for read in reads:
            groups.setdefault((id(read.peer), read.link), []).append(read)
        for batch in groups.values():
            peer = batch[0].peer
            if not peer.dead and peer.ep is not None:
                rids = np.array([r.rid for r in batch], np.int64)
                self._send_notice(peer, wire.encode_cancel(self._instance, batch[0].link, rids))

    def _mark_dead(self, peer: Peer) -> None:
        peer.dead = True
        if peer.live:
            for read in [r for r in self._live.values() if r.peer is peer]:
                self._fail(read, "peer unreachable (UCX endpoint failed)")
        self._drop_ghosts(peer)

    def _drop_ghosts(self, peer: Peer) -> None:
        """Stop awaiting a peer's runs (its endpoint failed, or they are overdue)."""
        for key in peer.ghosts:
            del self._ghosts[key]
        peer.ghosts.clear()

    def _expire_ghosts(self, now: float) -> None:
        """Stop awaiting runs past their read's deadline. Ghosts are kept in order of ending,
        close to deadline order, so the scan stops at the first unexpired one (a ghost may
        outlive its deadline a little, which only keeps an endpoint a little longer)."""
        expired: list[int] = []
        for key, ghost in self._ghosts.items():
            if ghost.deadline >= now:
                break
            expired.append(key)
        for key in expired:
            ghost = self._ghosts.pop(key)
            del ghost.peer.ghosts[key]

    # -- internals: progress ----------------------------------------------------------------

    def _pump(self) -> None:
        """All I/O: progress UCX, take notices and runs, serve reads, land completed runs."""
        worker = self._worker
        worker.progress()
        self._take_notices()
        self._take_data()
        worker.progress()
        self._handle_inbox()
        if self._serve_pending():
            worker.progress()
        self._land()
        self._settle_serves()
        self._sweep()

    def _sweep(self) -> None:
        """Notice failed endpoints; forget requests UCX let go of, overdue ghosts, and
        removed peers whose endpoints are no longer needed."""
        for peer in self._peers:
            if (peer.live or peer.serves) and not peer.dead and not peer.ep.alive:
                self._mark_dead(peer)
        if self._orphans:
            self._orphans = [s for s in self._orphans if not s.settle()]
        if self._drains:
            self._drains = [r for r in self._drains if not r.completed]
        if self._loose:
            self._loose = [(r, keep) for r, keep in self._loose if not r.completed]
        if self._ghosts:
            self._expire_ghosts(time.monotonic())
        if self._retired:
            self._sweep_retired()

    def _take_notices(self) -> None:
        probe, recv = self._worker.tag_probe, self._worker.tag_recv_with_handle
        tag, mask = self._tag(tags.kind_tag(tags.NOTICE)), self._mask(tags.KIND_MASK)
        limit = self._control_limit
        for _ in range(_BATCH):
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            size = found.length
            buf = np.empty(size if size <= limit else 1, np.uint8)  # too big: truncated, dropped
            self._inbox.append((recv(self._array(buf), found), buf))

    def _take_data(self) -> None:
        """Take arriving runs while staging has room for the largest one."""
        probe = self._worker.tag_probe
        tag, mask = self._tag(tags.kind_tag(tags.DATA)), self._mask(tags.KIND_MASK)
        staging = self._staging
        for _ in range(_BATCH):
            if not staging.room():
                return
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            self._take_run(found)

    def _take_run(self, found: Any) -> None:
        """Receive one probed DATA message into staging if a live read wants exactly it,
        else drain it into scratch (a wrong length fails the read it names)."""
        sender = found.sender_tag.value
        read = self._live.get(tags.read_key(sender))
        run = tags.run_of(sender)
        if read is not None and run < len(read.lengths) and not read.taken[run]:
            blocks = int(read.lengths[run])
            nbytes = blocks * self.block_len
            if found.length == nbytes:
                buf = self._staging.take(blocks)
                try:
                    req = self._worker.tag_recv_with_handle(self._array(buf), found)
                except Exception as exc:
                    self._staging.release(nbytes)
                    self._staging.recycle(buf)
                    self._fail(read, f"UCX refused a receive ({type(exc).__name__}: {exc})")
                    return
                self.descriptors_posted += 1
                read.taken[run] = True
                read.staged += nbytes
                self._receiving.append(Receive(read, run, req, buf))
                return
            self._fail(read, f"run {run} arrived with {found.length} bytes, not {nbytes}")
        req = self._discard(found)
        ghost = self._ghosts.get(tags.read_key(sender))
        if ghost is not None and run < len(ghost.taken) and not ghost.taken[run]:
            ghost.taken[run] = True
            ghost.peer.drains.append(req)
            ghost.left -= 1
            if not ghost.left:
                del self._ghosts[tags.read_key(sender)]
                del ghost.peer.ghosts[tags.read_key(sender)]

    def _discard(self, found: Any) -> Any:
        """Drain a probed message nobody wants into scratch (never the region)."""
        if self._scratch is None:
            self._scratch = np.empty(self._max_run * self.block_len, np.uint8)
        sink = self._scratch[: max(1, min(found.length, len(self._scratch)))]
        req = self._worker.tag_recv_with_handle(self._array(sink), found)
        self.descriptors_posted += 1
        self._drains.append(req)
        return req

    def _land(self) -> None:
        """Copy runs UCX completed into their slots (live reads only); recycle staging."""
        if not self._receiving:
            return
        staging, still = self._staging, []
        for r in self._receiving:
            req = r.request
            if not req.completed:
                still.append(r)
                continue
            read = r.read
            if not read.ended:
                staging.release(r.buffer.nbytes)
                read.staged -= r.buffer.nbytes
                if req.status != OK:
                    self._fail(read, f"UCX status {req.status} receiving run {r.run}")
                else:
                    self._copy(read, r.run, r.buffer)
            staging.recycle(r.buffer)
        self._receiving = still

    def _copy(self, read: Read, run: int, buf: Bytes) -> None:
        start, n = int(read.dst[run]), int(read.lengths[run])
        self._blocks[start:start + n] = buf.reshape(n, self.block_len)
        read.landed += 1
        if read.landed == len(read.lengths):
            self._end(read, True)

    def _handle_inbox(self) -> None:
        inbox = self._inbox
        while inbox and inbox[0][0].completed:
            req, buf = inbox.popleft()
            try:
                if req.status != OK:
                    raise ValueError(f"UCX status {req.status}")
                self._on_notice(wire.decode_notice(buf.tobytes()))
            except ValueError as exc:
                log.warning("ucx: dropped a malformed NOTICE: %s", exc)

    def _on_notice(self, notice: wire.Notice) -> None:
        """Apply a peer's NOTICE: queue a READ, drop what a CANCEL names, fail a REFUSEd read."""
        peer = self._by_instance.get(notice.instance)
        if peer is None:  # its add_peer may still come: keep a few, in order
            if not isinstance(notice, wire.Refuse):
                early = self._early.setdefault(notice.instance, [])
                early.append(notice)
                del early[:-_EARLY_LIMIT]
                while len(self._early) > _EARLY_LIMIT:
                    del self._early[next(iter(self._early))]
            return
        if isinstance(notice, wire.Read):
            self._pending[(notice.instance, notice.link, notice.rid)] = (peer, notice)
        elif isinstance(notice, wire.Cancel):
            for rid in notice.rids.tolist():
                self._pending.pop((notice.instance, notice.link, rid), None)
        elif notice.link <= tags.MAX_LINK and notice.rid < tags.RID_LIMIT:
            read = self._live.get(tags.read_key(tags.data_tag(notice.link, notice.rid, 0)))
            if read is not None and read.peer is peer:
                self._fail(read, f"the peer refused it: {notice.reason}", coming=False)

    # -- internals: serving peers' reads ----------------------------------------------------

    def _serve_pending(self) -> bool:
        """Serve the READs of the notices just handled; True if any send was posted."""
        if not self._pending:
            return False
        if self._closed:  # closing: drain what runs, start nothing new
            self._pending.clear()
            return False
        pending, self._pending = self._pending, {}
        served = False
        for peer, notice in pending.values():
            if peer in self._peers and not peer.dead:
                served = self._serve(peer, notice) or served
        return served

    def _serve(self, peer: Peer, notice: wire.Read) -> bool:
        """Send each run of a peer's READ from our region (an internal transfer)."""
        problem = self._read_problem(notice)
        if problem is not None:
            log.warning("ucx: refusing a read of peer %r: %s", peer.peer_id, problem)
            self._send_notice(
                peer, wire.encode_refuse(self._instance, notice.link, notice.rid, problem)
            )
            return False
        serve = Serve(next(self._transfer_ids), peer, time.monotonic() + self._timeout)
        self._serves[serve.tid] = serve
        peer.serves[serve.tid] = serve
        send, array, tag, blocks = peer.ep.tag_send, self._array, self._tag, self._blocks
        first = tags.data_tag(notice.link, notice.rid, 0)
        try:
            for run, (s, n) in enumerate(zip(
                notice.starts.tolist(), notice.lengths.tolist(), strict=True
            )):
                serve.requests.append(send(array(blocks[s:s + n]), tag(first | run)))
                self.descriptors_posted += 1
        except Exception as exc:  # a failed endpoint refuses new sends
            serve.error = f"UCX refused a send ({type(exc).__name__}: {exc})"
            log.info("ucx: serving a read of peer %r: %s", peer.peer_id, serve.error)
        return True

    def _read_problem(self, notice: wire.Read) -> str | None:
        """Why a READ cannot be served (None: it can)."""
        if notice.link > tags.MAX_LINK or notice.rid >= tags.RID_LIMIT:
            return "link or read id out of range"
        runs = len(notice.lengths)
        if not 0 < runs <= tags.MAX_RUNS:
            return f"{runs} runs (1..{tags.MAX_RUNS} allowed)"
        if int(notice.lengths.min()) < 1 or int(notice.lengths.max()) > self._max_run:
            return f"a run outside 1..{self._max_run} blocks"
        ends = notice.starts + notice.lengths
        if int(ends.max()) > self.num_blocks:
            return f"blocks outside 0..{self.num_blocks - 1}"
        slice_blocks = self._slice_blocks
        if slice_blocks < self.num_blocks and (
            notice.starts // slice_blocks != (ends - 1) // slice_blocks
        ).any():
            return f"a run crossing a slice boundary (slices of {slice_blocks} blocks)"
        return None

    def _settle_serves(self) -> None:
        """Forget finished sends; give up (orphan) those past their deadline."""
        if not self._serves:
            return
        now = time.monotonic()
        for serve in list(self._serves.values()):
            if serve.settle():
                if serve.error is not None:
                    log.info("ucx: a send serving peer %r failed: %s", serve.peer.peer_id,
                             serve.error)
                self._forget_serve(serve)
            elif now > serve.deadline:
                log.info("ucx: a send serving peer %r did not finish in time; kept until UCX "
                         "releases it", serve.peer.peer_id)
                self._orphans.append(serve)
                self._forget_serve(serve)

    def _forget_serve(self, serve: Serve) -> None:
        del self._serves[serve.tid]
        peer = serve.peer
        del peer.serves[serve.tid]
        if peer not in self._peers and self._releasable(peer):
            self._release(peer)

    def _releasable(self, peer: Peer) -> bool:
        """True when a removed peer's endpoint is no longer needed: none of our sends serve
        it, and none of its runs is still awaited (a ghost) or being received from it."""
        if peer.ep is None:
            return False
        if peer.drains:
            peer.drains = [r for r in peer.drains if not r.completed]
        if not peer.ep.alive:
            self._drop_ghosts(peer)  # nothing more can arrive
        return not (peer.serves or peer.ghosts or peer.drains or any(
            r.read.peer is peer and not r.request.completed for r in self._receiving))

    def _sweep_retired(self) -> None:
        """Release removed peers whose endpoints are no longer needed."""
        for peer in [p for p in self._retired if self._releasable(p)]:
            self._release(peer)

    def _drain(self, serves: list[Serve]) -> list[int]:
        """Progress ``serves`` up to ``drain_timeout``; return the ids still live.

        Those get the drain deadline as their deadline: the next pump orphans them."""
        deadline = time.monotonic() + self._opts.drain_timeout
        left = [s for s in serves if not s.settle()]
        while left and time.monotonic() < deadline:
            self._pump()
            left = [s for s in left if not s.settle()]
        for serve in left:
            serve.deadline = min(serve.deadline, deadline)
        return sorted(s.tid for s in left)

    # -- internals: notices, release, teardown ----------------------------------------------

    def _send_notice(self, peer: Peer, payload: bytes) -> None:
        """Send a NOTICE nobody waits for (its payload is kept until UCX is done with it)."""
        try:
            self._loose.append(self._notify(peer, payload))
        except Exception as exc:  # a failed endpoint: the peer learns nothing, deadlines rule
            log.info("ucx: notice to peer %r not sent: %s", peer.peer_id, exc)

    def _notify(self, peer: Peer, payload: bytes) -> tuple[Any, Bytes]:
        data = np.frombuffer(payload, np.uint8)
        return peer.ep.tag_send(self._array(data), self._tag(tags.kind_tag(tags.NOTICE))), data

    def _release(self, peer: Peer) -> None:
        """Drop a removed peer whose sends are all gone (its endpoint closes on release)."""
        self._retired.discard(peer)
        peer.ep = None

    def _teardown(self) -> None:
        """Close with no send in flight: cancel our own receives, drop UCX and the region.

        Receives UCX will not confirm ended (a run half-received from a paused peer) keep the
        worker, their staging and scratch alive (leaked); they never touch the region."""
        cancel = self._lib.cancel
        receives = [req for req, _ in self._inbox] + self._drains
        receives += [r.request for r in self._receiving]
        if cancel is not None:
            for req in receives:
                if not req.completed:
                    cancel(req)
        self._worker.progress()
        sends = [(r, keep) for r, keep in self._loose if not r.completed]
        if sends or not all(req.completed for req in receives):
            _leak((self._worker, self._ctx, receives, list(self._inbox), self._scratch,
                   list(self._receiving), sends))
        for peer in [*self._peers, *self._retired]:
            peer.ep = None
        for name in ("_peers", "_retired", "_by_instance", "_early", "_serves", "_live",
                     "_ghosts"):
            getattr(self, name).clear()
        self._inbox.clear()
        self._drains.clear()
        self._receiving.clear()
        self._orphans.clear()
        self._loose.clear()
        self._scratch = None
        self._worker = None
        self._ctx = None


def _leak(obj: object) -> None:
    """Keep ``obj`` alive for the life of the process (UCX may still touch its memory)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
