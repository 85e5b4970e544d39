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
2. The producer's ``progress`` serves requests from agents of peers currently added there; a
   request from the agent of a peer removed here (kept loaded for that, the last
   :data:`~p2pkv_nixl.peers.FORMER_AGENTS` of them) is answered ``p2kvF1`` at once, so a
   consumer's request sent after its session ended (a pause, a partition) ends its quarantine;
   anyone else is ignored, logged once. It checks every field (block length, sizes, every index
   in range), loads the pool metadata, and posts a WRITE from its region into our pool whose
   completion notification (``p2kvD1`` + id) NIXL sends when the WRITE is done. A request it
   cannot serve, or a WRITE that fails, is answered ``p2kvF1`` + id + reason; nothing malformed
   raises. Its WRITEs are internal transfers: never reported by its ``poll``, drained by its
   ``remove_peer``/``close`` and returned by them when they do not drain.
3. Our ``progress`` takes the completion; ``poll`` then copies a live read from the pool into
   the slots (one fancy-indexed copy) and reports it done; a failure fails it. A cancelled
   read's blocks stay quarantined until its completion or failure arrives (or the producer's
   agent is reported disconnected), and are never copied.

When the producer dies the consumer's requests get no answer: while requests are outstanding
``progress`` pings each producer they wait for (``p2kvP1``, ignored by its target) every
:data:`~p2pkv_nixl.peers.PING_INTERVAL`, and NIXL raises ``nixlRemoteDisconnectError`` once UCX
has failed the endpoint; its reads then fail and its quarantines end. A staged peer's
``add_peer`` warm-up is such a ping too (a READ would be a GET again). Both sides must add each
other (p2pkv always does): a producer serves only agents it added.

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
by delegating to one class per role (see :class:`NixlDataTransport`), which keep what NIXL
needs beyond them in one shared :class:`~p2pkv_nixl.state.NixlState` and the records of
:mod:`p2pkv_nixl.records`: each ``add_peer``'s record
lives on after the base detached it while its warm-up, serving WRITEs or quarantined reads
still run, and is released by ``progress`` once they ended.

Threading: every NIXL call is made on the caller's (driver) thread; this package starts no
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
after they ended. ``remove_peer`` waits for none of them (the driver bound,
:data:`p2pkv.contracts.DRIVER_BOUND`: the peer may be stopped): it returns the peer's
warm-ups and serving WRITEs still running, and its records stay, each released by a later
``progress`` once quiescent; it does not return quarantined reads (they write only into our
pool, and the peer's registration they need, which keeps its agent loaded so its completions
still arrive, is released by ``progress`` once they end). :meth:`NixlDataTransport.held`
counts what is still held. ``close`` waits for all of them for
:data:`p2pkv.contracts.DRAIN_GRACE` at most and returns what still runs; then the agent,
region, scratch and pool stay registered (held in a module-level list so that not even
garbage collection frees them under a transfer). Such a leaked transport is drained further
by the ``progress`` of any open transport on the same thread (its own ``progress`` and a
second ``close`` do nothing, as for every closed data transport), and released once nothing
runs. A clean ``close`` destroys the agent, so its peers see a disconnect rather than a
silent endpoint, unless a peer may still be reading from us through our own UCX worker (any
lane but ``cma``): then the agent is retained, idle, for the process lifetime, because
destroying a worker that serves such reads crashes UCX
(see :meth:`p2pkv_nixl.teardown.Teardown.shutdown`).
"""

from __future__ import annotations

from typing import ClassVar

from p2pkv.contracts import Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import ConfigError, TransportUnavailable

from p2pkv_nixl import library
from p2pkv_nixl.descriptor import MAX_BLOCKS
from p2pkv_nixl.finality import Finality
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.peers import PeerTable
from p2pkv_nixl.progress import Ticker
from p2pkv_nixl.reads import Reads
from p2pkv_nixl.records import Lane, Peer, Read
from p2pkv_nixl.serving import Server
from p2pkv_nixl.state import NixlState, log
from p2pkv_nixl.teardown import Teardown

__all__ = ["Lane", "NixlDataTransport"]


class NixlDataTransport(DataTransport):
    """NIXL data transport; see the module docstring and the README for the options.

    A composition of one object per role over one :class:`~p2pkv_nixl.state.NixlState`:
    :class:`~p2pkv_nixl.peers.PeerTable` (peers, remote agents, warm-ups, pings),
    :class:`~p2pkv_nixl.reads.Reads` (our reads on both lanes),
    :class:`~p2pkv_nixl.serving.Server` (serving peers' staged reads),
    :class:`~p2pkv_nixl.finality.Finality` (ending reads, quarantine),
    :class:`~p2pkv_nixl.progress.Ticker` (the tick of ``progress``/``poll``) and
    :class:`~p2pkv_nixl.teardown.Teardown` (drains, release). It implements the base's
    primitives by delegating to them; like every data transport it is driven by one thread
    at a time."""

    name: ClassVar[str] = "nixl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True,
        cross_host=True,
        memory_kinds=frozenset({"DRAM"}),
        # The direct lane is one-sided (our READ, executed by our own process over cma); the
        # staged lane is not: the producer's transport serves our request with a WRITE from
        # its progress/poll, so it needs the source side to take part.
        two_sided=True,
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> NixlDataTransport:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        options = NixlOptions.parse(settings.options)
        super().__init__(settings)
        if self.num_blocks > MAX_BLOCKS:
            raise ConfigError(f"region has more than {MAX_BLOCKS} blocks (NIXL indexes are int32)")
        self._state = NixlState(options, self._blocks, self._transfer_ids)
        self._peers = PeerTable(self._state)
        self._finality = Finality(self._state)
        self._reads = Reads(self._state, self._peers, self._finality)
        self._server = Server(self._state)
        self._ticker = Ticker(self._state, self._peers, self._reads, self._server, self._finality)
        self._teardown = Teardown(self._state, self._peers, self._ticker.tick)
        if options.staging == "never":
            log.warning(
                "nixl: data option staging='never': every read lands directly in the slots. "
                "Over a lane other than UCX cma (tcp, RDMA) a cancelled read can still land "
                "after cancel returned; keeping that from happening is the operator's "
                "responsibility (use 'auto' unless every peer is same-host over cma)"
            )

    # -- shape and views ------------------------------------------------------------------

    @property
    def agent_name(self) -> str:
        """Our NIXL agent's name (a fresh uuid per transport)."""
        return self._state.agent_name

    def descriptor(self) -> bytes:
        return self._state.descriptor

    @property
    def descriptors_posted(self) -> int:
        """NIXL descriptors of our reads, by the :func:`p2pkv.runs.coalesce` rule (one per run of
        blocks consecutive on both sides and within one slice of each, so a contiguous read
        within one slice of each side counts 1): a direct read's READ as posted, a staged
        read's WRITE (posted by the producer) as its request asks for it, its source blocks
        against our pool blocks, counted once the request is sent."""
        return self._reads.descriptors_posted

    @descriptors_posted.setter
    def descriptors_posted(self, value: int) -> None:
        self._reads.descriptors_posted = value  # writable, as the base's attribute is

    @property
    def state(self) -> NixlState:
        """The state the roles share (records, pool, agent), for diagnostics and tests:
        read it; changing it is the roles' job."""
        return self._state

    @property
    def leaked(self) -> bool:
        """Whether a ``close`` left this transport undrained (everything still registered;
        the ``progress`` of open transports on the closing thread drains it further)."""
        return self._teardown.leaked

    def lane(self, peer_id: str) -> Lane:
        """How reads from ``peer_id`` land: ``"direct"`` (into the slots) or ``"staged"``
        (through the staging pool). ``KeyError`` for a peer not currently added."""
        peer = self._state.current(peer_id)
        if peer is None:
            raise KeyError(f"unknown peer {peer_id!r}")
        return peer.lane

    def read_capacity(self, peer_id: str) -> int | None:
        """The staging pool's size for a staged peer (every staged peer's reads share it),
        None for a direct one (reads land straight in the slots). Unknown peer: None."""
        peer, pool = self._state.current(peer_id), self._state.pool
        if peer is None or peer.lane != "staged" or pool is None:
            return None
        return pool.capacity

    def _held(self) -> dict[str, int]:
        """Records of removed peers kept until quiescent, with their warm-ups and serving
        WRITEs still running; ended reads still quarantined (and their pool blocks); handles
        NIXL refused to release; ``leaked`` while a ``close`` left the transport undrained."""
        state = self._state
        detached = [peer for peer in state.peers if not peer.current]
        return {
            "detached_peers": len(detached),
            "warmups": sum(1 for peer in detached if peer.warmup is not None),
            "serving_writes": sum(len(peer.serving) for peer in detached),
            "quarantined_reads": sum(len(peer.quarantined) for peer in state.peers),
            "quarantined_blocks": state.pool.quarantined if state.pool is not None else 0,
            "unreleased_handles": len(state.zombies),
            "leaked": int(self.leaked),
        }

    def staging_usage(self) -> dict[str, int]:
        """The staging pool's blocks: ``capacity`` (0 until a staged peer was added),
        ``free``, and ``quarantined`` (held by cancelled reads NIXL has not ended yet)."""
        pool = self._state.pool
        if pool is None:
            return {"capacity": 0, "free": 0, "quarantined": 0}
        return {"capacity": pool.capacity, "free": pool.free, "quarantined": pool.quarantined}

    # -- the base's primitives ------------------------------------------------------------

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Peer:
        return self._peers.attach(peer_id, descriptor)

    def _detach_peer(self, peer: Peer) -> list[int]:
        return self._teardown.detach(peer)

    def _post_read(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        return self._reads.post(peer, local, remote)

    def _read_state(self, read: Read) -> ReadState:
        return self._reads.state(read)

    def _end_reads(self, reads: list[Read]) -> None:
        self._finality.end(reads)

    def _progress(self) -> None:
        self._ticker.tick()

    def _shutdown(self) -> list[int]:
        return self._teardown.shutdown()
