"""The ``nixl`` data transport: reads of peers' regions into ours, posted by us.

Wire 2.0: the consumer owns every write into its region. The only transfers that land in our
region are the reads ``read_blocks`` posts (a direct READ, or the copy out of our staging pool
of a staged read); a peer's transport only serves them.

Layout: one NIXL agent per transport, named by a fresh uuid; the caller's region registered
as DRAM in slices of at most ``slice_bytes`` (one NIXL registration each, advertised in the
descriptor, :mod:`p2pkv_nixl.slices`); one prepared descriptor list for it
(``NIXL_INIT_AGENT``) and one per peer registration, both in NIXL's strided form (one row per
slice however many blocks), which the staged lane's WRITEs use (NIXL merges contiguous indexes
into larger descriptors itself, within a row: never across a slice). Direct READs post one
descriptor per run of blocks consecutive on both sides, cut at both sides' slice boundaries.

Lanes, chosen per peer at ``add_peer`` (:meth:`NixlDataTransport.lane`; data option
``staging``):

- ``direct``: the READ lands in our slots. ``auto`` picks it only when the peer is on this
  host (same boot id, hostname and PID namespace, carried in the descriptor) and both sides'
  UCX has its ``cma`` transport (:mod:`p2pkv_nixl.locality`): then our own process executes
  the READ (``process_vm_readv`` within our UCX progress), even while the peer is stopped,
  and releasing the handle stops it: nothing of it can land afterwards.
- ``staged``: the bytes land in the staging pool and are copied into the slots only after a
  valid completion (:mod:`p2pkv_nixl.staging`, which also states the quarantine rule for
  cancelled staged reads). Any lane where the bytes come from the peer's side (``tcp`` across
  or within hosts, RDMA) keeps delivering after a release, so ``auto`` stages there.

Staged reads are WRITEs by the producer, asked for by the consumer; no READ is posted on this
lane. Why: over ``tcp`` UCX emulates a READ (GET) in software and the *producer's* worker sends
the reply as an internal request; when the consumer died, that send fails and UCX 1.21 aborts
the producer (``ucp_request.inl``: "Fatal: unexpected error", from ``ucp_progress_get_reply``):
a consumer killed mid-read killed its producer. A WRITE is the producer's own request, which
UCX completes with an error instead. The protocol, all NIXL notifications (``send_notif`` /
``get_new_notifs``, progressed by ``progress``/``poll``):

1. ``read_blocks`` takes pool blocks and sends the producer's agent a request (``p2kvR2``,
   :mod:`p2pkv_nixl.wire`): request id (an internal id), our pool's base, size, block
   length and slice size, the producer's source indexes and our pool indexes as packed
   little-endian uint32 arrays (8 bytes a block), and the pool's partial NIXL metadata (its
   remote keys, ~200 B; the pool is registered after our descriptor was made, so the producer
   loads it from the request, once per loaded agent).
2. The producer's ``progress`` serves requests from agents of peers currently added there;
   a request from the agent of a peer removed here (kept loaded for that, the last
   :data:`_FORMER_AGENTS` of them) is answered ``p2kvF1`` at once, so a consumer's request
   sent after its session ended (a pause, a partition) ends its quarantine; anyone else is
   ignored, logged once. It checks every field (block length, sizes, every index
   in range), loads the pool metadata, and posts a WRITE from its region into our pool whose
   completion notification (``p2kvD1`` + id) NIXL sends when the WRITE is done. A request it
   cannot serve, or a WRITE that fails, is answered ``p2kvF1`` + id + reason; nothing
   malformed raises. Its WRITEs are internal transfers: never reported by its ``poll``,
   drained by its ``remove_peer``/``close`` and returned by them when they do not drain.
3. Our ``progress`` takes the completion; ``poll`` then copies a live read from the pool into
   the slots (one fancy-indexed copy) and reports it done; a failure fails it. A cancelled
   read's blocks stay quarantined until its completion or failure arrives (or the producer's
   agent is reported disconnected), and are never copied.

When the producer dies the consumer's requests get no answer: while requests are outstanding
``progress`` pings each producer they wait for (``p2kvP1``, ignored by its target) every
:data:`_PING_INTERVAL`, and NIXL raises ``nixlRemoteDisconnectError`` once UCX has failed the
endpoint; its reads then fail and its quarantines end. A staged peer's ``add_peer`` warm-up is
such a ping too (a READ would be a GET again). Both sides must add each other (p2pkv always
does): a producer serves only agents it added.

Finality (``cancel``, ``remove_peer``, re-adding a peer, ``close``): a direct read is posted
only once the peer's connection is wired up (its warm-up READ ended ``DONE``; until then the
read is held, unposted, and ending it is final at once), because UCX queues a GET on an
endpoint still wiring up and runs it later, and releasing the handle does not dequeue it (NIXL
calls ``ucp_request_cancel``, a no-op for a GET). A posted direct read's handle is released;
should NIXL refuse (it could not cancel), ``cancel`` drives our worker up to
``drain_timeout`` and releases once the read ended (on ``cma`` it ends by our own progress);
one still running then can only be on a non-``cma`` lane, which ``auto`` never reads directly
from: it is kept aside, logged as an error, and its bytes may land (with ``staging: never``
finality is the operator's responsibility; a warning is logged at create). A staged read is
quarantined: it never touches the slots. Ended ids are never reported.

Bookkeeping: the :class:`~p2pkv.contracts.DataTransport` base owns transfer ids, the
per-peer read tables, exactly-once reports, the index check (a remote index may repeat, on
both lanes), the re-add rule and the after-close rule; this module implements its primitives
and keeps what NIXL needs beyond them (:mod:`p2pkv_nixl.records`): each ``add_peer``'s record
lives on after the base detached it while its warm-up, serving WRITEs or quarantined reads
still run, and is released by ``progress`` once they ended.

Threading: every NIXL call is made on the caller's (driver) thread; this module starts no
thread. With ``enable_prog_thread`` off (the default) nothing progresses NIXL's worker except
``progress()``/``poll()``: over ``tcp`` a peer that stops calling them stalls our reads from it
(its worker serves them), over ``cma`` it does not (ours does the copy).

Failure: a peer whose process died makes NIXL raise ``nixlRemoteDisconnectError``, at submit,
when a read's state is checked, or when a staged request or probe is sent; every read from
that peer then fails (at its next ``poll``) and the peer must be added again (with a fresh
descriptor: agent names are never reused). An error while checking a read fails that read; it
is never left in flight (a staged one is quarantined).

Internal transfers (ids from the base's sequence, never reported by ``poll``): the connection
warm-up READ of a direct peer's ``add_peer`` (it lands in an 8-byte scratch buffer), the
WRITEs serving peers' staged reads, quarantined reads, and handles NIXL refused to release
after they ended. ``remove_peer`` waits up to ``drain_timeout`` for the peer's warm-ups and
serving WRITEs and returns those still running; it neither waits for nor returns quarantined
reads (they write only into our pool, and the peer's registration they need, which keeps its
agent loaded so its completions still arrive, is released by ``progress`` once they end).
``close`` waits for all of them and
returns what still runs; then the agent, region, scratch and pool stay registered (held in a
module-level list so that not even garbage collection frees them under a transfer). Such a
leaked transport is drained further by the ``progress`` of any open transport on the same
thread (its own ``progress`` and a second ``close`` do nothing, as for every closed data
transport), and released once nothing runs. A clean ``close`` destroys the agent, so its peers see
a disconnect rather than a silent endpoint, unless a peer may still be reading from us through
our own UCX worker (any lane but ``cma``): then the agent is retained, idle, for the process
lifetime, because destroying a worker that serves such reads crashes UCX (see ``close``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from collections.abc import Iterable
from typing import Any, ClassVar

import numpy as np
from p2pkv.contracts import Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError, TransportUnavailable
from p2pkv.logs import module_logger
from p2pkv.runs import coalesce, per_slice, slice_counts, slice_starts

from p2pkv_nixl import library, wire
from p2pkv_nixl.agent import block_dlist, open_agent, register_region
from p2pkv_nixl.descriptor import MAX_BLOCKS, RegionDescriptor
from p2pkv_nixl.locality import cma_usable, host_id
from p2pkv_nixl.open_mark import MarkReader, OpenMark
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.records import Lane, Peer, Read, RemoteAgent, Serving, Strangers
from p2pkv_nixl.runs import descs
from p2pkv_nixl.slices import region_slices
from p2pkv_nixl.staging import StagingPool

__all__ = ["Lane", "NixlDataTransport"]

log = module_logger(__name__)

_LEAKED: list[NixlDataTransport] = []
"""Transports whose ``close`` could not drain: kept alive until they drain (see ``_step``),
else for the process lifetime."""

_RETAINED: list[tuple[Any, ...]] = []
"""Agents a clean ``close`` did not destroy because a remote peer may still be reading from
us through our own UCX worker (see ``NixlDataTransport._shutdown``): each with the buffers it
was registered over, kept for the process lifetime and never progressed again."""

_WARMUP_BYTES = 8
"""Size of a connection warm-up READ (and of the scratch buffer it lands in)."""

_FORMER_AGENTS = 64
"""Agents of removed peers kept loaded, so that a staged request of theirs arriving after the
removal (a consumer resumed from a pause, a healed partition) is answered "failed" and its
quarantine ends at once, instead of being ignored and quarantining pool blocks for ever."""
_PING_INTERVAL = 0.25
"""Seconds between probes of a peer with staged requests outstanding (see ``_probe``)."""


class NixlDataTransport(DataTransport):
    """NIXL data transport; see the module docstring and the README for the options."""

    name: ClassVar[str] = "nixl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True, cross_host=True, memory_kinds=frozenset({"DRAM"})
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> NixlDataTransport:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        self._options = NixlOptions.parse(settings.options)
        super().__init__(settings)
        if self.num_blocks > MAX_BLOCKS:
            raise ConfigError(f"region has more than {MAX_BLOCKS} blocks (NIXL indexes are int32)")
        self._nixl = library.load()
        self._agent, self._agent_name = open_agent(self._nixl, self._options)
        self._host, self._cma = host_id(), cma_usable()  # UCX read the same environment
        self._scratch = np.zeros(_WARMUP_BYTES, dtype=np.uint8)
        """Where warm-up READs land; registered, and kept, exactly as long as the region."""
        self._mark = OpenMark()
        """Holds its token until ``close`` begins (readers on ``cma`` check it after reads)."""
        slices = region_slices(self.num_blocks, self.block_len, self._options.slice_bytes)
        self._slices = slice_starts(slices)
        """The first block of each of our region's registrations (direct READs cut at them)."""
        region = register_region(
            self._agent, self._agent_name, self._blocks.reshape(-1), self.block_len,
            extra=(self._scratch,),
            slices=slices, identity={"host": self._host, "cma": self._cma, "pid": os.getpid(),
                                     "mark": self._mark.address, "token": self._mark.token},
        )
        self._memory = region.registrations
        """NIXL registrations (the region's slices, then scratch), deregistered last."""
        self._local = region.dlist
        self._base = int(self._blocks.ctypes.data)
        self.descriptors_posted: int = 0
        """NIXL descriptors of our reads, by the :mod:`p2pkv_nixl.runs` rule (one per run of
        blocks consecutive on both sides and within one slice of each, so a contiguous read
        within one slice of each side counts 1): a direct read's READ as posted, a staged
        read's WRITE (posted by the producer) as its request asks for it, its source blocks
        against our pool blocks, counted once the request is sent."""
        self._descriptor = region.descriptor
        self._pool: StagingPool | None = None
        """Created by the first staged ``add_peer``."""
        self._agents: dict[str, RemoteAgent] = {}
        self._peers: list[Peer] = []
        """Every peer record not released yet: current ones, and detached ones still busy."""
        self._requests: dict[int, Read] = {}
        """Our staged reads by request id whose answer has not arrived, live or quarantined."""
        self._last_probe = 0.0
        self._strangers = Strangers()
        self._zombies: dict[int, Any] = {}
        """internal id -> a handle NIXL refused to release after it ended (never freed)."""
        self._closing_thread = 0
        """``threading.get_ident()`` of the ``close`` that left this transport undrained."""
        self._progress_failed = False
        self._serves_remote = not self._cma
        """Whether a peer may read from us through our worker (UCX software-emulated GET, e.g.
        over tcp): our UCX lacks ``cma``, or a peer not reachable over ``cma`` was added.
        Decides whether a clean ``close`` may destroy the agent (see ``_shutdown``)."""
        if self._options.staging == "never":
            log.warning(
                "nixl: data option staging='never': every read lands directly in the slots. "
                "Over a lane other than UCX cma (tcp, RDMA) a cancelled read can still land "
                "after cancel returned; keeping that from happening is the operator's "
                "responsibility (use 'auto' unless every peer is same-host over cma)"
            )

    # -- shape ----------------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        """Our NIXL agent's name (a fresh uuid per transport)."""
        return self._agent_name

    def descriptor(self) -> bytes:
        return self._descriptor

    def lane(self, peer_id: str) -> Lane:
        """How reads from ``peer_id`` land: ``"direct"`` (into the slots) or ``"staged"``
        (through the staging pool). ``KeyError`` for a peer not currently added."""
        for peer in self._peers:
            if peer.current and peer.peer_id == peer_id:
                return peer.lane
        raise KeyError(f"unknown peer {peer_id!r}")

    def read_capacity(self, peer_id: str) -> int | None:
        """The staging pool's size for a staged peer (every staged peer's reads share it),
        None for a direct one (reads land straight in the slots). Unknown peer: None."""
        for peer in self._peers:
            if peer.current and peer.peer_id == peer_id:
                if peer.lane != "staged" or self._pool is None:
                    return None
                return self._pool.capacity
        return None

    def staging_usage(self) -> dict[str, int]:
        """The staging pool's blocks: ``capacity`` (0 until a staged peer was added),
        ``free``, and ``quarantined`` (held by cancelled reads NIXL has not ended yet)."""
        pool = self._pool
        if pool is None:
            return {"capacity": 0, "free": 0, "quarantined": 0}
        return {"capacity": pool.capacity, "free": pool.free, "quarantined": pool.quarantined}

    # -- peers ----------------------------------------------------------------------------

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Peer:
        """Decode and load the peer (its agent, its region's list), choose its lane, make the
        staging pool if it is the first staged peer, and start its connection warm-up."""
        desc = RegionDescriptor.decode(descriptor, peer_id)
        if desc.block_len != self.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self.block_len})"
            )
        if desc.agent == self._agent_name:
            raise PeerRejected(f"peer {peer_id!r}: the descriptor is our own")
        lane = self._lane_for(desc)
        if not self._cma_peer(desc):
            self._serves_remote = True  # its reads of us run on our worker
        if lane == "staged":
            self._ensure_pool(peer_id)
        remote = self._load_agent(peer_id, desc)
        try:
            dlist = self._agent.prep_xfer_dlist(
                desc.agent, block_dlist(desc.base, desc.slices, desc.block_len), "DRAM"
            )
        except Exception as exc:
            self._unload_agent(remote)
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL refused its region ({type(exc).__name__}: {exc})"
            ) from exc
        peer = Peer(peer_id, remote, dlist, desc.num_blocks, lane, desc.base,
                    slice_starts(desc.slices))
        if lane == "direct" and desc.mark and self._cma_peer(desc):
            peer.mark = MarkReader(desc.pid, desc.mark, desc.token)
        self._peers.append(peer)
        if self._options.warmup:
            if lane == "staged":
                self._ping(remote, "connection warm-up")
            else:
                self._start_warmup(peer)
        return peer

    def _detach_peer(self, peer: Peer) -> list[int]:
        """A removed peer: wait up to ``drain_timeout`` for the warm-ups and serving WRITEs
        of every record of it and return those still running. A replaced one (the base
        attached its new record first) is not waited for: it goes once quiescent."""
        peer.current = False
        if any(p.current and p.peer_id == peer.peer_id for p in self._peers):
            undrained: list[int] = []
        else:
            undrained = self._drain([p for p in self._peers if p.peer_id == peer.peer_id],
                                    quarantine=False)
        self._retire_idle()
        return undrained

    def _lane_for(self, desc: RegionDescriptor) -> Lane:
        """The ``staging`` option's choice; ``auto``: direct exactly when our own process
        executes the READ (same host and PID namespace, ``cma`` on both sides) and the peer
        has an open mark to check after it (:mod:`p2pkv_nixl.open_mark`)."""
        mode = self._options.staging
        if mode != "auto":
            return "staged" if mode == "always" else "direct"
        return "direct" if self._cma_peer(desc) and desc.mark else "staged"

    def _cma_peer(self, desc: RegionDescriptor) -> bool:
        """Whether reads between us and this peer go over UCX ``cma`` (same host and PID
        namespace, ``cma`` on both sides): each side's own process then executes its reads."""
        return bool(self._host) and desc.host == self._host and self._cma and desc.cma

    def _ensure_pool(self, peer_id: str) -> None:
        if self._pool is not None:
            return
        capacity = min(self._options.staging_blocks, self.num_blocks)
        try:
            self._pool = StagingPool(self._agent, self.block_len, capacity,
                                     per_slice(self._options.slice_bytes, self.block_len))
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r} needs staged reads, but NIXL could not register the staging "
                f"pool ({capacity} blocks of {self.block_len} B, nixl data option "
                f"'staging_blocks'): {type(exc).__name__}: {exc}"
            ) from exc
        log.info("nixl: staging pool of %d blocks (%.1f MiB) registered for staged reads",
                 capacity, capacity * self.block_len / 2**20)

    def _load_agent(self, peer_id: str, desc: RegionDescriptor) -> RemoteAgent:
        remote = self._agents.get(desc.agent)
        if remote is None:
            remote = self._strangers.former.pop(desc.agent, None)
            if remote is not None and remote.metadata == desc.metadata:
                self._agents[desc.agent] = remote  # still loaded: a re-added peer
            elif remote is not None:
                self._quietly(self._agent.remove_remote_agent, remote.name)
                remote = None
        if remote is None:
            remote = self._agents[desc.agent] = self._new_agent(peer_id, desc)
        elif remote.disconnected:
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL agent {desc.agent} disconnected earlier; a restarted "
                f"peer has a new agent name"
            )
        elif remote.metadata != desc.metadata:
            raise PeerRejected(
                f"peer {peer_id!r}: agent {desc.agent} is already known with other metadata"
            )
        remote.users += 1
        return remote

    def _new_agent(self, peer_id: str, desc: RegionDescriptor) -> RemoteAgent:
        """Load an agent we do not know yet from the descriptor's metadata."""
        try:
            loaded = self._agent.add_remote_agent(desc.metadata)
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL cannot load its agent metadata (is it alive and "
                f"reachable?): {type(exc).__name__}: {exc}"
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != desc.agent:
            if name != self._agent_name and name not in self._agents:
                self._quietly(self._agent.remove_remote_agent, loaded)  # only ours to undo
            raise PeerRejected(
                f"peer {peer_id!r}: its metadata names agent {name!r}, its descriptor "
                f"{desc.agent!r}"
            )
        return RemoteAgent(name, desc.metadata)

    def _unload_agent(self, remote: RemoteAgent) -> None:
        """One user fewer; the last one releases the agent's pool list and moves it to the
        former agents (a disconnected one, or one beyond ``_FORMER_AGENTS``, is removed)."""
        remote.users -= 1
        if remote.users:
            return
        del self._agents[remote.name]
        if remote.pool_dlist is not None:
            self._quietly(self._agent.release_dlist_handle, remote.pool_dlist)
            remote.pool_dlist = None
        if remote.disconnected:
            self._quietly(self._agent.remove_remote_agent, remote.name)
            return
        former = self._strangers.former
        former[remote.name] = remote
        while len(former) > _FORMER_AGENTS:
            oldest = former.pop(next(iter(former)))
            self._quietly(self._agent.remove_remote_agent, oldest.name)

    def _ping(self, remote: RemoteAgent, why: str) -> None:
        """Send ``remote`` a notification its transport ignores: it wires the connection up
        (a staged peer's warm-up: no READ, so no GET its worker would serve) or probes it
        (NIXL raises ``nixlRemoteDisconnectError`` once UCX failed the endpoint)."""
        try:
            self._agent.send_notif(remote.name, wire.PING)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(remote)
            else:
                log.debug("nixl: %s of agent %s not sent: %s", why, remote.name, exc)

    def _start_warmup(self, peer: Peer) -> None:
        """Post an 8-byte READ from the peer's region into our scratch: it wires the
        connection up while both sides progress, and touches neither region's contents.
        It is released only once NIXL reports it ended; ending ``DONE`` marks the peer
        ``wired``, which direct reads wait for (see ``_post_read``)."""
        length = min(_WARMUP_BYTES, self.block_len)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs([(int(self._scratch.ctypes.data), length, 0)], "DRAM"),
                self._agent.get_xfer_descs([(peer.base, length, 0)], "DRAM"),
                peer.remote.name,
            )
        except Exception as exc:
            log.warning("nixl: connection warm-up to %s not posted: %s", peer.peer_id, exc)
            return
        peer.warmup = handle
        peer.warmup_id = next(self._transfer_ids)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._warmup_ended(peer, exc)
            return
        if state != "PROC":
            self._warmup_ended(peer, None, state)

    def _check_warmup(self, peer: Peer) -> bool:
        """End the peer's warm-up if NIXL reports it terminal; whether it ended."""
        try:
            state = self._agent.check_xfer_state(peer.warmup)
        except Exception as exc:
            return self._warmup_ended(peer, exc)
        return state != "PROC" and self._warmup_ended(peer, None, state)

    def _warmup_ended(self, peer: Peer, exc: BaseException | None, state: str = "ERR") -> bool:
        """Release an ended warm-up (``DONE``: the peer is ``wired``); False if NIXL refused
        (it is tried again next tick)."""
        if isinstance(exc, self._nixl.remote_disconnect):
            self._disconnected(peer.remote)
        elif exc is not None or state != "DONE":
            log.info("nixl: connection warm-up to %s failed: %s", peer.peer_id, exc or state)
        else:
            peer.wired = True
        try:
            self._agent.release_xfer_handle(peer.warmup)
        except Exception as release_exc:
            log.warning("nixl: warm-up handle of %s not released yet: %s",
                        peer.peer_id, release_exc)
            return False
        peer.warmup = None
        return True

    def _retire_idle(self) -> None:
        """Release the detached peer records that are quiescent."""
        for peer in [p for p in self._peers if not p.current and p.quiescent]:
            self._peers.remove(peer)
            self._quietly(self._agent.release_dlist_handle, peer.dlist)
            self._unload_agent(peer.remote)

    # -- reads ----------------------------------------------------------------------------

    def _post_read(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        """A direct READ into our slots, or a staged read's request to the producer. A staged
        read also takes ``len(local)`` pool blocks, refused (``TransferSubmitError`` naming
        ``staging_blocks``) when too few are free; nothing is posted then.

        A direct read to a peer not ``wired`` yet is *held*, not posted: UCX queues a GET on
        an endpoint still wiring up and executes it once the wire-up completes, and NIXL
        cannot take it back (releasing its handle does not dequeue it), so a read cancelled
        in that window would land later, in slots given to something else. The held read is
        posted by the ``poll`` that first sees the warm-up ``DONE`` (started here if
        ``add_peer`` did not, data option ``warmup``), and fails if the warm-up fails; ending
        it before that is final at once (nothing was posted)."""
        if peer.remote.disconnected:
            raise TransferSubmitError(
                f"peer {peer.peer_id!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT); add it "
                f"again with a fresh descriptor"
            )
        if peer.lane == "staged":
            assert self._pool is not None  # a staged peer made it
            read = Read(peer, local, self._pool.take(len(local)))
            self._request(read, remote)
        else:
            read = Read(peer, local, None)
            if not peer.wired and peer.warmup is None:
                self._start_warmup(peer)
            if peer.wired:
                self._post_direct(read, remote)
            else:
                read.remote = remote
        return read

    def _request(self, read: Read, remote: Indexes) -> None:
        """Ask the peer to WRITE its blocks ``remote`` into our pool blocks ``read.stage``;
        ``TransferSubmitError`` (pool blocks given back) if NIXL does not send it."""
        pool, peer = self._pool, read.peer
        assert pool is not None and read.stage is not None
        read.request = next(self._transfer_ids)
        message = wire.request_message(read.request, pool.base, pool.capacity,
                                       pool.slice_blocks, self.block_len, remote, read.stage,
                                       pool.metadata)
        try:
            self._agent.send_notif(peer.remote.name, message)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(peer.remote)
            pool.give_back(read.stage)
            raise TransferSubmitError(
                f"peer {peer.peer_id!r}: NIXL could not send the staged read request "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        self._requests[read.request] = read
        pool_slices = slice_starts(slice_counts(pool.capacity, pool.slice_blocks))
        stage = read.stage.astype(np.int64)
        self.descriptors_posted += len(coalesce(stage, remote, pool_slices, peer.slices)[2])

    def _post_direct(self, read: Read, remote: Indexes) -> None:
        """Make and post the READ into our slots, one descriptor per run of blocks consecutive
        on both sides; ``TransferSubmitError`` if NIXL refuses, with nothing of it left able
        to land."""
        peer, agent = read.peer, self._agent
        local_starts, remote_starts, lengths = coalesce(read.local, remote, self._slices,
                                                    peer.slices)
        try:
            read.handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(descs(self._base, local_starts, lengths, self.block_len),
                                     "DRAM"),
                agent.get_xfer_descs(descs(peer.base, remote_starts, lengths, self.block_len),
                                     "DRAM"),
                peer.remote.name,
            )
            self.descriptors_posted += len(lengths)
            state = agent.transfer(read.handle)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(peer.remote)
            if read.handle is not None:
                self._end_reads([read])
            raise TransferSubmitError(
                f"peer {peer.peer_id!r}: NIXL could not post the read "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        if state == "ERR":
            self._end_reads([read])
            raise TransferSubmitError(f"peer {peer.peer_id!r}: NIXL failed the read at submit")

    def _read_state(self, read: Read) -> ReadState:
        """A terminal read is released (a staged one copied out of the pool first when it
        succeeded). A disconnect fails it; any other error is the base's (it ends the read)."""
        if read.stage is not None:
            return self._staged_state(read)
        if read.handle is None:
            return self._held_state(read)
        if not read.peer.remote.disconnected:
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as exc:
                if not isinstance(exc, self._nixl.remote_disconnect):
                    raise
                self._disconnected(read.peer.remote)
                state = "ERR"
            if state == "PROC":
                return ReadState.PENDING
        else:
            state = "ERR"
        self._release(read.handle)
        if state == "DONE" and read.peer.mark is not None and not read.peer.mark.holds():
            log.info("nixl: a read from %s failed: the peer closed its region (its open mark "
                     "is cleared), so the bytes read may be its caller's again", read.peer.peer_id)
            return ReadState.FAILED
        return ReadState.DONE if state == "DONE" else ReadState.FAILED

    def _held_state(self, read: Read) -> ReadState:
        """A read held for its peer's wire-up: posted (then checked) once the peer is wired,
        failed once its warm-up ended otherwise or the peer is gone, else pending. A post
        NIXL refuses raises ``TransferSubmitError`` (the base fails the read)."""
        peer = read.peer
        if peer.remote.disconnected or not (peer.wired or peer.warmup is not None):
            log.info("nixl: a read from %s failed: its connection never wired up", peer.peer_id)
            return ReadState.FAILED
        if not peer.wired:
            return ReadState.PENDING
        remote, read.remote = read.remote, None
        assert remote is not None  # held reads keep their peer's indexes
        self._post_direct(read, remote)
        return self._read_state(read)

    def _staged_state(self, read: Read) -> ReadState:
        """Answered: copied into the slots (if ok); peer gone: failed; else pending."""
        pool = self._pool
        assert pool is not None and read.stage is not None
        if not read.ended:
            if not read.peer.remote.disconnected:
                return ReadState.PENDING
            self._requests.pop(read.request, None)  # nothing more of it can arrive
        elif read.ok:
            pool.copy_out(read.stage, self._blocks, read.local)
        pool.give_back(read.stage)
        return ReadState.DONE if read.ended and read.ok else ReadState.FAILED

    def _disconnected(self, remote: RemoteAgent) -> None:
        """The peer process is gone: UCX has failed the endpoint (its operations complete with
        an error, its connection is closed), so nothing more can land from it. Its reads fail
        at their next check, its quarantines end at the next ``progress``."""
        if not remote.disconnected:
            log.warning("nixl: peer agent %s disconnected; failing its reads", remote.name)
        remote.disconnected = True

    def _release(self, handle: Any) -> None:
        """Release a handle NIXL reported terminal; one it refuses is kept aside (an internal
        transfer ``close`` reports) and never freed under NIXL."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            zombie = next(self._transfer_ids)
            log.error("nixl: a read ended but NIXL refused to release it (kept as internal "
                      "transfer %d): %s", zombie, exc)
            self._zombies[zombie] = handle

    # -- progress: the worker, staged requests, serving WRITEs ----------------------------

    def _progress(self) -> None:
        """Drive NIXL's worker (see ``_step``)."""
        self._step()

    def _step(self) -> None:
        """Drive NIXL's worker: ``get_new_notifs`` is the cheapest call that progresses it (a
        few microseconds), and it returns the notifications of staged reads: peers' requests
        (served here with a WRITE, :meth:`_serve`) and the answers to ours (a live read is
        then copied by ``poll``). Then end warm-ups, serving WRITEs and quarantines that
        ended, release detached records left idle, and probe peers our requests wait for.

        An open transport also takes one drain step for each transport that a ``close`` on
        this same thread left undrained (NIXL calls stay on the thread that used the agent):
        what it still runs may need a peer in this process, and a peer that keeps polling ends
        it, so the leaked transport is then released after all, and its peers see it go."""
        if _LEAKED and not self._closed:
            thread = threading.get_ident()
            for leaked in list(_LEAKED):
                if leaked._closing_thread == thread:
                    leaked._drain_step()
        notifications = self._progress_worker()
        if notifications:
            self._notified(notifications)
        ended = False
        for peer in self._peers:
            if peer.warmup is not None:
                ended = self._check_warmup(peer) or ended
            if peer.serving:
                ended = self._check_serving(peer) or ended
            if peer.quarantined:
                ended = self._reap_quarantine(peer) or ended
        if ended:
            self._retire_idle()
        if self._requests:
            self._probe()

    def _progress_worker(self) -> dict[str, list[bytes]]:
        try:
            found: dict[str, list[bytes]] = self._agent.get_new_notifs()
        except Exception as exc:  # a tick must survive a backend hiccup; reads report theirs
            log.log(
                logging.DEBUG if self._progress_failed else logging.WARNING,
                "nixl: progressing the worker failed: %s", exc,
            )
            self._progress_failed = True
            return {}
        return found

    def _notified(self, notifications: dict[str, list[bytes]]) -> None:
        """Dispatch notifications by prefix; anything else (pings, foreign ones) is ignored."""
        for sender, messages in notifications.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for raw in messages:
                message = bytes(raw)
                if message.startswith(wire.REQUEST):
                    self._serve(name, message)
                    continue
                answer = wire.outcome(message)
                if answer is not None:
                    self._request_ended(name, answer)

    def _request_ended(self, sender: str, answer: wire.Outcome) -> None:
        """The producer's completion or failure of our staged read: a live one is copied and
        reported by ``poll``, a cancelled one leaves quarantine. Nothing of its WRITE
        arrives after this."""
        if not answer.ok:
            log.warning("nixl: agent %s failed staged read %d: %s", sender, answer.request,
                        answer.reason)
        read = self._requests.get(answer.request)
        if read is None or read.peer.remote.name != sender:
            log.debug("nixl: completion of unknown staged read %d from %s ignored",
                      answer.request, sender)
            return
        del self._requests[answer.request]
        read.ended, read.ok = True, answer.ok

    def _probe(self) -> None:
        """Every ``_PING_INTERVAL``, ping each peer our staged requests wait for: a dead one
        is then seen as disconnected (its reads fail, its quarantines end) without a READ."""
        now = time.monotonic()
        if now - self._last_probe < _PING_INTERVAL:
            return
        self._last_probe = now
        remotes = {id(read.peer.remote): read.peer.remote for read in self._requests.values()}
        for remote in remotes.values():
            if not remote.disconnected:
                self._ping(remote, "probe")

    def _serving_peer(self, sender: str) -> Peer | None:
        for peer in self._peers:
            if peer.current and peer.remote.name == sender and not peer.remote.disconnected:
                return peer
        return None

    def _serve(self, sender: str, message: bytes) -> None:
        """A peer's staged read request: WRITE our blocks into its pool, the WRITE carrying
        the completion notification. Only a currently added peer is served (its agent is
        loaded; anyone else is ignored, logged once); a malformed or unservable request is
        refused with a failure notification when its id could be read, and logged. Never
        raises: this runs inside every ``progress``."""
        if self._closed:
            return
        peer = self._serving_peer(sender)
        if peer is None:
            self._not_served(sender, message)
            return
        try:
            request = wire.parse_request(message, self.block_len, self.num_blocks)
            handle = self._serving_write(peer.remote, request)
        except wire.Refused as refusal:
            self._refuse(peer, refusal.request, str(refusal))
            return
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(peer.remote)
            else:
                self._refuse(peer, None, f"{type(exc).__name__}: {exc}")
            return
        self._start_serving(peer, handle, request.request)

    def _not_served(self, sender: str, message: bytes) -> None:
        """A request from an agent that is not a current peer: refused explicitly when it is
        a former peer's (its consumer's quarantine then ends), else ignored, logged once."""
        former = self._strangers.former.get(sender)
        request = wire.request_id(message)
        if former is not None and request is not None:
            self._notify_failed(former, request, "stale request: the peer was removed here "
                                "(its session ended); nothing was written")
            return
        if sender not in self._strangers.unknown:
            self._strangers.unknown.add(sender)
            log.warning("nixl: ignoring staged read requests from agent %s: not a peer added "
                        "here (or disconnected)", sender)

    def _serving_write(self, remote: RemoteAgent, request: wire.StagedRequest) -> Any:
        """The WRITE serving ``request`` (not posted yet); ``Refused`` with its id if NIXL
        will not make it (a disconnect is raised as is)."""
        try:
            target = self._remote_pool(remote, request)
            return self._agent.make_prepped_xfer(
                "WRITE", self._local, request.src, target, request.stage,
                notif_msg=wire.DONE + wire.ID.pack(request.request),
            )
        except wire.Refused as refusal:
            raise wire.Refused(str(refusal), request.request) from None
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                raise
            raise wire.Refused(f"{type(exc).__name__}: {exc}", request.request) from exc

    def _start_serving(self, peer: Peer, handle: Any, request: int) -> None:
        """Post a serving WRITE; one still running is an internal transfer of ``peer``."""
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(peer.remote)
            state = "ERR"
            log.warning("nixl: WRITE serving %s's staged read %d not posted: %s",
                        peer.peer_id, request, exc)
        if state == "PROC":
            peer.serving[next(self._transfer_ids)] = Serving(handle, request)
        else:
            self._served(peer, handle, request, state == "DONE")

    def _remote_pool(self, remote: RemoteAgent, request: wire.StagedRequest) -> Any:
        """The peer's staging pool as a prepared remote list (one row per slice of it), its
        metadata loaded first (once per loaded agent: a re-added agent loads it again)."""
        metadata = request.metadata
        if remote.pool_md != metadata:
            loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != remote.name:
                if name != self._agent_name and name not in self._agents:
                    self._quietly(self._agent.remove_remote_agent, name)
                raise wire.Refused(f"its pool metadata names agent {name!r}")
            remote.pool_md = metadata
        key = (request.base, request.capacity, request.slice_blocks)
        if remote.pool_key != key or remote.pool_dlist is None:
            slices = slice_counts(request.capacity, request.slice_blocks)
            dlist = self._agent.prep_xfer_dlist(
                remote.name, block_dlist(request.base, slices, self.block_len), "DRAM"
            )
            if remote.pool_dlist is not None:
                self._quietly(self._agent.release_dlist_handle, remote.pool_dlist)
            remote.pool_dlist, remote.pool_key = dlist, key
        return remote.pool_dlist

    def _refuse(self, peer: Peer, request: int | None, reason: str) -> None:
        log.warning("nixl: refused staged read request %s of peer %s: %s",
                    request, peer.peer_id, reason)
        if request is not None:
            self._notify_failed(peer.remote, request, reason)

    def _notify_failed(self, remote: RemoteAgent, request: int, reason: str) -> None:
        try:
            self._agent.send_notif(
                remote.name, wire.FAILED + wire.ID.pack(request) + reason.encode()[:512]
            )
        except Exception as exc:  # a dead or unreachable peer needs no answer
            log.debug("nixl: failure notification to %s not sent: %s", remote.name, exc)

    def _check_serving(self, peer: Peer) -> bool:
        """End the peer's serving WRITEs NIXL reports terminal (a failed one is answered with
        a failure notification; a done one carried its completion). Whether all ended."""
        for internal_id, serving in list(peer.serving.items()):
            try:
                state = self._agent.check_xfer_state(serving.handle)
            except Exception as exc:
                if not isinstance(exc, self._nixl.remote_disconnect):
                    continue  # proves nothing; checked again next tick
                self._disconnected(peer.remote)
                state = "ERR"
            if state != "PROC":
                del peer.serving[internal_id]
                self._served(peer, serving.handle, serving.request, state == "DONE")
        return not peer.serving

    def _served(self, peer: Peer, handle: Any, request: int, ok: bool) -> None:
        self._release(handle)
        if not ok:
            log.warning("nixl: the WRITE serving staged read %d of peer %s failed",
                        request, peer.peer_id)
            if not peer.remote.disconnected:
                self._notify_failed(peer.remote, request, "the WRITE failed")

    # -- ending reads ---------------------------------------------------------------------

    def _end_reads(self, reads: list[Read]) -> None:
        """End reads finally, within one ``drain_timeout``: a direct one is stopped, a staged
        one quarantined until its answer arrives (or its peer is gone)."""
        deadline = time.monotonic() + self._options.drain_timeout
        for read in reads:
            if read.stage is None:
                self._stop_direct(read, deadline)
                continue
            pool = self._pool
            assert pool is not None
            if read.ended or read.peer.remote.disconnected:
                self._requests.pop(read.request, None)  # nothing more of it can arrive
                pool.give_back(read.stage)
            else:
                pool.quarantine(read.stage)
                self._keep(read)

    def _stop_direct(self, read: Read, deadline: float) -> None:
        """Release a direct read's handle (on ``cma`` that stops it). If NIXL refuses, our
        worker is driven until the read ends, up to ``deadline``; one still running then is
        kept aside and may still land (see the module docstring)."""
        peer = read.peer
        if read.handle is None:
            return  # held, or ended already: nothing of it is posted
        try:
            self._agent.release_xfer_handle(read.handle)
            read.handle = None
            return
        except Exception as exc:
            log.warning("nixl: a cancelled read from %s was not released (%s); driving it to "
                        "its end", peer.peer_id, exc)
        while not self._ended(peer, read.handle):
            if time.monotonic() >= deadline:
                log.error(
                    "nixl: a cancelled direct read from %s still runs after %.1fs: its bytes may "
                    "still land in slots %s (lane %s; only staged reads are final on any lane)",
                    peer.peer_id, self._options.drain_timeout, read.local[:16].tolist(),
                    peer.lane,
                )
                self._keep(read)
                return
            self._progress_worker()
        self._release(read.handle)
        read.handle = None

    def _keep(self, read: Read) -> None:
        """Hold an ended read that may still be written until NIXL reports it ended."""
        read.peer.quarantined[next(self._transfer_ids)] = read

    def _ended(self, peer: Peer, handle: Any) -> bool:
        """Whether NIXL reports ``handle`` terminal (``DONE``/``ERR``, or its peer
        disconnected); any other error proves nothing (False)."""
        try:
            return bool(self._agent.check_xfer_state(handle) != "PROC")
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(peer.remote)
                return True
            return False

    def _reap_quarantine(self, peer: Peer) -> bool:
        """Release the peer's kept reads NIXL now reports ended and free their pool blocks;
        whether none is left."""
        for internal_id, read in list(peer.quarantined.items()):
            if read.handle is None:  # staged: answered, or the peer is gone
                if not (read.ended or peer.remote.disconnected):
                    continue
                self._requests.pop(read.request, None)
            elif not self._ended(peer, read.handle):
                continue
            else:
                self._release(read.handle)
            del peer.quarantined[internal_id]
            if read.stage is not None:
                assert self._pool is not None
                self._pool.give_back(read.stage, quarantined=True)
        return not peer.quarantined

    # -- close ----------------------------------------------------------------------------

    def _drain(self, peers: Iterable[Peer], quarantine: bool) -> list[int]:
        """Progress until the warm-ups and serving WRITEs (and, with ``quarantine``, the kept
        reads) of ``peers`` ended, up to ``drain_timeout``. Returns the ids still running."""
        peers = list(peers)

        def running() -> list[int]:
            return sorted(i for p in peers for i in p.running(quarantine))

        deadline = time.monotonic() + self._options.drain_timeout
        while running() and time.monotonic() < deadline:
            self._step()
        undrained = running()
        if undrained:
            log.error(
                "nixl: %d internal transfer(s) still running after %.1fs drain (%s); their "
                "memory stays registered", len(undrained), self._options.drain_timeout,
                undrained,
            )
        return undrained

    def _shutdown(self) -> list[int]:
        """Drain every record (warm-ups, serving WRITEs, kept reads) up to ``drain_timeout``,
        then release everything, unless something still runs: then the transport is leaked
        (everything stays registered, see the module docstring) and those ids returned.

        Only cancelled staged reads left unanswered can land in the pool alone, never in the
        region: the pool (and the agent) are then kept for good and the rest is released.

        A clean close releases the peers, descriptor lists and memory registrations, and then
        destroys the agent (with its UCX worker) only if no peer can be reading from us through
        that worker. Over a lane other than ``cma`` (tcp) a peer's transfers with us are UCX
        software emulation: a warm-up READ's GET requests, or the WRITEs it serves our staged
        reads with, are handled by *our* worker, which sends the replies (GET data, PUT
        acknowledgements) as internal requests. NIXL exposes nothing about those (no count,
        no way to flush or cancel them), and a peer's cancelled reads keep running on the
        wire, so at any moment some may be queued on our endpoints; destroying the worker then
        frees them under UCX (``... was not returned to mpool ucp_requests``, then a SIGSEGV
        in ``close``). So when a peer might read us that way (our UCX has no ``cma``, or a
        peer not reachable over ``cma`` was ever added), the agent is *retained*, logged: it
        and the buffers it was registered over (region, scratch, pool) are kept alive for the
        process lifetime (:data:`_RETAINED`, with an extra reference so not even interpreter
        shutdown frees them) and it is never progressed again, so no UCX code runs for it
        and nothing it serves can touch freed memory. Its peers then see its endpoints go
        silent rather than disconnect, until this process exits (the kernel closes its
        sockets; they fail their reads by heartbeat or lease before that). With only ``cma``
        peers, each reader's own process executes its reads and the agent is destroyed, so
        its peers see a disconnect. A reader that read us over tcp but was never added here
        is not seen; in p2pkv both sides add each other."""
        self._mark.clear()  # from now on, no peer's read of our region completes
        for peer in self._peers:
            peer.current = False  # the base has ended every read
        undrained = self._drain(self._peers, quarantine=True)
        kept = {q for p in self._peers for q in p.quarantined}
        if undrained and not self._zombies and set(undrained) <= kept:
            log.info("nixl: %d cancelled staged read(s) still unanswered at close; their "
                     "staging pool is kept, with the agent, until the process exits",
                     len(undrained))
            self._serves_remote = True
            self._release_everything()
            return []
        left = self._release_if_drained()
        if left:
            self._closing_thread = threading.get_ident()
            _LEAKED.append(self)
        return left

    def _release_if_drained(self) -> list[int]:
        """Retry the handles NIXL refused to release; then, if nothing runs any more, release
        everything. Returns the internal ids still running (or kept) otherwise."""
        for zombie, handle in list(self._zombies.items()):
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                continue
            del self._zombies[zombie]
        left = sorted({*(i for p in self._peers for i in p.running(True)), *self._zombies})
        if not left:
            self._release_everything()
        return left

    def _drain_step(self) -> None:
        """One non-blocking drain pass of a leaked transport; releases it once nothing runs."""
        self._step()
        self._release_if_drained()

    def _release_everything(self) -> None:
        """Peers, descriptor lists, then memory (pool, scratch, region); drop the agent."""
        self._retire_idle()
        agent = self._agent
        for former in self._strangers.former.values():
            self._quietly(agent.remove_remote_agent, former.name)
        self._strangers.former.clear()
        self._quietly(agent.release_dlist_handle, self._local)
        if self._pool is not None:
            self._quietly(agent.release_dlist_handle, self._pool.dlist)
            self._quietly(agent.deregister_memory, self._pool.registration)
        for registration in reversed(self._memory):
            self._quietly(agent.deregister_memory, registration)
        self._memory.clear()
        if self in _LEAKED:
            _LEAKED.remove(self)
        if self._serves_remote:
            self._retain()
        # Every NIXL handle object holds the agent: with the last one gone, the agent and its
        # UCX worker are destroyed, so peers see a disconnect instead of a silent endpoint.
        del self._agent, self._local, self._scratch
        self._pool = None

    def _retain(self) -> None:
        """Keep the agent and every buffer it was registered over alive for the process
        lifetime, never progressed again (see ``_shutdown``)."""
        kept = (self._agent, self._local, self._blocks, self._scratch, self._pool)
        _RETAINED.append(kept)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # survives interpreter shutdown
        log.info(
            "nixl: agent %s closed but not destroyed: a peer may still be reading from us over "
            "a lane other than cma, served by this agent's UCX worker, and destroying it then "
            "crashes UCX; it is kept, idle, until the process exits (%d kept)",
            self._agent_name, len(_RETAINED),
        )

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        """A best-effort NIXL cleanup call: failures are logged, never raised."""
        try:
            call(*args)
        except Exception as exc:
            log.warning("nixl: %s failed during cleanup: %s", getattr(call, "__name__", call), exc)
