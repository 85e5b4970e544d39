"""Transport contracts: what the core needs from a control plane and a data plane.

Threading model (applies to every class here): all public methods are called from **one
driver thread at a time** (the tier's). A transport may run I/O threads of its own, but it
never calls back into the core from them, and it never blocks the driver longer than a call's
contract allows. Transports carry opaque bytes; encoding, validation and the session protocol
live in the core.

**The driver bound.** While a call runs, the tier's tick waits, and with it every peer's
work. So no call of a data transport keeps the driver thread longer than
:data:`DRIVER_BOUND` (0.1 s), whatever a peer does: a peer that is stopped, cut off or slow
is never waited for. Draining a removed peer's transfers, closing endpoints, deregistering
memory: started by the call, finished in later ``progress`` calls, and what they still hold
is shown by :meth:`DataTransport.held` until released. The tier times every data transport
call and logs one over the bound, naming it (:mod:`p2pkv.call_guard`).

Construction goes through ``create(settings)`` so the registry can build any transport from a
tier config; ``availability()`` lets ``p2pkv plugins`` explain a transport whose library is
missing without constructing it.
"""

from __future__ import annotations

import itertools
import logging
from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final, Literal, NamedTuple, Self, TypeVar

import numpy as np
import numpy.typing as npt

from p2pkv.data_base import AttachedPeer, Indexes, ReadState, region_blocks
from p2pkv.data_base import check_read as _check_read
from p2pkv.errors import PeerRejected, TransferSubmitError, TransportUnavailable

__all__ = [
    "DRAIN_GRACE",
    "DRIVER_BOUND",
    "EMPTY_POLL",
    "Capabilities",
    "ControlConnection",
    "ControlSettings",
    "ControlTransport",
    "DataBackend",
    "DataSettings",
    "DataTransport",
    "PollResult",
    "ReadState",
    "SessionRoom",
    "TransportKind",
]

log = logging.getLogger(__name__)

TransportKind = Literal["control", "data"]

DRIVER_BOUND: Final = 0.1
"""Seconds one call of a data transport may keep the tier's driver thread, at most.

Well under the shortest heartbeat timeout an operator sets (1 s in the docs and the chaos
suite), so a call never looks like a dead or paused process. A bound on a call, not a speed
figure: a call is short by design (it never waits for a peer); on a loaded machine it may
take longer for reasons of the machine's own. The conformance kit checks it with a generous
margin (``p2pkv.testing.suites``, the isolation checks)."""

DRAIN_GRACE: Final = DRIVER_BOUND / 2
"""Seconds ``close`` may keep progressing internal transfers so they end cleanly before it
returns the rest undrained. ``remove_peer`` waits for none: its peer's transfers end in
later ``progress`` calls."""


class SessionRoom(NamedTuple):
    """How many peer sessions a control transport holds, at most and still (dialed and
    accepted alike): what ``ControlTransport.session_room`` reports."""

    free: int
    """Sessions it can still open before it must refuse peers' connections."""
    total: int
    """Sessions it can hold in all."""


@dataclass(frozen=True)
class Capabilities:
    """What a transport claims to support; the conformance kit and ``p2pkv plugins`` read it.

    ``two_sided`` marks data transports whose reads need the *source* side's transport to take
    part (it serves them from ``progress``/``poll``: tagged sends), as opposed to one-sided
    RDMA-style reads the source's library serves alone. ``heartbeats`` marks control
    transports that detect a silent peer on their own (not only a closed socket).

    ``memory_kinds`` names the kinds of memory a data transport registers as its region.
    All host memory is ``DRAM``, however it was allocated (process memory, a ``/dev/shm``
    mapping, pinned pages); ``DRAM`` is required, since the tier's region is host memory
    (vLLM's CPU tier), and the data suites fail without it. Other kinds (``VRAM``) are
    claims on top of it.
    """

    cross_process: bool
    cross_host: bool
    memory_kinds: frozenset[str] = frozenset({"DRAM"})
    auth: bool = False
    heartbeats: bool = False
    two_sided: bool = False

    def as_dict(self) -> dict[str, Any]:
        return {
            "cross_process": self.cross_process,
            "cross_host": self.cross_host,
            "memory_kinds": sorted(self.memory_kinds),
            "auth": self.auth,
            "heartbeats": self.heartbeats,
            "two_sided": self.two_sided,
        }


class PollResult(NamedTuple):
    """Transfer ids that reached a terminal state since the previous poll of the same scope.

    Each id appears in exactly one ``PollResult`` over the transport's lifetime (never both
    ``done`` and ``failed``, never twice). Sequences may be shared immutable objects.
    """

    done: Sequence[int]
    failed: Sequence[int]


EMPTY_POLL = PollResult((), ())


@dataclass(frozen=True)
class ControlSettings:
    """What a control transport is built from.

    ``host``/``port`` is where to listen; ``port`` 0 asks for an ephemeral port, reported by
    ``local_address``. ``max_frame_bytes`` caps every frame in both directions. ``options`` is
    the transport-specific part of the tier config (``control_options``); unknown keys must be
    refused with ``ConfigError`` naming the key. ``dp_rank`` is the data-parallel rank already
    added to ``port`` (``TierConfig.dp_rank``); transports use it only to explain errors (a
    port in use names the base port, the rank offset and ``port_setting``).
    ``host_setting``/``port_setting`` say how the operator changes the host and base port
    in this deployment (the variable in force: ``VLLM_P2P_SIDE_CHANNEL_PORT`` under vLLM,
    ``P2PKV_PORT`` standalone, or the tier config key); errors about them must use these.
    ``handshake_timeout`` is the tier's ``timeouts.handshake``: transports that run a
    handshake of their own (and close inbound connections that never complete one) bound it
    with this unless an option of theirs says otherwise.
    """

    host: str
    port: int
    max_frame_bytes: int = 64 * 1024 * 1024
    options: Mapping[str, Any] = field(default_factory=dict)
    dp_rank: int = 0
    handshake_timeout: float = 10.0
    host_setting: str = "the tier config key 'host' or the environment variable P2PKV_HOST"
    port_setting: str = "the tier config key 'port' or the environment variable P2PKV_PORT"


@dataclass(frozen=True)
class DataSettings:
    """What a data transport is built from.

    ``region`` is a 1-D, C-contiguous, writable byte buffer of ``num_blocks * block_len``
    bytes owned by the caller (the engine's KV region). The transport registers it for the
    transport's lifetime and must not keep a reference after ``close()`` returns (unless it
    reports undrained transfers, see ``close``). ``options`` is ``data_options``: unknown
    keys must be refused with ``ConfigError`` naming the key. A transport with a drain
    deadline (how long a removed peer's internal transfers may still run, in later
    ``progress`` calls, before they are given up) calls that option ``drain_timeout``, in
    seconds. No call waits that long: ``close`` waits at most :data:`DRAIN_GRACE`.
    """

    region: memoryview
    block_len: int
    options: Mapping[str, Any] = field(default_factory=dict)

    @property
    def num_blocks(self) -> int:
        return self.region.nbytes // self.block_len


class _Transport(ABC):
    name: ClassVar[str]
    kind: ClassVar[TransportKind]
    capabilities: ClassVar[Capabilities]

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        """Return why this transport cannot be used here, or None if it can.

        Must be cheap and must not raise; it may import the transport's library.
        """
        return None


class ControlConnection(ABC):
    """An ordered, message-framed, bidirectional channel to one peer.

    Frames sent on one connection arrive at the peer in order, each exactly once, or the
    connection dies. The transport owns liveness: a peer that closes, crashes or stops
    answering makes ``alive`` False within the transport's configured timeout.
    """

    close_reason: str | None = None
    """Why the connection ended, once it has, in words an operator acts on ("connection
    refused", "no such host", "security handshake failed: ..."); None while alive, or when
    the transport cannot tell. The core puts it into the detail of the jobs that fail."""

    @property
    @abstractmethod
    def peer_address(self) -> str:
        """The peer's dialable address; equal to what ``connect`` was given for that peer."""

    @property
    @abstractmethod
    def alive(self) -> bool:
        """False once the connection is closed locally, closed by the peer, or the peer is dead."""

    @abstractmethod
    def send(self, frame: bytes) -> None:
        """Queue one frame; never blocks.

        Raises ``ConnectionClosed`` on a dead or closed connection, ``SendQueueFull`` when the
        bounded queue is full, ``FrameTooLarge`` when our own frame exceeds the size cap (not
        ``ProtocolError``: the peer did nothing wrong). The caller keeps ownership of
        ``frame``; the transport copies it if it needs it later.

        ``SendQueueFull`` is back-pressure, not a failure: the frame was not queued, the
        connection stays alive (the transport must not close it for that), and the same
        frame sent again once the peer drained some of the queue (after a ``poll``) goes
        out. The core holds such frames, in order, and retries them every tick.
        """

    @abstractmethod
    def recv(self) -> Sequence[bytes]:
        """Drain every frame received since the last call, in order (possibly empty).

        Frames arrive through the owning transport's ``poll``; ``recv`` does no I/O itself.
        """

    @abstractmethod
    def close(self) -> None:
        """Close; idempotent. The peer sees the connection die; frames not yet sent may be lost."""


class ControlTransport(_Transport):
    """Listens on one address, dials peers, and drives all control I/O from ``poll``."""

    kind: ClassVar[TransportKind] = "control"

    @classmethod
    @abstractmethod
    def create(cls, settings: ControlSettings) -> ControlTransport:
        """Bind and listen. Raises ``ConfigError`` (address in use, bad option) or
        ``TransportUnavailable``. On failure nothing stays bound."""

    @property
    @abstractmethod
    def local_address(self) -> str:
        """The address peers dial to reach us: ``host:port`` or ``[v6]:port``.

        The tier dials only that form (a request names its producer by host and port); a
        medium without IP addresses maps it onto its own (docs/plugin-authors.md)."""

    @abstractmethod
    def connect(self, address: str) -> ControlConnection:
        """Open (or return the live) connection to ``address``; never blocks.

        Frames may be sent at once; they are delivered once the peer is reachable. A dead
        connection registered for the same address is retired and replaced.
        """

    @abstractmethod
    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        """Do all pending I/O and return connections accepted since the last call.

        Each inbound peer is returned exactly once, with its first frames already buffered.
        Waits at most ``timeout`` seconds for I/O (0 = never wait).
        """

    @abstractmethod
    def close(self) -> None:
        """Close every connection and stop listening; idempotent."""

    def take_active(self) -> Collection[ControlConnection] | None:
        """The connections that, since the previous call, received frames or stopped being
        alive, each listed once. None: this transport does not track them, and the tier
        visits every connection each tick (as before). Driver thread, after poll().

        A connection counts as stopped when it dies for any reason, a local ``close``
        included; one that ``poll`` just returned with frames buffered is listed. A
        connection whose frames the tier has not drained yet is the tier's to remember: it
        is listed again only when something new happens to it. With it, a tick costs what
        its active connections cost, not what all of them cost (:mod:`p2pkv.tiering.tick`).
        The default returns None."""
        return None

    def batch_sends(self) -> bool:
        """Ask the transport to batch: from now on ``send`` may leave frames queued until
        :meth:`flush` (or the next ``poll``), so the frames of one tick cost its I/O one
        wake-up instead of one each. Returns whether it will (then the caller must flush: the
        tier does as each of its public calls that sent a frame returns, so a frame never
        waits for the next tick, except a terminal fetch: that cleanup waits for the next
        flush or ``poll``). The default declines (False): ``send`` keeps putting frames on
        their way itself, and nobody needs to flush. Driver thread only."""
        return False

    def flush(self) -> None:
        """The flush point of a transport that batches (:meth:`batch_sends`): put on the wire
        every frame the connections' ``send`` queued. Never blocks, never raises; frames a
        full queue cannot take stay queued, in order, for the next ``flush`` or ``poll``. The
        default does nothing. Driver thread only."""

    def interrupt(self) -> None:
        """End a ``poll`` that is waiting now (or, if none is, the next one) at once. The one
        call of this contract that another thread may make while the driver thread polls;
        never blocks, and never races ``close`` (the driver's thread closes). The default
        does nothing: a poll then ends at its timeout, so a transport without it only makes
        the thread that wants the tier wait up to that timeout (``P2PTier.interrupt``)."""

    def forget_dial_failure(self, address: str) -> None:
        """Forget that a dial to ``address`` failed, if this transport remembers failed
        dials (a negative cache that answers the next ``connect`` with a dead connection).
        The tier calls it when a pre-connect dial failed: that failure paces pre-connect
        only, so a request naming the peer then dials it for real. The default does
        nothing. Driver thread only."""

    def session_room(self) -> SessionRoom | None:
        """How many sessions this transport can still open and hold in all, when a resource
        bounds them (sockets, descriptors, a configured cap); None when it knows no such
        bound (the default). Driver thread, after ``poll``; cheap (the tier asks after each
        session it opens).

        The tier keeps room for new peers with it: when ``free`` falls below a reserve it
        closes the sessions peers dialed to it that are idle, least recently active first
        (:mod:`p2pkv.tiering.accept_room`), so a new consumer is not refused while idle ones
        hold the room. A transport that reports it should count ``accepts_refused``."""
        return None

    @property
    def accepts_refused(self) -> int:
        """Peers' connections this transport refused since it was created for lack of room
        for their session (out of sockets or descriptors, over a cap); a counter the tier
        exports as ``peers_accept_refused``. The default: 0 (it never refuses, or does not
        count)."""
        return 0

    @property
    def silence_timeout(self) -> float | None:
        """Seconds this process may go without any control I/O before its peers drop its
        connections as dead (a transport with heartbeats: the silence its peers tolerate),
        or None when the transport has no such limit (the default).

        The tier compares the gap between two of its own ticks with it: a longer gap means
        this process was paused (SIGSTOP, a VM migration, a stall) long enough for every
        peer to have given up on it, so it closes its sessions at once on the resume
        instead of finding out frame by frame (docs/reliability.md, "consumer resumed")."""
        return None


class _Registration:
    """One ``add_peer`` of a peer (the base's): the descriptor it was added with, the
    backend's peer record, and its reads still in flight (id -> backend handle)."""

    __slots__ = ("descriptor", "peer", "reads")

    def __init__(self, descriptor: bytes, peer: AttachedPeer) -> None:
        self.descriptor = descriptor
        self.peer = peer
        self.reads: dict[int, Any] = {}


class DataBackend(ABC):
    """The primitives a data backend implements, declared together; :class:`DataTransport` is
    the rich base that calls them (its docstring states the contract they serve).

    Required: ``descriptor``, ``_attach_peer``, ``_post_read`` and ``_read_state``. The
    others have defaults that suit a backend whose reads move bytes only inside its own
    calls. Every primitive is called on the driver thread only, never after ``close`` (except
    ``_shutdown``, by it), and must not block beyond a call's contract.

    - ``descriptor()`` (public): our region's descriptor bytes.
    - ``_attach_peer(peer_id, descriptor)``: the peer's record (anything with a
      ``num_blocks``), or ``PeerRejected``. Any other exception becomes ``PeerRejected``.
    - ``_peer_usable(peer)``: whether a record can still serve reads (default: always).
    - ``_post_read(peer, local, remote)``: post a checked read (int64 arrays of its own) and
      return a handle. Any exception other than ``TransferSubmitError`` becomes
      ``TransferSubmitError`` (chained). Nothing of a refused read may land. A read that
      does not fit a bounded resource now raises ``TransferBusy`` (and the transport
      answers ``read_capacity``).
    - ``_read_state(handle)``: a ``ReadState``. Returning ``DONE`` or ``FAILED`` hands the
      read back (its resources released). An exception fails the read: the base ends it with
      ``_end_reads`` and reports it failed, never leaves it in flight.
    - ``_end_reads(handles)``: end reads finally (see ``DataTransport.cancel``); default:
      nothing to end.
    - ``_progress()``: drive I/O, serve peers' reads; default: nothing to do.
    - ``_detach_peer(peer)`` / ``_shutdown()``: release a peer / everything (every read
      already ended), never waiting for a peer. Each returns internal ids still running;
      default ``[]``.
    - ``_held()``: what the transport still holds after the calls that ended its use (see
      ``DataTransport.held``); default: nothing.
    """

    @abstractmethod
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_peer`` to be able to read from our region."""

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> AttachedPeer:
        """The peer's record from its descriptor (its ``num_blocks`` bounds remote indexes);
        ``PeerRejected`` saying why (malformed, another ``block_len``, unreachable)."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither add_peer nor _attach_peer"
        )

    def _peer_usable(self, peer: Any) -> bool:
        """Whether an attached peer record can still serve reads (``add_peer`` with the same
        descriptor keeps a usable one and replaces an unusable one). The default: always."""
        return True

    def _detach_peer(self, peer: Any) -> list[int]:
        """Release a peer record (removed, or replaced by a new descriptor); its reads have
        ended. Never waits for the peer: returns the internal ids with it still running,
        which later ``_progress`` calls settle (or give up at the drain deadline)."""
        return []

    def _post_read(self, peer: Any, local: Indexes, remote: Indexes) -> Any:
        """Post a read of the peer's blocks ``remote`` into our blocks ``local`` (checked;
        the arrays are the backend's to keep); return its handle. Must not block."""
        raise NotImplementedError(
            f"{type(self).__name__} implements neither read_blocks nor _post_read"
        )

    def _read_state(self, handle: Any) -> ReadState:
        """Where a posted read stands; called only by ``poll``, at most once per read per
        poll, never again once it returned ``DONE``/``FAILED`` (the read's resources are
        released by then, a staged read's bytes copied into its blocks before ``DONE``)."""
        raise NotImplementedError(f"{type(self).__name__} implements neither poll nor _read_state")

    def _end_reads(self, handles: list[Any]) -> None:
        """End posted reads finally: on return none of their bytes can land in our blocks
        (stop them, or quarantine their staging). Never waits for a peer; must not raise.
        The base has already forgotten them.

        The default does nothing, which is right only for a backend that finds its reads
        through the base (``_reads_in_flight``) and moves bytes only inside its own calls: a
        read the base forgot is then never touched again. A backend that keeps reads anywhere
        else (a queue of its own, a thread, the library) implements it, or a cancelled read
        still lands."""
        return None

    def _progress(self) -> None:
        """Drive the backend's I/O, serve peers' reads of our region; report nothing. Must
        not block; never called after ``close``."""
        return None

    def _shutdown(self) -> list[int]:
        """Release every peer still added (``close`` does not call ``_detach_peer`` for
        them), the backend's resources and its registration of the region (every read has
        ended; called once, by ``close``), so that peers' reads of the region fail from now
        on. May progress internal transfers for :data:`DRAIN_GRACE` at most, never waiting
        for a stopped peer longer; returns the internal ids still running then (their memory
        stays registered); must not raise."""
        return []

    def _held(self) -> Mapping[str, int]:
        """Counts by kind of what the backend still holds after the calls that ended its
        use (see ``held``); zero counts may be included. Must not raise. Default: ``{}``."""
        return {}


_DataT = TypeVar("_DataT", bound="DataTransport")


class DataTransport(_Transport, DataBackend):
    """Moves whole blocks of a peer's registered region into ours, posted by us.

    **The consumer owns every write into its region** (docs/protocol.md §1): the only transfers that
    land in our region are the reads *we* post with ``read_blocks``. A peer's transport never
    writes into our region on its own; at most it serves our reads (two-sided transports send
    what we asked for, into receives we posted).

    **A cancelled read is final.** When ``cancel``, ``remove_peer`` or ``close`` returns, no
    byte of the reads they ended can land in our region any more, whatever the peer does later
    (paused, partitioned, resumed with stale state). A transport whose library cannot stop a
    posted transfer makes it so by other means: it reads through a staging area of its own and
    copies into our blocks only after a valid completion, or it tears the endpoint down and
    waits for the error. Ended ids are forgotten: never reported by ``poll``.

    Ids: ``read_blocks`` returns transfer ids unique for the transport's lifetime; each
    reaches exactly one terminal state, reported once by ``poll`` (unless cancelled first).

    Progress: ``poll`` and ``progress`` must also progress *inbound* work: reads a peer posted
    against our region (a two-sided transport serves them here; a one-sided one may need the
    source to keep calling in). Callers therefore poll every tick, even with nothing of their
    own in flight.

    Source blocks: the transport never decides how long a peer's source blocks stay valid;
    the session protocol does (the producer pins them under a lease, docs/protocol.md §5).

    **After ``close``, peers read nothing of our region.** Once ``close`` returned, the
    region is its caller's again (an engine reuses or unmaps it at once), so no peer's read
    of it may complete any more: a read posted afterwards is refused by the peer's
    ``read_blocks`` or ends ``failed`` at the peer, and one still in flight ends ``failed``
    (``done`` only if every byte had arrived before ``close`` returned). This holds for every
    kind of transport: a one-sided one deregisters the region (or otherwise invalidates what
    its descriptor gave peers) inside ``close``, a two-sided one stops serving. The shutdown
    of a tier relies on it (docs/protocol.md, "Shutdown": pins dropped before their lease are
    protected only by this).

    **Isolation: a stopped peer never stalls or fails another.** No call keeps the driver
    thread longer than :data:`DRIVER_BOUND` because of a peer (see the module docstring):
    ``remove_peer`` and ``close`` return what still runs instead of waiting for it, and later
    ``progress`` calls finish it; ``held`` shows it meanwhile. Every bounded resource that
    peers share (staging, slots, windows, receive queues) gives each peer a share, so a
    peer frozen with transfers in flight holds at most its share and every other peer's
    transfers go on. A transport either shares such a resource itself, or declares it
    (``read_capacity``, ``TransferBusy``) and the tier shares it (docs/configuration.md,
    "Shares of shared budgets"). The conformance kit checks both rules.

    **The base class.** This class is a working base, not only an interface: it owns the
    bookkeeping every transport needs (region checks, transfer ids, per-peer read tables,
    exactly-once reports, scoped ``poll``, final ``cancel``, the re-add rule, ``remove_peer``,
    an idempotent ``close`` and the after-close behaviour, the index check, error mapping). A
    backend implements the primitives of :class:`DataBackend`, declared there together, and
    called only on the driver thread.

    The base's own state (``_blocks``, the region as a ``(num_blocks, block_len)`` uint8
    view for backends; ``_transfer_ids``, the one id sequence internal transfers draw from
    too) is set by ``DataTransport.__init__``. A transport may still override every public
    method instead (and then need not call ``__init__``).
    """

    kind: ClassVar[TransportKind] = "data"
    _closed: bool = False
    """Set by ``close``. A class default, so a transport that overrides every public method
    and never calls ``DataTransport.__init__`` still inherits a working ``progress``."""
    descriptors_posted: int | None = None
    """Transfer operations this transport posted to its library so far, one per run of
    blocks it moves as one (a NIXL descriptor, a UCX message), for the reads it made and
    those it served; ``None`` (the default) when the backend does not count them.
    ``P2PTier.stats`` reports it as ``descriptors_posted``, and ``p2pkv bench --tier`` as
    descriptors per request. Read on the driver thread."""

    def __init__(self, settings: DataSettings) -> None:
        """Check the region once (``ConfigError``: not a memoryview, read-only, not
        C-contiguous, not a positive multiple of ``block_len``, ``block_len`` not a positive
        int) and set up the base's bookkeeping. A backend checks its options (unknown keys
        refused with ``ConfigError`` naming the key) and sets itself up after this."""
        self._blocks: npt.NDArray[np.uint8] = region_blocks(settings.region, settings.block_len)
        self._num_blocks, self._block_len = (int(n) for n in self._blocks.shape)
        self._registrations: dict[str, _Registration] = {}
        self._read_owner: dict[int, _Registration] = {}
        self._transfer_ids = itertools.count(1)
        self._closed = False

    @classmethod
    def create(cls, settings: DataSettings) -> Self:
        """Register ``settings.region``. Raises ``ConfigError`` or ``TransportUnavailable``.
        Default: ``cls(settings)``."""
        return cls(settings)

    @classmethod
    def allocate_region(
        cls, num_blocks: int, block_len: int, options: Mapping[str, Any]
    ) -> memoryview:
        """Allocate a zeroed region of ``num_blocks * block_len`` bytes this transport can
        register (the caller then passes it in ``DataSettings.region``).

        The conformance kit, ``p2pkv demo``/``bench`` and standalone tiers get their regions
        here, so a transport that works best on host memory of its own allocation (a
        ``/dev/shm`` mapping, pinned pages: still ``DRAM`` in ``Capabilities.memory_kinds``)
        overrides this and is tested on that memory. In production the region is never from
        here (inside vLLM it is vLLM's own ``/dev/shm`` mapping): ``create`` must register
        host memory it did not allocate, or fail naming why (docs/plugin-authors.md, "Whose
        memory the region is"). ``options`` is ``data_options``: take the keys you need and
        ignore the rest (refusing unknown keys is ``create``'s job). The region lives as long
        as the returned view; the default is anonymous, zero-filled process memory. Raises
        ``ConfigError`` or ``TransportUnavailable`` when it cannot allocate.
        """
        import numpy as np

        return np.zeros(num_blocks * block_len, dtype=np.uint8).data

    def __enter__(self: _DataT) -> _DataT:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    # -- peers ----------------------------------------------------------------------------

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        """Register a peer's region. Raises ``PeerRejected`` (with the reason) when the
        descriptor is malformed or the region shape does not match ours, and after ``close``.
        Re-adding a known peer with another descriptor (a new incarnation) replaces it: reads
        of the old registration end first, finally (as ``cancel``), and are never reported;
        a rejected new descriptor leaves the old registration as it was. Re-adding it with
        the same descriptor keeps the registration and its reads, unless the backend says the
        peer record is no longer usable (``_peer_usable``: e.g. its endpoint failed while the
        peer was paused or cut off, and it came back with the same descriptor): then the peer
        is removed (its reads have failed already; they end unreported) and attached afresh.

        The base attaches the new descriptor first, then ends the old registration's reads
        and detaches it (internal ids it leaves running are the backend's to keep; ``close``
        reports them if they still run)."""
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the {self.name} data transport is closed")
        old = self._registrations.get(peer_id)
        if old is not None and old.descriptor == descriptor:
            if self._peer_usable(old.peer):
                return
            self.remove_peer(peer_id)
            old = None
        new = _Registration(bytes(descriptor), self._attached(peer_id, descriptor))
        if old is not None:
            self._end_registration(old)
            self._detach_peer(old.peer)
        self._registrations[peer_id] = new

    def remove_peer(self, peer_id: str) -> list[int]:
        """Forget a peer. Its reads into our region end first, finally (as ``cancel``); they
        are never reported. Returns the ids of the transport's *internal* transfers with that
        peer (serving its reads of our region, a warm-up) still running: never waited for
        (the peer may be stopped; see :data:`DRIVER_BOUND`), they end in later ``progress``
        calls or are given up by the transport's drain deadline (option ``drain_timeout``, by
        convention), and their resources are kept until then (never released under a live
        transfer; ``held`` shows them). Never a read id, never an id ``poll`` already
        reported. An unknown peer, or any peer after ``close``: ``[]``."""
        registration = self._registrations.pop(peer_id, None)
        if registration is None:
            return []
        self._end_registration(registration)
        return self._detach_peer(registration.peer)

    def held(self) -> dict[str, int]:
        """What the transport still holds after the calls that ended its use: internal
        transfers of removed peers still running, their endpoints, memory kept registered,
        staging a cancelled read still owns. A debug view by kind (``{"sends": 3}``), only
        the kinds with a count above zero; ``{}`` when nothing is held. Tests and operators
        read it to see that a stopped peer's leftovers are accounted for until released
        (see :data:`DRIVER_BOUND`). Cheap; driver thread; valid after ``close`` too. The
        base asks the backend's ``_held``."""
        return {kind: count for kind, count in sorted(self._held().items()) if count > 0}

    def attached_peer(self, peer_id: str) -> AttachedPeer | None:
        """The backend's record of ``peer_id`` as currently added (what ``_attach_peer``
        returned), or None when it is not added. A read-only view for tests and diagnostics:
        the base never hands it out otherwise and callers must not keep it past a
        ``remove_peer``/re-add. Cheap; driver thread."""
        registration = self._registrations.get(peer_id)
        return registration.peer if registration is not None else None

    def read_handle(self, transfer_id: int) -> Any:
        """The backend's handle of read ``transfer_id`` (what ``_post_read`` returned) while
        it is in flight (posted, not yet reported, cancelled or ended by a peer removal), or
        None. A read-only view for tests and diagnostics, like :meth:`attached_peer`."""
        registration = self._read_owner.get(transfer_id)
        return registration.reads.get(transfer_id) if registration is not None else None

    # -- reads ----------------------------------------------------------------------------

    def read_capacity(self, peer_id: str) -> int | None:
        """Blocks that reads from ``peer_id`` may have in flight at once in a bounded
        resource they share with other peers' reads (a staging pool), or None when reads
        from it need no such resource (the default).

        Every peer that answers a number shares *one* such resource of that size. It is an
        upper bound for planning, not a promise: ``read_blocks`` raises ``TransferBusy``
        (nothing posted) when a read does not fit *now* (earlier reads, or cancelled reads
        the transport keeps out of use, hold the rest) and a final ``TransferSubmitError``
        when it could never fit. The tier shares the capacity fairly among the peers that
        have reads waiting (docs/configuration.md, "Flow control"). Cheap; driver thread."""
        return None

    def check_read(
        self,
        local_idxs: Sequence[int],
        remote_idxs: Sequence[int],
        peer_num_blocks: int,
        peer_id: str = "",
    ) -> tuple[Indexes, Indexes]:
        """``p2pkv.data_base.check_read`` against our ``num_blocks``: the one index rule of
        ``read_blocks``. Returns fresh int64 arrays; ``TransferSubmitError`` naming the
        offending index."""
        return _check_read(local_idxs, remote_idxs, self.num_blocks, peer_num_blocks, peer_id)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Start copying the peer's block ``remote_idxs[i]`` into our block ``local_idxs[i]``.

        Non-blocking. Both lists are checked before anything is posted (``check_read``):
        equal lengths, not empty, flat sequences of integers, ``local_idxs`` within ours and
        without duplicates, ``remote_idxs`` within the peer's advertised ``num_blocks``; a
        remote index may repeat (one source block may fill two slots). The typed contract is
        ``Sequence[int]``, which the tier passes; at run time ``check_read`` also takes
        numpy integers and 1-D integer arrays (a caller doing so casts for mypy).

        Raises ``TransferSubmitError`` on any failure (unknown peer, bad index naming it, empty
        read, backend refusal, closed transport); never returns a sentinel. Its subclass
        ``TransferBusy`` says the read does not fit a bounded resource *now* (see
        ``read_capacity``): retry it after a ``poll``. Our destination blocks must not be
        touched by the caller until the id is reported or cancelled. A refusal is final like a
        cancel: nothing of the read can land after ``read_blocks`` raised; a backend that copies
        as it posts (NIXL over ``cma``) may have written the named blocks before it noticed the
        failure (a peer that died under the call), so their contents are garbage, never data.
        """
        if self._closed:
            raise TransferSubmitError(f"the {self.name} data transport is closed")
        registration = self._registrations.get(peer_id)
        if registration is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        peer = registration.peer
        local, remote = self.check_read(local_idxs, remote_idxs, peer.num_blocks, peer_id)
        try:
            handle = self._post_read(peer, local, remote)
        except (TransferSubmitError, NotImplementedError):
            raise
        except Exception as exc:
            raise TransferSubmitError(
                f"peer {peer_id!r}: {self.name} could not post the read "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        transfer_id = next(self._transfer_ids)
        registration.reads[transfer_id] = handle
        self._read_owner[transfer_id] = registration
        return transfer_id

    def progress(self) -> None:
        """Progress inbound and outbound I/O without reporting or forgetting anything.

        The tier calls this every tick (even with no session), so peers' reads of our region
        are served. Must not block. After ``close``: nothing. The base calls ``_progress``."""
        if not self._closed:
            self._progress()

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Progress all I/O; report and forget terminal reads of ``peer_id``.

        With ``peer_id``, only that peer's reads are examined and drained (other peers'
        completions stay for their own poll). ``None`` drains every peer (shutdown only).
        ``done`` means every byte of the read is in our blocks; an error while checking a read
        fails it, it is never left in flight. A read from a peer whose transport closed or
        whose process died ends ``failed`` within the transport's own deadline (``done`` only
        if every byte arrived before the close or the death); it never stays in flight
        forever, and a read posted after the peer's ``close`` returned never ends ``done``
        (its region is its caller's again). After ``close``: ``EMPTY_POLL``.
        """
        if self._closed:
            return EMPTY_POLL
        self._progress()
        if peer_id is None:
            registrations: Iterable[_Registration] = self._registrations.values()
        else:
            one = self._registrations.get(peer_id)
            if one is None or not one.reads:
                return EMPTY_POLL
            registrations = (one,)
        done: list[int] = []
        failed: list[int] = []
        for registration in registrations:
            if registration.reads:
                self._settle(registration, done, failed)
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        """End reads, finally: on return none of their bytes can land in our region any more,
        and they are never reported. Unknown or already reported ids are ignored. Never
        waits for a peer (:data:`DRIVER_BOUND`): a transport that cannot end a read at once
        keeps its bytes out of our blocks by other means (staging) instead."""
        handles = []
        for transfer_id in transfer_ids:
            registration = self._read_owner.pop(transfer_id, None)
            if registration is not None:
                handles.append(registration.reads.pop(transfer_id))
        if handles:
            self._end_reads(handles)

    def close(self) -> list[int]:
        """End every read (as ``cancel``), release peers and deregister the region; idempotent.

        Internal transfers may be progressed for :data:`DRAIN_GRACE` at most (a stopped peer
        is never waited for longer); those still live are returned (as for ``remove_peer``),
        and then the region stays registered (leaked on purpose rather than freed under DMA;
        ``held`` says what is kept). A second ``close`` returns ``[]``. After ``close``:
        ``read_blocks`` raises ``TransferSubmitError``, ``add_peer`` raises ``PeerRejected``,
        ``poll`` returns ``EMPTY_POLL``, ``cancel``/``remove_peer``/``progress`` do nothing.
        When nothing is left running, the base drops its view of the region (it is the
        caller's again).

        Peers' reads of the region fail from the moment ``close`` returns (see the class
        docstring): the backend's ``_shutdown`` deregisters it, or stops serving. ``close``
        does not call ``_detach_peer`` for the peers still added: ``_shutdown`` releases them.
        """
        if self._closed:
            return []
        self._closed = True
        handles = [h for r in self._registrations.values() for h in r.reads.values()]
        self._registrations.clear()
        self._read_owner.clear()
        if handles:
            self._end_reads(handles)
        undrained = sorted(self._shutdown())
        if not undrained:
            self._blocks = np.empty((0, self._block_len), np.uint8)
        return undrained

    # -- the base's helpers ---------------------------------------------------------------

    def _attached(self, peer_id: str, descriptor: bytes) -> AttachedPeer:
        """``_attach_peer`` with every refusal a ``PeerRejected`` naming the peer."""
        try:
            peer = self._attach_peer(peer_id, descriptor)
        except (PeerRejected, NotImplementedError):
            raise
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: malformed {self.name} descriptor ({type(exc).__name__}: {exc})"
            ) from exc
        blocks = peer.num_blocks
        if not isinstance(blocks, int) or isinstance(blocks, bool) or blocks <= 0:
            raise PeerRejected(f"peer {peer_id!r}: its region has {blocks!r} blocks")
        return peer

    def _end_registration(self, registration: _Registration) -> None:
        """End (finally, unreported) every read of ``registration``."""
        for transfer_id in registration.reads:
            del self._read_owner[transfer_id]
        handles = list(registration.reads.values())
        registration.reads.clear()
        if handles:
            self._end_reads(handles)

    def _settle(self, registration: _Registration, done: list[int], failed: list[int]) -> None:
        """Ask the backend for the state of each read of ``registration``; report (append to
        ``done``/``failed``) and forget the terminal ones."""
        ended = []
        for transfer_id, handle in registration.reads.items():
            state = self._checked_state(transfer_id, handle)
            if state is ReadState.PENDING:
                continue
            ended.append(transfer_id)
            (done if state is ReadState.DONE else failed).append(transfer_id)
        for transfer_id in ended:
            del registration.reads[transfer_id]
            del self._read_owner[transfer_id]

    def _checked_state(self, transfer_id: int, handle: Any) -> ReadState:
        """``_read_state``; one that raises fails the read, which is ended first."""
        try:
            return self._read_state(handle)
        except NotImplementedError:
            raise
        except Exception as exc:
            log.warning("%s: checking read %d failed; failing it: %s", self.name, transfer_id, exc)
            self._end_reads([handle])
            return ReadState.FAILED

    def _reads_in_flight(self) -> Iterator[Any]:
        """The handles of every read posted and not yet reported or ended."""
        for registration in self._registrations.values():
            yield from registration.reads.values()
