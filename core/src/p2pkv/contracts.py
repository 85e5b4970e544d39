"""Transport contracts: what the core needs from a control plane and a data plane.

Threading model (applies to every class here): all public methods are called from **one
driver thread at a time** (the tier's). A transport may run I/O threads of its own, but it
never calls back into the core from them, and it never blocks the driver longer than a call's
contract allows. Transports carry opaque bytes; encoding, validation and the session protocol
live in the core.

Construction goes through ``create(settings)`` so the registry can build any transport from a
tier config; ``availability()`` lets ``p2pkv plugins`` explain a transport whose library is
missing without constructing it.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, NamedTuple

from p2pkv.errors import TransportUnavailable

__all__ = [
    "EMPTY_POLL",
    "Capabilities",
    "ControlConnection",
    "ControlSettings",
    "ControlTransport",
    "DataSettings",
    "DataTransport",
    "PollResult",
    "TransportKind",
]

TransportKind = Literal["control", "data"]


@dataclass(frozen=True)
class Capabilities:
    """What a transport claims to support; the conformance kit and ``p2pkv plugins`` read it.

    ``two_sided`` marks data transports whose reads need the *source* side's transport to take
    part (it serves them from ``progress``/``poll``: tagged sends), as opposed to one-sided
    RDMA-style reads the source's library serves alone. ``heartbeats`` marks control
    transports that detect a silent peer on their own (not only a closed socket).
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
    reports undrained transfers, see ``close``). ``options`` is ``data_options``.
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
        bounded queue is full, ``ProtocolError`` when the frame exceeds the size cap. The caller
        keeps ownership of ``frame``; the transport copies it if it needs it later.
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
        """The address peers dial to reach us (``host:port``, ``[v6]:port``, ``mem://...``)."""

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


class DataTransport(_Transport):
    """Moves whole blocks of a peer's registered region into ours, posted by us.

    **The consumer owns every write into its region** (DESIGN.md §1): the only transfers that
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
    """

    kind: ClassVar[TransportKind] = "data"

    @classmethod
    @abstractmethod
    def create(cls, settings: DataSettings) -> DataTransport:
        """Register ``settings.region``. Raises ``ConfigError`` or ``TransportUnavailable``."""

    @classmethod
    def allocate_region(
        cls, num_blocks: int, block_len: int, options: Mapping[str, Any]
    ) -> memoryview:
        """Allocate a zeroed region of ``num_blocks * block_len`` bytes this transport can
        register (the caller then passes it in ``DataSettings.region``).

        The conformance kit, ``p2pkv demo``/``bench`` and standalone tiers get their regions
        here, so a transport that can only register memory of its own kind (a ``/dev/shm``
        mapping, pinned or device memory) overrides this and is tested on that memory.
        ``options`` is ``data_options``. The region lives as long as the returned view; the
        default is anonymous, zero-filled process memory. Raises ``ConfigError`` or
        ``TransportUnavailable`` when it cannot allocate.
        """
        import numpy as np

        return memoryview(np.zeros(num_blocks * block_len, dtype=np.uint8))

    @property
    @abstractmethod
    def num_blocks(self) -> int: ...

    @property
    @abstractmethod
    def block_len(self) -> int: ...

    @abstractmethod
    def descriptor(self) -> bytes:
        """Opaque bytes a peer passes to its ``add_peer`` to be able to read from our region."""

    @abstractmethod
    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        """Register a peer's region. Raises ``PeerRejected`` (with the reason) when the
        descriptor is malformed or the region shape does not match ours. Re-adding a known
        peer with another descriptor (a new incarnation) replaces it: reads of the old
        registration end first, finally (as ``cancel``). Re-adding it with the same
        descriptor keeps the registration and its reads."""

    @abstractmethod
    def remove_peer(self, peer_id: str) -> list[int]:
        """Forget a peer. Its reads into our region end first, finally (as ``cancel``); they
        are never reported. Returns the ids of the transport's *internal* transfers with that
        peer (serving its reads of our region, a warm-up) that did not drain within the
        transport's drain deadline; their resources are kept (never released under a live
        transfer). Never a read id, never an id ``poll`` already reported."""

    @abstractmethod
    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Start copying the peer's block ``remote_idxs[i]`` into our block ``local_idxs[i]``.

        Non-blocking. Both lists are checked before anything is posted: equal lengths, not
        empty, ``local_idxs`` within ours and without duplicates, ``remote_idxs`` within the
        peer's advertised ``num_blocks``. Indexes may be any integers (``int``, numpy integers,
        or a 1-D integer array). Raises ``TransferSubmitError`` on any failure (unknown peer,
        bad index, backend refusal, closed transport); never returns a sentinel. Our
        destination blocks must not be touched by the caller until the id is reported or
        cancelled.
        """

    def progress(self) -> None:
        """Progress inbound and outbound I/O without reporting or forgetting anything.

        The tier calls this every tick (even with no session), so peers' reads of our region
        are served. Must not block. Default: nothing to do.
        """
        return None

    @abstractmethod
    def poll(self, peer_id: str | None = None) -> PollResult:
        """Progress all I/O; report and forget terminal reads of ``peer_id``.

        With ``peer_id``, only that peer's reads are examined and drained (other peers'
        completions stay for their own poll). ``None`` drains every peer (shutdown only).
        ``done`` means every byte of the read is in our blocks; an error while checking a read
        fails it, it is never left in flight.
        """

    @abstractmethod
    def cancel(self, transfer_ids: Sequence[int]) -> None:
        """End reads, finally: on return none of their bytes can land in our region any more,
        and they are never reported. Unknown or already reported ids are ignored. Never
        blocks longer than the transport's drain deadline; a transport that cannot end a read
        in that time keeps its bytes out of our blocks by other means (staging) instead."""

    @abstractmethod
    def close(self) -> list[int]:
        """End every read (as ``cancel``), release peers and deregister the region; idempotent.

        Internal transfers still live after the drain deadline are returned (as for
        ``remove_peer``), and then the region stays registered (leaked on purpose rather than
        freed under DMA). Any other call after ``close`` raises (``TransferSubmitError`` for
        ``read_blocks``) or returns nothing.
        """
