"""The ``nixl`` data transport: reads of peers' regions into ours, posted by us.

Wire 2.0: the consumer owns every write into its region. The only transfers that land in our
region are the reads ``read_blocks`` posts (a direct READ, or the copy out of our staging pool
of a staged read); a peer's transport only serves them.

Layout: one NIXL agent per transport, named by a fresh uuid; the caller's region registered
once as DRAM; one prepared descriptor list for it (``NIXL_INIT_AGENT``) and one per peer
registration, both in NIXL's strided form (one row however many blocks), so a read is a
``make_prepped_xfer("READ", ...)`` over two int32 index arrays plus ``transfer``. NIXL merges
contiguous index runs into larger descriptors itself.

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

1. ``read_blocks`` takes pool blocks and sends the producer's agent a request (``p2kvR1``,
   :data:`_REQUEST_HEAD`): request id (= the read's id), our pool's base, size and block
   length, the producer's source indexes and our pool indexes as packed little-endian uint32
   arrays (8 bytes a block), and the pool's partial NIXL metadata (its remote keys, ~200 B;
   the pool is registered after our descriptor was made, so the producer loads it from the
   request, once per loaded agent).
2. The producer's ``progress`` serves requests from agents of peers currently added there
   (others are ignored, logged once): it checks every field (block length, sizes, every index
   in range), loads the pool metadata, and posts a WRITE from its region into our pool whose
   completion notification (``p2kvD1`` + id) NIXL sends when the WRITE is done. A request it
   cannot serve, or a WRITE that fails, is answered ``p2kvF1`` + id + reason; nothing
   malformed raises. Its WRITEs are internal transfers: never reported by its ``poll``,
   drained by its ``remove_peer``/``close`` and returned by them when they do not drain.
3. Our ``progress`` takes the completion: a live read is copied from the pool into the slots
   (one fancy-indexed copy) and reported done by ``poll``; a failure fails it. A cancelled
   read's blocks stay quarantined until its completion or failure arrives (or the producer's
   agent is reported disconnected), and are never copied.

When the producer dies the consumer's requests get no answer: while requests are outstanding
``progress`` pings each producer they wait for (``p2kvP1``, ignored by its target) every
:data:`_PING_INTERVAL`, and NIXL raises ``nixlRemoteDisconnectError`` once UCX has failed the
endpoint; its reads then fail and its quarantines end. A staged peer's ``add_peer`` warm-up is
such a ping too (a READ would be a GET again). Both sides must add each other (p2pkv always
does): a producer serves only agents it added.

Finality (``cancel``, ``remove_peer``, re-adding a peer, ``close``): a direct read's handle is
released; should NIXL refuse (it could not cancel), ``cancel`` drives our worker up to
``drain_timeout`` and releases once the read ended (on ``cma`` it ends by our own progress);
one still running then can only be on a non-``cma`` lane, which ``auto`` never reads directly
from: it is kept aside, logged as an error, and its bytes may land (with ``staging: never``
finality is the operator's responsibility; a warning is logged at create). A staged read is
quarantined: it never touches the slots. Ended ids are never reported.

Threading: every NIXL call is made on the caller's (driver) thread; this module starts no
thread. With ``enable_prog_thread`` off (the default) nothing progresses NIXL's worker except
``progress()``/``poll()``: over ``tcp`` a peer that stops calling them stalls our reads from it
(its worker serves them), over ``cma`` it does not (ours does the copy).

Failure: a peer whose process died makes NIXL raise ``nixlRemoteDisconnectError``, at submit,
when a read's state is checked, or when a staged request or probe is sent; every read from
that peer then fails at once and the peer must be added again (with a fresh descriptor: agent
names are never reused). An error while checking a read fails that read; it is never left in
flight (a staged one is quarantined).

Internal transfers (ids from the same sequence, never reported by ``poll``): the connection
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
thread, and released once nothing runs. A clean ``close`` destroys the agent, so its peers see
a disconnect rather than a silent endpoint, unless a peer may still be reading from us through
our own UCX worker (any lane but ``cma``): then the agent is retained, idle, for the process
lifetime, because destroying a worker that serves such reads crashes UCX (see ``close``).
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import struct
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar, Literal

import numpy as np
import numpy.typing as npt
from p2pkv.contracts import EMPTY_POLL, Capabilities, DataSettings, DataTransport, PollResult
from p2pkv.errors import PeerRejected, TransferSubmitError, TransportUnavailable
from p2pkv.logs import module_logger

from p2pkv_nixl import library
from p2pkv_nixl.agent import block_dlist, open_agent, region_array, register_region
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.indexes import checked_indexes, refuse_repeats
from p2pkv_nixl.locality import cma_usable, host_id
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.staging import StagingPool

__all__ = ["Lane", "NixlDataTransport"]

log = module_logger(__name__)

Lane = Literal["direct", "staged"]

_LEAKED: list[NixlDataTransport] = []
"""Transports whose ``close`` could not drain: kept alive until they drain (see ``progress``),
else for the process lifetime."""

_RETAINED: list[tuple[Any, ...]] = []
"""Agents a clean ``close`` did not destroy because a remote peer may still be reading from
us through our own UCX worker (see ``NixlDataTransport.close``): each with the buffers it
was registered over, kept for the process lifetime and never progressed again."""

_WARMUP_BYTES = 8
"""Size of a connection warm-up READ (and of the scratch buffer it lands in)."""

_REQUEST = b"p2kvR1"
"""Notification prefix of a staged read request (consumer -> producer), see ``_Request``."""
_DONE = b"p2kvD1"
"""Prefix of the completion notification (the producer's WRITE carries it): + request id."""
_FAILED = b"p2kvF1"
"""Prefix of a failure notification (refused request, failed WRITE): + request id + reason."""
_PING = b"p2kvP1"
"""A notification that only wires up or probes the connection (ignored by its target)."""
_REQUEST_HEAD = struct.Struct("<6sQQIII")
"""prefix, request id, pool base, pool blocks, block_len, count; then ``count`` little-endian
uint32 source indexes, ``count`` uint32 pool indexes, and the pool's partial NIXL metadata."""
_ID = struct.Struct("<Q")
_PING_INTERVAL = 0.25
"""Seconds between probes of a peer with staged requests outstanding (see ``_probe``)."""
_MAX_REQUEST_BLOCKS = 1 << 26
"""A request naming more blocks is refused unread (no pool is that large)."""


class _RemoteAgent:
    """A peer's NIXL agent, loaded once however many registrations use it."""

    __slots__ = ("disconnected", "metadata", "name", "pool_dlist", "pool_key", "pool_md", "users")

    def __init__(self, name: str, metadata: bytes) -> None:
        self.name = name
        self.metadata = metadata
        self.users = 0
        self.disconnected = False
        self.pool_md: bytes | None = None
        """The peer's staging-pool metadata we loaded (serving its staged reads)."""
        self.pool_key: tuple[int, int] | None = None
        self.pool_dlist: Any = None
        """Prepared descriptor list of the peer's staging pool (WRITE target), for ``pool_key``
        = (base, blocks)."""


class _Read:
    """One read: a direct one's NIXL READ handle, our destination slots, and a staged one's
    pool blocks (``None`` for a direct read). A staged read has no handle of ours: it is a
    request the producer serves with a WRITE (see the module docstring); ``ended`` is set
    once its completion or failure notification arrived."""

    __slots__ = ("ended", "handle", "local", "request", "stage")

    def __init__(
        self, handle: Any, local: npt.NDArray[np.int32], stage: npt.NDArray[np.int32] | None
    ) -> None:
        self.handle = handle
        self.local = local
        self.stage = stage
        self.ended = False
        self.request = 0
        """A staged read's request id (its transfer id)."""


class _Serving:
    """A WRITE we posted to serve a peer's staged read request (an internal transfer)."""

    __slots__ = ("handle", "request")

    def __init__(self, handle: Any, request: int) -> None:
        self.handle = handle
        self.request = request


class _Refused(Exception):
    """A staged read request we do not serve; ``request`` is its id when it could be read."""

    def __init__(self, reason: str, request: int | None = None) -> None:
        super().__init__(reason)
        self.request = request


class _Registration:
    """One ``add_peer``: the peer's prepared descriptor list, its lane and its reads.

    A registration replaced by a newer ``add_peer`` or removed has its reads ended at once;
    it stays in its peer's list only while its warm-up or quarantined reads still run.
    """

    __slots__ = (
        "dlist", "finished", "inflight", "lane", "num_blocks", "peer_id", "quarantined",
        "remote", "serving", "warmup", "warmup_id",
    )

    def __init__(
        self, peer_id: str, remote: _RemoteAgent, dlist: Any, num_blocks: int, lane: Lane
    ) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self.dlist = dlist
        self.num_blocks = num_blocks
        self.lane: Lane = lane
        self.inflight: dict[int, _Read] = {}
        """read id -> read, not yet terminal."""
        self.finished: dict[int, bool] = {}
        """read id -> success, terminal (handle released, bytes copied) and not reported."""
        self.quarantined: dict[int, _Read] = {}
        """internal id -> an ended read whose handle NIXL has not reported terminal yet."""
        self.warmup: Any = None
        """The connection warm-up READ's handle until it ended and was released."""
        self.warmup_id = 0
        """The warm-up's id (reported only by a ``remove_peer``/``close`` it outlives)."""
        self.serving: dict[int, _Serving] = {}
        """internal id -> a WRITE serving this peer's staged read request, still running."""

    @property
    def quiescent(self) -> bool:
        return (not self.inflight and self.warmup is None and not self.quarantined
                and not self.serving)


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
        self._array = region_array(settings)
        self._block_len = settings.block_len
        self._num_blocks = self._array.size // settings.block_len
        self._blocks = self._array.reshape(self._num_blocks, self._block_len)
        self._nixl = library.load()
        self._agent, self._agent_name = open_agent(self._nixl, self._options)
        self._host = host_id()
        self._cma = cma_usable()  # UCX read the same environment when the agent started
        self._scratch = np.zeros(_WARMUP_BYTES, dtype=np.uint8)
        """Where warm-up READs land; registered, and kept, exactly as long as the region."""
        region = register_region(
            self._agent, self._agent_name, self._array, self._block_len,
            extra=(self._scratch,) if self._options.warmup else (),
            host=self._host, cma=self._cma,
        )
        self._memory = region.registrations
        """NIXL registrations (region, then scratch), deregistered last."""
        self._local = region.dlist
        self._descriptor = region.descriptor
        self._pool: StagingPool | None = None
        """Created by the first staged ``add_peer``."""
        self._agents: dict[str, _RemoteAgent] = {}
        self._current: dict[str, _Registration] = {}
        self._by_peer: dict[str, list[_Registration]] = {}
        self._owner: dict[int, _Registration] = {}
        self._warming: list[_Registration] = []
        self._quarantining: list[_Registration] = []
        self._serving: list[_Registration] = []
        """Registrations with WRITEs serving their peer's staged reads still running."""
        self._requests: dict[int, tuple[_Registration, _Read]] = {}
        """Our staged reads (id -> registration, read) whose completion has not arrived yet,
        live or quarantined."""
        self._last_probe = 0.0
        self._unknown_senders: set[str] = set()
        """Agents whose requests we ignored (logged once each)."""
        self._zombies: dict[int, Any] = {}
        """internal id -> a handle NIXL refused to release after it ended (never freed)."""
        self._ids = itertools.count(1)
        self._closed = False
        self._closing_thread = 0
        """``threading.get_ident()`` of the ``close`` that left this transport undrained."""
        self._released = False
        self._progress_failed = False
        self._serves_remote = not self._cma
        """Whether a peer may read from us through our worker (UCX software-emulated GET, e.g.
        over tcp): our UCX lacks ``cma``, or a peer not reachable over ``cma`` was added.
        Decides whether a clean ``close`` may destroy the agent (see there)."""
        if self._options.staging == "never":
            log.warning(
                "nixl: data option staging='never': every read lands directly in the slots. "
                "Over a lane other than UCX cma (tcp, RDMA) a cancelled read can still land "
                "after cancel returned; keeping that from happening is the operator's "
                "responsibility (use 'auto' unless every peer is same-host over cma)"
            )

    # -- shape ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    @property
    def agent_name(self) -> str:
        """Our NIXL agent's name (a fresh uuid per transport)."""
        return self._agent_name

    def descriptor(self) -> bytes:
        return self._descriptor

    def lane(self, peer_id: str) -> Lane:
        """How reads from ``peer_id`` land: ``"direct"`` (into the slots) or ``"staged"``
        (through the staging pool). ``KeyError`` for a peer not currently added."""
        registration = self._current.get(peer_id)
        if registration is None:
            raise KeyError(f"unknown peer {peer_id!r}")
        return registration.lane

    def staging_usage(self) -> dict[str, int]:
        """The staging pool's blocks: ``capacity`` (0 until a staged peer was added),
        ``free``, and ``quarantined`` (held by cancelled reads NIXL has not ended yet)."""
        pool = self._pool
        if pool is None:
            return {"capacity": 0, "free": 0, "quarantined": 0}
        return {"capacity": pool.capacity, "free": pool.free, "quarantined": pool.quarantined}

    # -- peers ----------------------------------------------------------------------------

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the nixl transport is closed")
        desc = RegionDescriptor.decode(descriptor, peer_id)
        if desc.block_len != self._block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self._block_len})"
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
                desc.agent, block_dlist(desc.base, desc.num_blocks, desc.block_len), "DRAM"
            )
        except Exception as exc:
            self._unload_agent(remote)
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL refused its region ({type(exc).__name__}: {exc})"
            ) from exc
        registration = _Registration(peer_id, remote, dlist, desc.num_blocks, lane)
        old = self._current.pop(peer_id, None)
        self._current[peer_id] = registration
        self._by_peer.setdefault(peer_id, []).append(registration)
        if old is not None:
            self._end_reads(old)
            self._retire_quiescent(peer_id)
        if self._options.warmup:
            if lane == "staged":
                self._ping(registration.remote, "connection warm-up")
            else:
                self._start_warmup(registration, desc.base)

    def remove_peer(self, peer_id: str) -> list[int]:
        self._current.pop(peer_id, None)
        registrations = list(self._by_peer.get(peer_id, ()))
        if self._closed or not registrations:
            return []
        for registration in registrations:
            self._end_reads(registration)
        undrained = self._drain(registrations, quarantine=False)
        self._retire_quiescent(peer_id)
        return undrained

    def _lane_for(self, desc: RegionDescriptor) -> Lane:
        """The ``staging`` option's choice; ``auto``: direct exactly when our own process
        executes the READ (same host and PID namespace, ``cma`` on both sides)."""
        mode = self._options.staging
        if mode != "auto":
            return "staged" if mode == "always" else "direct"
        return "direct" if self._cma_peer(desc) else "staged"

    def _cma_peer(self, desc: RegionDescriptor) -> bool:
        """Whether reads between us and this peer go over UCX ``cma`` (same host and PID
        namespace, ``cma`` on both sides): each side's own process then executes its reads."""
        return bool(self._host) and desc.host == self._host and self._cma and desc.cma

    def _ensure_pool(self, peer_id: str) -> None:
        if self._pool is not None:
            return
        capacity = min(self._options.staging_blocks, self._num_blocks)
        try:
            self._pool = StagingPool(self._agent, self._block_len, capacity)
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r} needs staged reads, but NIXL could not register the staging "
                f"pool ({capacity} blocks of {self._block_len} B, nixl data option "
                f"'staging_blocks'): {type(exc).__name__}: {exc}"
            ) from exc
        log.info("nixl: staging pool of %d blocks (%.1f MiB) registered for staged reads",
                 capacity, capacity * self._block_len / 2**20)

    def _load_agent(self, peer_id: str, desc: RegionDescriptor) -> _RemoteAgent:
        remote = self._agents.get(desc.agent)
        if remote is not None:
            if remote.disconnected:
                raise PeerRejected(
                    f"peer {peer_id!r}: NIXL agent {desc.agent} disconnected earlier; a restarted "
                    f"peer has a new agent name"
                )
            if remote.metadata != desc.metadata:
                raise PeerRejected(
                    f"peer {peer_id!r}: agent {desc.agent} is already known with other metadata"
                )
        else:
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
            remote = self._agents[name] = _RemoteAgent(name, desc.metadata)
        remote.users += 1
        return remote

    def _unload_agent(self, remote: _RemoteAgent) -> None:
        remote.users -= 1
        if remote.users == 0:
            del self._agents[remote.name]
            if remote.pool_dlist is not None:
                self._quietly(self._agent.release_dlist_handle, remote.pool_dlist)
                remote.pool_dlist = None
            self._quietly(self._agent.remove_remote_agent, remote.name)

    def _ping(self, remote: _RemoteAgent, why: str) -> None:
        """Send ``remote`` a notification its transport ignores: it wires the connection up
        (a staged peer's warm-up: no READ, so no GET its worker would serve) or probes it
        (NIXL raises ``nixlRemoteDisconnectError`` once UCX failed the endpoint)."""
        try:
            self._agent.send_notif(remote.name, _PING)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(remote)
            else:
                log.debug("nixl: %s of agent %s not sent: %s", why, remote.name, exc)

    def _start_warmup(self, registration: _Registration, remote_base: int) -> None:
        """Post an 8-byte READ from the peer's region into our scratch: it wires the
        connection up while both sides progress, and touches neither region's contents.
        It is released only once NIXL reports it ended."""
        length = min(_WARMUP_BYTES, self._block_len)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs([(int(self._scratch.ctypes.data), length, 0)], "DRAM"),
                self._agent.get_xfer_descs([(remote_base, length, 0)], "DRAM"),
                registration.remote.name,
            )
        except Exception as exc:
            log.warning("nixl: connection warm-up to %s not posted: %s", registration.peer_id, exc)
            return
        registration.warmup = handle
        registration.warmup_id = next(self._ids)
        self._warming.append(registration)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._warmup_ended(registration, exc)
            return
        if state != "PROC":
            self._warmup_ended(registration, None)

    def _check_warmups(self) -> None:
        """End the warm-ups NIXL reports terminal; a replaced or removed registration that is
        idle then goes at once (nothing else may poll its peer again)."""
        for registration in list(self._warming):
            try:
                state = self._agent.check_xfer_state(registration.warmup)
            except Exception as exc:
                self._warmup_ended(registration, exc)
            else:
                if state == "PROC":
                    continue
                self._warmup_ended(registration, None)
            self._retire_if_idle(registration)

    def _warmup_ended(self, registration: _Registration, exc: BaseException | None) -> None:
        if isinstance(exc, self._nixl.remote_disconnect):
            self._disconnected(registration.remote)
        elif exc is not None:
            log.info("nixl: connection warm-up to %s failed: %s", registration.peer_id, exc)
        try:
            self._agent.release_xfer_handle(registration.warmup)
        except Exception as release_exc:
            log.warning("nixl: warm-up handle of %s not released yet: %s",
                        registration.peer_id, release_exc)
            return
        registration.warmup = None
        self._warming.remove(registration)

    def _retire_if_idle(self, registration: _Registration) -> None:
        if (registration.quiescent and not registration.finished
                and self._current.get(registration.peer_id) is not registration):
            self._retire_quiescent(registration.peer_id)

    # -- reads ----------------------------------------------------------------------------

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """See ``DataTransport.read_blocks``. A staged peer's read also takes
        ``len(local_idxs)`` pool blocks, refused (``TransferSubmitError`` naming
        ``staging_blocks``) when too few are free; nothing is posted then. A staged read is
        a request notification to the peer (see the module docstring)."""
        registration = self._readable(peer_id)
        local, remote = self._checked(registration, local_idxs, remote_idxs)
        if registration.lane == "staged":
            assert self._pool is not None  # a staged registration made it
            read = _Read(None, local, self._pool.take(len(local)))
            transfer_id = read.request = next(self._ids)
            self._request(registration, read, remote, transfer_id)
            self._requests[transfer_id] = (registration, read)
        else:
            read = _Read(None, local, None)
            read.handle = self._post(registration, read, remote)
            transfer_id = next(self._ids)
        registration.inflight[transfer_id] = read
        self._owner[transfer_id] = registration
        return transfer_id

    def _request(
        self, registration: _Registration, read: _Read, remote: npt.NDArray[np.int32],
        request: int,
    ) -> None:
        """Ask the peer to WRITE its blocks ``remote`` into our pool blocks ``read.stage``;
        ``TransferSubmitError`` (pool blocks given back) if NIXL does not send it."""
        pool = self._pool
        assert pool is not None and read.stage is not None
        message = b"".join((
            _REQUEST_HEAD.pack(_REQUEST, request, pool.base, pool.capacity, self._block_len,
                               len(remote)),
            remote.astype("<u4").tobytes(), read.stage.astype("<u4").tobytes(), pool.metadata,
        ))
        try:
            self._agent.send_notif(registration.remote.name, message)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(registration.remote)
            pool.give_back(read.stage)
            raise TransferSubmitError(
                f"peer {registration.peer_id!r}: NIXL could not send the staged read request "
                f"({type(exc).__name__}: {exc})"
            ) from exc

    def _readable(self, peer_id: str) -> _Registration:
        if self._closed:
            raise TransferSubmitError("the nixl transport is closed")
        registration = self._current.get(peer_id)
        if registration is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        if registration.remote.disconnected:
            raise TransferSubmitError(
                f"peer {peer_id!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT); add it again with "
                f"a fresh descriptor"
            )
        return registration

    def _checked(
        self, registration: _Registration, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32]]:
        """Both index lists, checked before anything is posted (see ``read_blocks``)."""
        try:
            local = checked_indexes(local_idxs, self._num_blocks)
            refuse_repeats(local, local_idxs)
        except ValueError as exc:
            raise TransferSubmitError(f"local block {exc}") from None
        try:
            remote = checked_indexes(remote_idxs, registration.num_blocks)
        except ValueError as exc:
            raise TransferSubmitError(
                f"remote (peer {registration.peer_id!r}) block {exc}"
            ) from None
        if len(local) != len(remote):
            raise TransferSubmitError(f"{len(local)} local but {len(remote)} remote block indexes")
        if len(local) == 0:
            raise TransferSubmitError("a read needs at least one block; both index lists are empty")
        return local, remote

    def _post(
        self, registration: _Registration, read: _Read, remote: npt.NDArray[np.int32]
    ) -> Any:
        """Make and post the READ (into our slots, or into the pool blocks ``read.stage``);
        ``TransferSubmitError`` if NIXL refuses, with nothing of it left able to land."""
        peer_id, agent = registration.peer_id, self._agent
        if read.stage is None:
            local_side, local_idxs = self._local, read.local
        else:
            assert self._pool is not None
            local_side, local_idxs = self._pool.dlist, read.stage
        try:
            read.handle = agent.make_prepped_xfer(
                "READ", local_side, local_idxs, registration.dlist, remote
            )
            state = agent.transfer(read.handle)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(registration.remote)
            self._abandon(registration, read)
            raise TransferSubmitError(
                f"peer {peer_id!r}: NIXL could not post the read ({type(exc).__name__}: {exc})"
            ) from exc
        if state == "ERR":
            self._abandon(registration, read)
            raise TransferSubmitError(f"peer {peer_id!r}: NIXL failed the read at submit")
        return read.handle

    def _abandon(self, registration: _Registration, read: _Read) -> None:
        """A read whose post failed: ended like a cancelled one (pool blocks go back at once
        only if no handle was made)."""
        if read.handle is None:
            if read.stage is not None:
                assert self._pool is not None
                self._pool.give_back(read.stage)
            return
        self._end_read(registration, read)

    def progress(self) -> None:
        """Drive NIXL's worker: ``get_new_notifs`` is the cheapest call that progresses it (a
        few microseconds), and it returns the notifications of staged reads: peers' requests
        (served here with a WRITE, :meth:`_serve`) and the completions of ours (copied into the
        slots here, reported by ``poll``). Then end warm-ups, serving WRITEs and quarantines
        that ended, and probe peers our staged requests wait for.

        An open transport also takes one drain step for each transport that a ``close`` on
        this same thread left undrained (NIXL calls stay on the thread that used the agent):
        what it still runs may need a peer in this process, and a peer that keeps polling ends
        it, so the leaked transport is then released after all, and its peers see it go."""
        if self._released:
            return
        if _LEAKED and not self._closed:
            thread = threading.get_ident()
            for leaked in list(_LEAKED):
                if leaked._closing_thread == thread:
                    leaked._drain_step()
        notifications = self._progress_worker()
        if notifications:
            self._notified(notifications)
        if self._warming:
            self._check_warmups()
        if self._serving:
            self._check_serving()
        if self._quarantining:
            self._reap_quarantine()
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

    # -- staged reads: requests, serving WRITEs, completions -------------------------------

    def _notified(self, notifications: dict[str, list[bytes]]) -> None:
        """Dispatch notifications by prefix; anything else (pings, foreign ones) is ignored."""
        for sender, messages in notifications.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for raw in messages:
                message = bytes(raw)
                prefix = message[:6]
                if prefix == _REQUEST:
                    self._serve(name, message)
                elif prefix in (_DONE, _FAILED) and len(message) >= 6 + _ID.size:
                    (request,) = _ID.unpack_from(message, 6)
                    if prefix == _FAILED:
                        log.warning("nixl: agent %s failed staged read %d: %s", name, request,
                                    message[6 + _ID.size:].decode("utf-8", "replace"))
                    self._request_ended(name, request, prefix == _DONE)

    def _request_ended(self, sender: str, request: int, ok: bool) -> None:
        """The producer's completion (``ok``) or failure of our staged read ``request``: a live
        read is copied into the slots (when ``ok``) and queued for reporting; a cancelled one
        leaves quarantine (``_reap_quarantine``). Nothing of its WRITE arrives after this."""
        entry = self._requests.get(request)
        if entry is None or entry[0].remote.name != sender:
            log.debug("nixl: completion of unknown staged read %d from %s ignored",
                      request, sender)
            return
        del self._requests[request]
        registration, read = entry
        read.ended = True
        if registration.inflight.get(request) is read:
            del registration.inflight[request]
            self._complete(registration, request, read, ok)

    def _probe(self) -> None:
        """Every ``_PING_INTERVAL``, ping each peer our staged requests wait for: a dead one
        is then seen as disconnected (its reads fail, its quarantines end) without a READ."""
        now = time.monotonic()
        if now - self._last_probe < _PING_INTERVAL:
            return
        self._last_probe = now
        remotes = {id(r.remote): r.remote for r, _ in self._requests.values()}
        for remote in remotes.values():
            if not remote.disconnected:
                self._ping(remote, "probe")

    def _serving_registration(self, sender: str) -> _Registration | None:
        for registration in self._current.values():
            if registration.remote.name == sender and not registration.remote.disconnected:
                return registration
        return None

    def _serve(self, sender: str, message: bytes) -> None:
        """A peer's staged read request: WRITE our blocks into its pool, the WRITE carrying
        the completion notification. Only a currently added peer is served (its agent is
        loaded; anyone else is ignored, logged once); a malformed or unservable request is
        refused with a failure notification when its id could be read, and logged. Never
        raises: this runs inside every ``progress``."""
        if self._closed:
            return
        registration = self._serving_registration(sender)
        if registration is None:
            if sender not in self._unknown_senders:
                self._unknown_senders.add(sender)
                log.warning("nixl: ignoring staged read requests from agent %s: not a peer "
                            "added here (or disconnected)", sender)
            return
        remote = registration.remote
        try:
            request, base, capacity, src, stage, metadata = self._parsed(message)
        except _Refused as refusal:
            self._refuse(registration, refusal.request, str(refusal))
            return
        except Exception as exc:  # defensive: _parsed checks before it unpacks
            self._refuse(registration, None, f"{type(exc).__name__}: {exc}")
            return
        try:
            target = self._remote_pool(remote, base, capacity, metadata)
            handle = self._agent.make_prepped_xfer(
                "WRITE", self._local, src, target, stage, notif_msg=_DONE + _ID.pack(request)
            )
        except _Refused as refusal:
            self._refuse(registration, refusal.request, str(refusal))
            return
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(remote)
                return
            self._refuse(registration, request, f"{type(exc).__name__}: {exc}")
            return
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(remote)
            state = "ERR"
            log.warning("nixl: WRITE serving %s's staged read %d not posted: %s",
                        registration.peer_id, request, exc)
        if state == "PROC":
            registration.serving[next(self._ids)] = _Serving(handle, request)
            if registration not in self._serving:
                self._serving.append(registration)
            return
        self._served(registration, handle, request, state == "DONE")

    def _parsed(self, message: bytes) -> tuple[
        int, int, int, npt.NDArray[np.int32], npt.NDArray[np.int32], bytes
    ]:
        """A request's fields, every one checked; ``_Refused`` says what is wrong."""
        if len(message) < _REQUEST_HEAD.size:
            raise _Refused(f"a request of {len(message)} bytes is truncated")
        _, request, base, capacity, block_len, count = _REQUEST_HEAD.unpack_from(message)
        if block_len != self._block_len:
            raise _Refused(f"block_len {block_len} is not ours ({self._block_len})", request)
        if not 0 < count <= _MAX_REQUEST_BLOCKS:
            raise _Refused(f"a request for {count} blocks", request)
        if not (capacity > 0 and base > 0 and base + capacity * block_len <= 2**64):
            raise _Refused(f"staging pool at {base:#x} of {capacity} blocks is invalid", request)
        end = _REQUEST_HEAD.size + 8 * count
        if len(message) <= end:
            raise _Refused(f"a request for {count} blocks of {len(message)} bytes is truncated "
                           f"(or lacks the pool metadata)", request)
        src = np.frombuffer(message, "<u4", count, _REQUEST_HEAD.size)
        stage = np.frombuffer(message, "<u4", count, _REQUEST_HEAD.size + 4 * count)
        if int(src.max()) >= self._num_blocks:
            raise _Refused(f"source block {int(src.max())} is outside 0..{self._num_blocks - 1}",
                           request)
        if int(stage.max()) >= capacity:
            raise _Refused(f"pool block {int(stage.max())} is outside 0..{capacity - 1}",
                           request)
        return (request, base, capacity, src.astype(np.int32), stage.astype(np.int32),
                message[end:])

    def _remote_pool(
        self, remote: _RemoteAgent, base: int, capacity: int, metadata: bytes
    ) -> Any:
        """The peer's staging pool as a prepared remote list, its metadata loaded first (once
        per loaded agent: a re-added agent loads it again)."""
        if remote.pool_md != metadata:
            loaded = self._agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != remote.name:
                if name != self._agent_name and name not in self._agents:
                    self._quietly(self._agent.remove_remote_agent, name)
                raise _Refused(f"its pool metadata names agent {name!r}")
            remote.pool_md = metadata
        if remote.pool_key != (base, capacity) or remote.pool_dlist is None:
            dlist = self._agent.prep_xfer_dlist(
                remote.name, block_dlist(base, capacity, self._block_len), "DRAM"
            )
            if remote.pool_dlist is not None:
                self._quietly(self._agent.release_dlist_handle, remote.pool_dlist)
            remote.pool_dlist, remote.pool_key = dlist, (base, capacity)
        return remote.pool_dlist

    def _refuse(self, registration: _Registration, request: int | None, reason: str) -> None:
        log.warning("nixl: refused staged read request %s of peer %s: %s",
                    request, registration.peer_id, reason)
        if request is not None:
            self._notify_failed(registration.remote, request, reason)

    def _notify_failed(self, remote: _RemoteAgent, request: int, reason: str) -> None:
        try:
            self._agent.send_notif(
                remote.name, _FAILED + _ID.pack(request) + reason.encode()[:512]
            )
        except Exception as exc:  # a dead or unreachable peer needs no answer
            log.debug("nixl: failure notification to %s not sent: %s", remote.name, exc)

    def _check_serving(self) -> None:
        """End the serving WRITEs NIXL reports terminal. A failed one is answered with a
        failure notification (a done one carried its completion itself)."""
        for registration in list(self._serving):
            for internal_id, serving in list(registration.serving.items()):
                try:
                    state = self._agent.check_xfer_state(serving.handle)
                except Exception as exc:
                    if not isinstance(exc, self._nixl.remote_disconnect):
                        continue  # proves nothing; checked again next tick
                    self._disconnected(registration.remote)
                    state = "ERR"
                if state == "PROC":
                    continue
                del registration.serving[internal_id]
                self._served(registration, serving.handle, serving.request, state == "DONE")
            if not registration.serving:
                self._serving.remove(registration)
                self._retire_if_idle(registration)

    def _served(
        self, registration: _Registration, handle: Any, request: int, ok: bool
    ) -> None:
        self._release(handle)
        if not ok:
            log.warning("nixl: the WRITE serving staged read %d of peer %s failed",
                        request, registration.peer_id)
            if not registration.remote.disconnected:
                self._notify_failed(registration.remote, request, "the WRITE failed")

    def poll(self, peer_id: str | None = None) -> PollResult:
        if self._closed:
            return EMPTY_POLL
        self.progress()
        if peer_id is None:
            registrations: Iterable[_Registration] = list(self._all_registrations())
        else:
            found = self._by_peer.get(peer_id)
            if not found:
                return EMPTY_POLL
            registrations = list(found)
        done: list[int] = []
        failed: list[int] = []
        retire = False
        for registration in registrations:
            if registration.inflight:
                self._check(registration)
            if registration.finished:
                for transfer_id, ok in registration.finished.items():
                    (done if ok else failed).append(transfer_id)
                    del self._owner[transfer_id]
                registration.finished.clear()
            retire = retire or (
                registration.quiescent
                and self._current.get(registration.peer_id) is not registration
            )
        if retire:
            for peer in [peer_id] if peer_id is not None else list(self._by_peer):
                self._retire_quiescent(peer)
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def _check(self, registration: _Registration) -> None:
        """Finish the reads of ``registration`` NIXL reports terminal; a check that raises
        fails its read (ended like a cancelled one: its bytes stay out of the slots)."""
        for transfer_id, read in list(registration.inflight.items()):
            if read.handle is None:
                continue  # staged: ended by its notification (``_request_ended``)
            try:
                state = self._agent.check_xfer_state(read.handle)
            except Exception as exc:
                if isinstance(exc, self._nixl.remote_disconnect):
                    self._disconnected(registration.remote)
                    return  # every read of that agent has just been failed
                log.warning("nixl: checking read %d failed; failing it: %s", transfer_id, exc)
                del registration.inflight[transfer_id]
                self._end_read(registration, read)
                registration.finished[transfer_id] = False
                continue
            if state != "PROC":
                del registration.inflight[transfer_id]
                self._complete(registration, transfer_id, read, state == "DONE")

    def _complete(
        self, registration: _Registration, transfer_id: int, read: _Read, ok: bool
    ) -> None:
        """A read NIXL reports terminal: release it, copy a staged read's blocks into the
        slots when it succeeded, and queue it for reporting."""
        if read.handle is not None:
            self._release(read.handle)
        else:
            self._requests.pop(transfer_id, None)
        if read.stage is not None:
            assert self._pool is not None
            if ok:
                self._pool.copy_out(read.stage, self._blocks, read.local)
            self._pool.give_back(read.stage)
        registration.finished[transfer_id] = ok

    def _disconnected(self, remote: _RemoteAgent) -> None:
        """The peer process is gone: fail every read of every registration using it. UCX has
        failed the endpoint (its operations complete with an error, its connection is
        closed), so nothing more can land from it: handles are released, pool blocks freed."""
        if not remote.disconnected:
            log.warning("nixl: peer agent %s disconnected; failing its reads", remote.name)
        remote.disconnected = True
        for registration in self._all_registrations():
            if registration.remote is not remote:
                continue
            for transfer_id, read in registration.inflight.items():
                self._complete(registration, transfer_id, read, False)
            registration.inflight.clear()

    def _release(self, handle: Any) -> None:
        """Release a handle NIXL reported terminal; one it refuses is kept aside (an internal
        transfer ``close`` reports) and never freed under NIXL."""
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            zombie = next(self._ids)
            log.error("nixl: a read ended but NIXL refused to release it (kept as internal "
                      "transfer %d): %s", zombie, exc)
            self._zombies[zombie] = handle

    # -- ending reads ---------------------------------------------------------------------

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        deadline = time.monotonic() + self._options.drain_timeout
        for transfer_id in transfer_ids:
            registration = self._owner.pop(transfer_id, None)
            if registration is None:
                continue
            if registration.finished.pop(transfer_id, None) is not None:
                continue
            self._end_read(registration, registration.inflight.pop(transfer_id), deadline)

    def _end_reads(self, registration: _Registration) -> None:
        """End every read of ``registration`` (replaced, removed, closing); none is reported."""
        deadline = time.monotonic() + self._options.drain_timeout
        while registration.inflight:
            transfer_id, read = registration.inflight.popitem()
            self._owner.pop(transfer_id, None)
            self._end_read(registration, read, deadline)
        for transfer_id in registration.finished:
            self._owner.pop(transfer_id, None)
        registration.finished.clear()

    def _end_read(
        self, registration: _Registration, read: _Read, deadline: float | None = None
    ) -> None:
        """End one read finally: a direct one is stopped (waiting no later than ``deadline``,
        default ``drain_timeout`` from now), a staged one quarantined."""
        if read.stage is None:
            if deadline is None:
                deadline = time.monotonic() + self._options.drain_timeout
            self._stop_direct(registration, read, deadline)
        elif read.ended or registration.remote.disconnected:
            assert self._pool is not None  # nothing more of it can arrive (see staging)
            self._requests.pop(read.request, None)
            self._pool.give_back(read.stage)
        else:
            assert self._pool is not None
            self._pool.quarantine(read.stage)
            self._keep(registration, read)

    def _stop_direct(self, registration: _Registration, read: _Read, deadline: float) -> None:
        """Release a direct read's handle (on ``cma`` that stops it). If NIXL refuses, our
        worker is driven until the read ends, up to ``deadline``; one still running then is
        kept aside and may still land (see the module docstring)."""
        try:
            self._agent.release_xfer_handle(read.handle)
            return
        except Exception as exc:
            log.warning("nixl: a cancelled read from %s was not released (%s); driving it to "
                        "its end", registration.peer_id, exc)
        while not self._ended(registration, read.handle):
            if time.monotonic() >= deadline:
                log.error(
                    "nixl: a cancelled direct read from %s still runs after %.1fs: its bytes may "
                    "still land in slots %s (lane %s; only staged reads are final on any lane)",
                    registration.peer_id, self._options.drain_timeout,
                    read.local[:16].tolist(), registration.lane,
                )
                self._keep(registration, read)
                return
            self._progress_worker()
        self._release(read.handle)

    def _keep(self, registration: _Registration, read: _Read) -> None:
        """Hold an ended read whose handle still runs until NIXL reports it terminal."""
        registration.quarantined[next(self._ids)] = read
        if registration not in self._quarantining:
            self._quarantining.append(registration)

    def _ended(self, registration: _Registration, handle: Any) -> bool:
        """Whether NIXL reports ``handle`` terminal (``DONE``/``ERR``, or its peer
        disconnected); any other error proves nothing (False)."""
        try:
            return bool(self._agent.check_xfer_state(handle) != "PROC")
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(registration.remote)
                return True
            return False

    def _reap_quarantine(self) -> None:
        """Release the kept reads NIXL now reports terminal and free their pool blocks; a
        replaced or removed registration left idle goes at once."""
        for registration in list(self._quarantining):
            for internal_id, read in list(registration.quarantined.items()):
                if read.handle is None:  # staged: its notification, or the peer is gone
                    if not (read.ended or registration.remote.disconnected):
                        continue
                    self._requests.pop(read.request, None)
                elif not self._ended(registration, read.handle):
                    continue
                else:
                    self._release(read.handle)
                del registration.quarantined[internal_id]
                if read.stage is not None:
                    assert self._pool is not None
                    self._pool.give_back(read.stage, quarantined=True)
            if not registration.quarantined:
                self._quarantining.remove(registration)
                self._retire_if_idle(registration)

    # -- quiescence -----------------------------------------------------------------------

    def _all_registrations(self) -> Iterator[_Registration]:
        for registrations in self._by_peer.values():
            yield from registrations

    def _drain(self, registrations: Sequence[_Registration], quarantine: bool) -> list[int]:
        """Progress until the warm-ups (and, with ``quarantine``, the kept reads) of
        ``registrations`` ended, up to ``drain_timeout``. Returns the ids still running."""

        def running() -> list[int]:
            return sorted(
                [r.warmup_id for r in registrations if r.warmup is not None]
                + [w for r in registrations for w in r.serving]
                + ([q for r in registrations for q in r.quarantined] if quarantine else [])
            )

        deadline = time.monotonic() + self._options.drain_timeout
        while running() and time.monotonic() < deadline:
            self.progress()
        undrained = running()
        if undrained:
            log.error(
                "nixl: %d internal transfer(s) still running after %.1fs drain (%s); their "
                "memory stays registered", len(undrained), self._options.drain_timeout,
                undrained,
            )
        return undrained

    def _drain_step(self) -> None:
        """One non-blocking drain pass of a leaked transport; finishes its ``close`` once
        nothing runs any more."""
        self.progress()
        if all(r.quiescent for r in self._all_registrations()):
            self.close()

    def _retire_quiescent(self, peer_id: str) -> None:
        """Release the registrations of ``peer_id`` that are replaced or removed and idle."""
        registrations = self._by_peer.get(peer_id)
        if not registrations:
            return
        current = self._current.get(peer_id)
        keep = []
        for registration in registrations:
            if registration is current or not registration.quiescent or registration.finished:
                keep.append(registration)
                continue
            self._quietly(self._agent.release_dlist_handle, registration.dlist)
            self._unload_agent(registration.remote)
        if keep:
            self._by_peer[peer_id] = keep
        else:
            del self._by_peer[peer_id]

    # -- close ----------------------------------------------------------------------------

    def close(self) -> list[int]:
        """See ``DataTransport.close``. Calling it again after it returned ids retries the drain
        and releases everything once nothing runs any more.

        A clean close releases the peers, descriptor lists and memory registrations, and then
        destroys the agent (with its UCX worker) only if no peer can be reading from us through
        that worker. Over a lane other than ``cma`` (tcp) a peer's transfers with us are UCX
        software emulation: a warm-up READ's GET requests, or the WRITEs it serves our staged
        reads with, are handled by *our* worker, which sends the replies (GET data, PUT
        acknowledgements) as internal requests. NIXL exposes nothing about those (no count,
        no way to flush or cancel them), and a peer's cancelled reads keep running on the
        wire, so at any moment some may be queued on our endpoints; destroying the worker then frees
        them under UCX (``... was not returned to mpool ucp_requests``, then a SIGSEGV in
        ``close``). So when a peer might read us that way (our UCX has no ``cma``, or a peer
        not reachable over ``cma`` was ever added), the agent is *retained*, logged: it and
        the buffers it was registered over (region, scratch, pool) are kept alive for the
        process lifetime (:data:`_RETAINED`, with an extra reference so not even interpreter
        shutdown frees them) and it is never progressed again, so no UCX code runs for it
        and nothing it serves can touch freed memory. Its peers then see its endpoints go
        silent rather than disconnect, until this process exits (the kernel closes its
        sockets; they fail their reads by heartbeat or lease before that). With only ``cma``
        peers, each reader's own process executes its reads and the agent is destroyed, so
        its peers see a disconnect. A reader that read us over tcp but was never added here
        is not seen; in p2pkv both sides add each other."""
        if self._released:
            return []
        self._closed = True
        self._current.clear()
        registrations = list(self._all_registrations())
        for registration in registrations:
            self._end_reads(registration)
        undrained = self._drain(registrations, quarantine=True)
        quarantined = {q for r in self._all_registrations() for q in r.quarantined}
        if undrained and not self._zombies and set(undrained) <= quarantined:
            # Only cancelled staged reads are left: they can land in the pool alone, never in
            # the region. Keep the pool (and the agent) alive for good and close the rest.
            log.info("nixl: %d cancelled staged read(s) still unanswered at close; their "
                     "staging pool is kept, with the agent, until the process exits",
                     len(undrained))
            self._serves_remote = True
            self._release_everything()
            return []
        for zombie, handle in list(self._zombies.items()):
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                continue
            del self._zombies[zombie]
        if undrained or self._zombies or any(
            not r.quiescent for r in self._all_registrations()
        ):
            self._closing_thread = threading.get_ident()
            if self not in _LEAKED:
                _LEAKED.append(self)
            return sorted({*undrained, *self._zombies})
        self._release_everything()
        return []

    def _release_everything(self) -> None:
        """Peers, descriptor lists, then memory (pool, scratch, region); drop the agent."""
        for peer_id in list(self._by_peer):
            self._retire_quiescent(peer_id)
        agent = self._agent
        self._quietly(agent.release_dlist_handle, self._local)
        if self._pool is not None:
            self._quietly(agent.release_dlist_handle, self._pool.dlist)
            self._quietly(agent.deregister_memory, self._pool.registration)
        for registration in reversed(self._memory):
            self._quietly(agent.deregister_memory, registration)
        self._memory.clear()
        self._released = True
        if self in _LEAKED:
            _LEAKED.remove(self)
        if self._serves_remote:
            self._retain()
        # Every NIXL handle object holds the agent: with the last one gone, the agent and its
        # UCX worker are destroyed, so peers see a disconnect instead of a silent endpoint.
        del self._agent, self._local, self._array, self._blocks, self._scratch
        self._pool = None

    def _retain(self) -> None:
        """Keep the agent and every buffer it was registered over alive for the process
        lifetime, never progressed again (see ``close``)."""
        kept = (self._agent, self._local, self._array, self._scratch, self._pool)
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
