"""The ``ucx`` data transport: two-sided UCX tag messaging over ucxx, host memory (wire 2).

ucxx's Python API has no RMA (no memory map, rkey or get), so the producer's transport serves
a read with tagged sends. **The consumer owns every write into its region**:

1. The consumer's ``read_blocks(producer, local, remote)`` cuts the read into runs contiguous
   on both sides (:func:`~p2pkv_ucx.runs.plan_runs`), numbers it (``link``, ``rid``, see
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

Threading and progress: no progress thread. ``poll``/``progress`` call ``worker.progress()``
on the caller's (driver) thread; ucxx never calls back into Python here. Nothing blocks
except ``remove_peer`` and ``close``, which progress unfinished *sends* for at most
``drain_timeout``; reads never wait.

Cost of a pump: O(runs being received + sends being served + peers); reads whose data has not
started arriving cost nothing, however many are outstanding. ``poll`` adds its expired reads
(found oldest first: one timeout, so registration order is deadline order).

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
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple

import numpy as np
import numpy.typing as npt
from p2pkv.contracts import (
    EMPTY_POLL,
    Capabilities,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import (
    ConfigError,
    PeerRejected,
    TransferSubmitError,
    TransportUnavailable,
)
from p2pkv.logs import module_logger

from p2pkv_ucx import library, tags, wire
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.runs import plan_runs

__all__ = ["UcxDataTransport"]

log = module_logger(__name__)

IntArray = npt.NDArray[np.int64]
Bytes = npt.NDArray[np.uint8]
_OK = 0
_BATCH = 256
"""Messages taken from UCX per kind per pump (the rest wait for the next pump)."""
_EARLY_LIMIT = 64
"""Notices kept per not-yet-added sender, and senders kept (older ones are dropped)."""
_GHOST_LINGER = 60.0
"""Seconds an ended read's runs are awaited when reads have no deadline (``transfer_timeout``
0); otherwise until the read's own deadline."""
MAX_BLOCKS = 1 << 32
"""Blocks a region may hold (indexes travel as uint32)."""


@dataclass(eq=False)
class _Peer:
    peer_id: str
    desc: wire.Descriptor
    ep: Any
    link: int
    """Our id for this peer in the DATA tags of the runs it serves us (moves on before its
    read ids wrap)."""
    max_run: int
    """Blocks per message between us: the smaller of both sides' ``max_run``."""
    next_rid: int = 0
    dead: bool = False
    reads: dict[int, _Read] = field(default_factory=dict)
    """Our live reads from it."""
    finished: dict[int, bool] = field(default_factory=dict)
    """Our ended reads from it that ``poll`` has not reported yet (id -> done)."""
    serves: dict[int, _Serve] = field(default_factory=dict)
    """Internal transfers: our sends serving its reads of our region."""
    ghosts: dict[int, _Ghost] = field(default_factory=dict)
    """Our ended reads from it whose runs it may still send (by read key, see ``_Ghost``)."""
    drains: list[Any] = field(default_factory=list)
    """Our receives draining its runs of ghosts into scratch (kept while it is retired)."""


@dataclass(eq=False)
class _Read:
    tid: int
    peer: _Peer
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

    @property
    def key(self) -> int:
        return tags.read_key(tags.data_tag(self.link, self.rid, 0))


@dataclass(eq=False)
class _Serve:
    """Our sends serving one READ of a peer (an internal transfer: nobody is told)."""

    tid: int
    peer: _Peer
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
            if status != _OK and self.error is None:
                self.error = f"UCX status {status}"
            self.front += 1
        return self.front == len(reqs)


@dataclass(eq=False)
class _Ghost:
    """An ended read whose runs the producer may still be sending.

    The producer cannot take back a send it posted, and a rendezvous send completes only
    once *we* took part (matched it and answered through our endpoint to the producer). So
    its runs are still drained (into scratch, never the region) and counted, and a removed
    peer keeps its endpoint until every run arrived or ``deadline`` passed; releasing it
    earlier would leave the producer's sends hanging until its drain deadline."""

    peer: _Peer
    taken: npt.NDArray[np.bool_]
    """Runs that arrived (staged while the read was live, or drained since)."""
    left: int
    deadline: float


class _Receive(NamedTuple):
    read: _Read
    run: int
    request: Any
    buffer: Bytes


class _Staging:
    """Staging buffers: the bytes live reads hold (bounded) and a pool of idle buffers.

    ``used`` counts the buffers of live reads' runs being received; a read that ends gives its
    share back at once (``release``), while its buffers stay with UCX until it lets go of
    them (``recycle``), so a stuck peer cannot starve the others' reads.
    """

    def __init__(self, block_len: int, budget: int, largest: int) -> None:
        self.block_len = block_len
        self.largest = largest
        self.budget = max(budget, largest)
        self.used = 0
        self._idle: dict[int, list[Bytes]] = {}
        self._idle_bytes = 0

    def room(self) -> bool:
        """True when a message of the largest size fits the budget."""
        return self.used + self.largest <= self.budget

    def take(self, blocks: int) -> Bytes:
        """A buffer of ``blocks`` blocks, counted as used."""
        nbytes = blocks * self.block_len
        self.used += nbytes
        idle = self._idle.get(blocks)
        if idle:
            self._idle_bytes -= nbytes
            return idle.pop()
        return np.empty(nbytes, np.uint8)

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` as used (their buffers come back through ``recycle``)."""
        self.used -= nbytes

    def recycle(self, buf: Bytes) -> None:
        """Keep a buffer UCX no longer touches for reuse (up to the budget of idle bytes)."""
        if self._idle_bytes + buf.nbytes <= self.budget:
            self._idle.setdefault(buf.nbytes // self.block_len, []).append(buf)
            self._idle_bytes += buf.nbytes


class UcxDataTransport(DataTransport):
    """``DataTransport`` over ucxx tag send/receive (see the module docstring)."""

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

    @classmethod
    def create(cls, settings: DataSettings) -> UcxDataTransport:
        options = UcxOptions.from_mapping(settings.options)
        region = settings.region
        if settings.block_len < 1:
            raise ConfigError(f"block_len must be positive, got {settings.block_len}")
        if region.readonly or not region.c_contiguous or region.ndim != 1:
            raise ConfigError("the ucx transport needs a writable, 1-D, C-contiguous region")
        if region.nbytes == 0 or region.nbytes % settings.block_len:
            raise ConfigError(
                f"region of {region.nbytes} bytes is not a whole number of "
                f"{settings.block_len}-byte blocks"
            )
        if settings.num_blocks > MAX_BLOCKS:
            raise ConfigError(
                f"the ucx transport addresses at most {MAX_BLOCKS} blocks, the region has "
                f"{settings.num_blocks}: use larger blocks"
            )
        return cls(settings, options, library.load())

    def __init__(self, settings: DataSettings, options: UcxOptions, lib: library.Ucxx) -> None:
        api = lib.api
        self._opts = options
        self._lib = lib
        self._tag = api.UCXXTag
        self._mask = api.UCXXTagMask
        self._array = lib.array
        self._block_len = settings.block_len
        self._num_blocks = settings.num_blocks
        self._blocks: npt.NDArray[np.uint8] | None = np.frombuffer(
            settings.region.cast("B"), np.uint8
        ).reshape(self._num_blocks, self._block_len)
        address = self._start_ucx(api, options)
        self._max_run = (
            max(1, options.max_message_bytes // self._block_len) if options.coalesce else 1
        )
        self._instance = secrets.randbits(62) | 1
        self._descriptor = wire.encode_descriptor(wire.Descriptor(
            address, self._instance, self._num_blocks, self._block_len,
            self._max_run, options.endpoint_error_handling,
        ))
        self._timeout = options.transfer_timeout if options.transfer_timeout > 0 else math.inf
        self._ids = itertools.count(1)
        self._links = itertools.count(1)
        self._peers: dict[str, _Peer] = {}
        self._retired: dict[str, list[_Peer]] = {}
        """Removed peers whose serving sends are still live (their endpoints stay)."""
        self._by_instance: dict[int, _Peer] = {}
        self._early: dict[int, list[wire.Notice]] = {}
        self._reads: dict[int, _Read] = {}
        """Live reads by id, in registration order (= deadline order, see ``_expire``)."""
        self._live: dict[int, _Read] = {}
        """Live reads by (link, rid) key: what an arriving DATA message may belong to."""
        self._unreported: dict[int, _Peer] = {}
        self._ghosts: dict[int, _Ghost] = {}
        """Ended reads whose runs may still arrive, by read key, in order of ending."""
        self._serves: dict[int, _Serve] = {}
        self._pending: dict[tuple[int, int, int], tuple[_Peer, wire.Read]] = {}
        """READs of this pump's notices, served after the batch (a CANCEL may follow)."""
        self._receiving: list[_Receive] = []
        self._staging = _Staging(self._block_len, options.staging_bytes,
                                 self._max_run * self._block_len)
        self._inbox: deque[tuple[Any, Bytes]] = deque()
        self._drains: list[Any] = []
        self._scratch: Bytes | None = None
        self._orphans: list[_Serve] = []
        self._loose: list[tuple[Any, Any]] = []
        self._control_limit = 64 + 12 * self._num_blocks
        self._closing = False
        self._closed = False
        self._undrained: list[int] = []

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

    # -- shape and peers --------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def descriptor(self) -> bytes:
        return self._descriptor

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        """Register a peer; re-adding it with the same descriptor and a live endpoint keeps
        it, anything else (another incarnation, a failed endpoint) makes a fresh one."""
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the ucx transport is closed")
        desc = self._check_descriptor(peer_id, descriptor)
        known = self._peers.get(peer_id)
        if known is not None:
            if known.desc == desc and not known.dead and known.ep.alive:
                return
            # Another incarnation, or the same one behind a failed endpoint (it was paused or
            # cut off past UCX's keepalive and came back): a fresh endpoint, never the dead one.
            self.remove_peer(peer_id)
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
        peer = _Peer(peer_id, desc, ep, link, min(self._max_run, desc.max_run))
        self._control_limit = max(self._control_limit, 64 + 12 * desc.num_blocks)
        self._peers[peer_id] = peer
        self._by_instance[desc.instance] = peer
        for notice in self._early.pop(desc.instance, []):
            self._on_notice(notice)
        self._serve_pending()

    def _check_descriptor(self, peer_id: str, descriptor: bytes) -> wire.Descriptor:
        try:
            desc = wire.decode_descriptor(descriptor)
        except ValueError as exc:
            raise PeerRejected(f"peer {peer_id!r}: {exc}") from None
        if desc.block_len != self._block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self._block_len})"
            )
        if desc.error_handling != self._opts.endpoint_error_handling:
            raise PeerRejected(
                f"peer {peer_id!r}: endpoint_error_handling is {desc.error_handling} there and "
                f"{self._opts.endpoint_error_handling} here; UCX cannot connect the two modes "
                f"(set the same data option on every peer)"
            )
        return desc

    def remove_peer(self, peer_id: str) -> list[int]:
        """End our reads from the peer at once (final, never reported, the peer is told to
        skip them); progress our sends serving its reads up to ``drain_timeout`` and return
        the ids of those still live (the peer's endpoint stays until UCX is done with them)."""
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return []
        if self._by_instance.get(peer.desc.instance) is peer:
            del self._by_instance[peer.desc.instance]
        ended = list(peer.reads.values())
        for read in ended:
            self._end(read, None)
        for tid in peer.finished:
            self._unreported.pop(tid, None)
        peer.finished.clear()
        self._tell_cancelled(ended)
        kept = self._drain(list(peer.serves.values()))
        if peer.ep is not None and not self._releasable(peer):
            # Kept until its sends drained and the runs it still sends us arrived (ghosts).
            self._retired.setdefault(peer_id, []).append(peer)
        elif peer.ep is not None:
            self._release(peer)
        return kept

    # -- reads ------------------------------------------------------------------------------

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Send the peer a READ for ``remote_idxs`` (cut into runs); the runs land in
        ``local_idxs`` in later pumps. Everything is checked before anything is sent."""
        peer = self._active(peer_id)
        dst = _indexes(local_idxs, self._num_blocks, "local")
        src = _indexes(remote_idxs, peer.desc.num_blocks, "remote")
        if len(dst) != len(src):
            raise TransferSubmitError(f"{len(dst)} local but {len(src)} remote block indexes")
        if not len(dst):
            raise TransferSubmitError("a read needs at least one block")
        if len(dst) > tags.MAX_RUNS:
            raise TransferSubmitError(f"at most {tags.MAX_RUNS} blocks per read")
        if _has_duplicates(dst):
            raise TransferSubmitError("a local block index appears twice in one read")
        starts, dsts, lengths = plan_runs(src, dst, peer.max_run)
        link, rid = self._next_rid(peer)
        payload = wire.encode_read(self._instance, link, rid, starts, lengths)
        try:
            self._loose.append(self._notify(peer, payload))
        except Exception as exc:
            raise TransferSubmitError(
                f"peer {peer_id!r}: UCX refused to send the read ({type(exc).__name__}: {exc})"
            ) from None
        read = _Read(next(self._ids), peer, time.monotonic() + self._timeout, link, rid,
                     dsts, lengths, np.zeros(len(lengths), np.bool_))
        self._reads[read.tid] = read
        self._live[read.key] = read
        peer.reads[read.tid] = read
        return read.tid

    def progress(self) -> None:
        """Serve peers' reads and take arriving runs; reports nothing."""
        if not self._closed:
            self._pump()

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Pump, fail expired reads, and report (once) the ended reads of ``peer_id``."""
        if self._closed:
            return EMPTY_POLL
        self._pump()
        self._expire(time.monotonic())
        if peer_id is None:
            peers = list(self._peers.values())
        else:
            one = self._peers.get(peer_id)
            peers = [one] if one is not None else []
        done: list[int] = []
        failed: list[int] = []
        for peer in peers:
            if peer.finished:
                for tid, ok in peer.finished.items():
                    (done if ok else failed).append(tid)
                    del self._unreported[tid]
                peer.finished.clear()
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        """End reads at once (final: their runs can only land in staging from now on) and
        tell their producers to skip what they have not sent. Never blocks."""
        ended: list[_Read] = []
        for tid in transfer_ids:
            read = self._reads.get(tid)
            if read is not None:
                self._end(read, None)
                ended.append(read)
                continue
            peer = self._unreported.pop(tid, None)
            if peer is not None:
                del peer.finished[tid]
        self._tell_cancelled(ended)

    def close(self) -> list[int]:
        """End every read, drain our serving sends up to ``drain_timeout``, then release UCX
        and the region; if a send is still live, return the ids and keep both on purpose."""
        if self._closed:
            return list(self._undrained)
        self._closing = True  # no CANCELs: they would outlive us
        for read in list(self._reads.values()):
            self._end(read, None)
        for peer in self._peers.values():
            peer.finished.clear()
        self._unreported.clear()
        self._pending.clear()
        kept = self._drain(list(self._serves.values()))
        self._closed = True
        self._orphans = [s for s in self._orphans if not s.settle()]
        undrained = sorted({*kept, *(s.tid for s in self._orphans)})
        self._undrained = undrained
        if undrained:
            log.warning(
                "ucx transport closed with %d sends UCX has not released; keeping its "
                "region and UCX objects alive on purpose", len(undrained)
            )
            _leak(self)
        else:
            self._teardown()
        return list(undrained)

    # -- internals: reads -------------------------------------------------------------------

    def _active(self, peer_id: str) -> _Peer:
        if self._closed:
            raise TransferSubmitError("the ucx transport is closed")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        if not peer.dead and not peer.ep.alive:
            self._mark_dead(peer)
        if peer.dead:
            raise TransferSubmitError(f"peer {peer_id!r} is unreachable (UCX endpoint failed)")
        return peer

    def _next_rid(self, peer: _Peer) -> tuple[int, int]:
        """The (link, rid) of a new read from ``peer``; a fresh link before rids wrap."""
        if peer.next_rid >= tags.RID_LIMIT:
            link = next(self._links)
            if link > tags.MAX_LINK:
                raise TransferSubmitError("link ids exhausted; recreate the transport")
            peer.link, peer.next_rid = link, 0
        rid = peer.next_rid
        peer.next_rid += 1
        return peer.link, rid

    def _end(self, read: _Read, outcome: bool | None, *, coming: bool = True) -> None:
        """Forget a live read (once): its later runs are drained, its runs being received
        land in staging only. ``outcome`` (done / failed) is kept for ``poll``; None: never
        reported. ``coming``: its producer may still send runs it has not sent yet (not
        after a REFUSE), so they are awaited as a ghost (drained, see ``_Ghost``)."""
        if read.ended:
            return
        read.ended = True
        del self._reads[read.tid]
        del self._live[read.key]
        peer = read.peer
        del peer.reads[read.tid]
        self._staging.release(read.staged)
        read.staged = 0
        left = len(read.taken) - int(np.count_nonzero(read.taken))
        if coming and left and not self._closing and not peer.dead and peer.ep is not None:
            deadline = read.deadline if math.isfinite(read.deadline) else (
                time.monotonic() + _GHOST_LINGER)
            ghost = _Ghost(peer, read.taken, left, deadline)
            self._ghosts[read.key] = ghost
            peer.ghosts[read.key] = ghost
        if outcome is not None:
            read.peer.finished[read.tid] = outcome
            self._unreported[read.tid] = read.peer

    def _fail(self, read: _Read, reason: str, *, coming: bool = True) -> None:
        log.info("ucx: read %d from peer %r failed: %s", read.tid, read.peer.peer_id, reason)
        self._end(read, False, coming=coming)
        self._tell_cancelled([read])

    def _tell_cancelled(self, reads: Iterable[_Read]) -> None:
        """CANCEL ended reads at their producers (a hint: they skip what they have not sent)."""
        if self._closing:
            return
        groups: dict[tuple[int, int], list[_Read]] = {}
        for read in reads:
            groups.setdefault((id(read.peer), read.link), []).append(read)
        for batch in groups.values():
            peer = batch[0].peer
            if not peer.dead and peer.ep is not None:
                rids = np.array([r.rid for r in batch], np.int64)
                self._send_notice(peer, wire.encode_cancel(self._instance, batch[0].link, rids))

    def _expire(self, now: float) -> None:
        """Fail reads past their deadline. Reads are registered in deadline order (one
        timeout for all), so the scan stops at the first unexpired one."""
        expired: list[_Read] = []
        for read in self._reads.values():
            if read.deadline >= now:
                break
            expired.append(read)
        for read in expired:
            self._fail(read, "timed out")

    def _mark_dead(self, peer: _Peer) -> None:
        peer.dead = True
        for read in list(peer.reads.values()):
            self._fail(read, "peer unreachable (UCX endpoint failed)")
        self._drop_ghosts(peer)

    def _drop_ghosts(self, peer: _Peer) -> None:
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
        for peer in self._peers.values():
            if (peer.reads or peer.serves) and not peer.dead and not peer.ep.alive:
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
            nbytes = blocks * self._block_len
            if found.length == nbytes:
                buf = self._staging.take(blocks)
                try:
                    req = self._worker.tag_recv_with_handle(self._array(buf), found)
                except Exception as exc:
                    self._staging.release(nbytes)
                    self._staging.recycle(buf)
                    self._fail(read, f"UCX refused a receive ({type(exc).__name__}: {exc})")
                    return
                read.taken[run] = True
                read.staged += nbytes
                self._receiving.append(_Receive(read, run, req, buf))
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
            self._scratch = np.empty(self._max_run * self._block_len, np.uint8)
        sink = self._scratch[: max(1, min(found.length, len(self._scratch)))]
        req = self._worker.tag_recv_with_handle(self._array(sink), found)
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
                if req.status != _OK:
                    self._fail(read, f"UCX status {req.status} receiving run {r.run}")
                else:
                    self._copy(read, r.run, r.buffer)
            staging.recycle(r.buffer)
        self._receiving = still

    def _copy(self, read: _Read, run: int, buf: Bytes) -> None:
        assert self._blocks is not None
        start, n = int(read.dst[run]), int(read.lengths[run])
        self._blocks[start:start + n] = buf.reshape(n, self._block_len)
        read.landed += 1
        if read.landed == len(read.lengths):
            self._end(read, True)

    def _handle_inbox(self) -> None:
        inbox = self._inbox
        while inbox and inbox[0][0].completed:
            req, buf = inbox.popleft()
            try:
                if req.status != _OK:
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
        pending, self._pending = self._pending, {}
        served = False
        for peer, notice in pending.values():
            if self._peers.get(peer.peer_id) is peer and not peer.dead:
                served = self._serve(peer, notice) or served
        return served

    def _serve(self, peer: _Peer, notice: wire.Read) -> bool:
        """Send each run of a peer's READ from our region (an internal transfer)."""
        problem = self._read_problem(notice)
        if problem is not None:
            log.warning("ucx: refusing a read of peer %r: %s", peer.peer_id, problem)
            self._send_notice(
                peer, wire.encode_refuse(self._instance, notice.link, notice.rid, problem)
            )
            return False
        assert self._blocks is not None
        serve = _Serve(next(self._ids), peer, time.monotonic() + self._timeout)
        self._serves[serve.tid] = serve
        peer.serves[serve.tid] = serve
        send, array, tag, blocks = peer.ep.tag_send, self._array, self._tag, self._blocks
        first = tags.data_tag(notice.link, notice.rid, 0)
        try:
            for run, (s, n) in enumerate(zip(
                notice.starts.tolist(), notice.lengths.tolist(), strict=True
            )):
                serve.requests.append(send(array(blocks[s:s + n]), tag(first | run)))
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
        if int((notice.starts + notice.lengths).max()) > self._num_blocks:
            return f"blocks outside 0..{self._num_blocks - 1}"
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

    def _forget_serve(self, serve: _Serve) -> None:
        del self._serves[serve.tid]
        peer = serve.peer
        del peer.serves[serve.tid]
        if self._peers.get(peer.peer_id) is not peer and self._releasable(peer):
            self._release(peer)

    def _releasable(self, peer: _Peer) -> bool:
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
        for peers in list(self._retired.values()):
            for peer in list(peers):
                if self._releasable(peer):
                    self._release(peer)

    def _drain(self, serves: list[_Serve]) -> list[int]:
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

    def _send_notice(self, peer: _Peer, payload: bytes) -> None:
        """Send a NOTICE nobody waits for (its payload is kept until UCX is done with it)."""
        try:
            self._loose.append(self._notify(peer, payload))
        except Exception as exc:  # a failed endpoint: the peer learns nothing, deadlines rule
            log.info("ucx: notice to peer %r not sent: %s", peer.peer_id, exc)

    def _notify(self, peer: _Peer, payload: bytes) -> tuple[Any, Bytes]:
        data = np.frombuffer(payload, np.uint8)
        return peer.ep.tag_send(self._array(data), self._tag(tags.kind_tag(tags.NOTICE))), data

    def _release(self, peer: _Peer) -> None:
        """Drop a removed peer whose sends are all gone (its endpoint closes on release)."""
        retired = self._retired.get(peer.peer_id)
        if retired is not None and peer in retired:
            retired.remove(peer)
            if not retired:
                del self._retired[peer.peer_id]
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
        for peer in [*self._peers.values(), *(p for ps in self._retired.values() for p in ps)]:
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
        self._blocks = None
        self._worker = None
        self._ctx = None


def _indexes(values: Sequence[int], bound: int, what: str) -> IntArray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.empty(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TransferSubmitError(f"{what} block indexes must be a flat sequence of integers")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= bound)
    if bad.any():
        raise TransferSubmitError(
            f"{what} block index {int(arr[bad][0])} is outside 0..{bound - 1}"
        )
    return arr


def _has_duplicates(arr: IntArray) -> bool:
    return len(arr) > 1 and len(np.unique(arr)) != len(arr)


def _leak(obj: object) -> None:
    """Keep ``obj`` alive for the life of the process (UCX may still touch its memory)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
