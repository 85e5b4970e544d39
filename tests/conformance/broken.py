"""Deliberately broken transports: each breaks one rule of the contract, and the kit must
catch every one (``test_kit_catches_broken.py``).

Each variant subclasses a correct transport (the example plugin's ``loopback`` ones, or the
kit's cross-process reference ``socket_transport``) and changes one behaviour (a primitive of
the ``DataTransport`` base, or a public method), so the only defect is the one its docstring
names. Together with ``sabotage.py`` they break every rule of the authors' contract table
(docs/plugin-authors.md) that behaviour can show.
"""

from __future__ import annotations

import ctypes
import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, cast

import numpy as np
from p2pkv.contracts import ControlConnection, DataSettings, PollResult, ReadState
from p2pkv_loopback import data as loopback_data
from p2pkv_loopback.control import LoopbackConnection, LoopbackControlTransport
from p2pkv_loopback.data import LoopbackDataTransport
from socket_transport import SocketDataTransport

# -- data ------------------------------------------------------------------------------------
# The loopback transport implements the primitives of the DataTransport base; a variant breaks
# a primitive where the base still lets the defect through, else a public method (the base
# makes some defects impossible for a transport that only implements primitives).


class EarlyDone(LoopbackDataTransport):
    """Reports a read done before its bytes are copied (they land one poll later)."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._late: list[Any] = []

    def _progress(self) -> None:
        late, self._late = self._late, []
        for read in late:
            self._copy(read)

    def _read_state(self, read: Any) -> ReadState:
        self._late.append(read)
        return ReadState.DONE


class IgnoresPeerInPoll(LoopbackDataTransport):
    """``poll(peer_id)`` drains every peer's completions."""

    def poll(self, peer_id: str | None = None) -> PollResult:
        return super().poll(None)


class NoBoundsCheck(LoopbackDataTransport):
    """Posts reads without checking block indexes (numpy wraps negatives, fails late)."""

    def check_read(
        self,
        local_idxs: Sequence[int],
        remote_idxs: Sequence[int],
        peer_num_blocks: int,
        peer_id: str = "",
    ) -> tuple[Any, Any]:
        return np.asarray(local_idxs, np.int64), np.asarray(remote_idxs, np.int64)

    def _copy(self, read: Any) -> bool:
        try:
            return super()._copy(read)
        except (IndexError, ValueError):
            return False


class AcceptsDuplicateLocal(LoopbackDataTransport):
    """Accepts a read that names one of our blocks twice (two sources for one slot)."""

    def check_read(
        self,
        local_idxs: Sequence[int],
        remote_idxs: Sequence[int],
        peer_num_blocks: int,
        peer_id: str = "",
    ) -> tuple[Any, Any]:
        local, remote = list(local_idxs), list(remote_idxs)
        unique = list(dict.fromkeys(local))
        super().check_read(unique, remote[: len(unique)], peer_num_blocks, peer_id)
        return np.asarray(local, np.int64), np.asarray(remote, np.int64)


class SpillsIntoNextBlock(LoopbackDataTransport):
    """Copies one byte too many: the first byte of our next block is clobbered."""

    def _copy(self, read: Any) -> bool:
        ok = super()._copy(read)
        source = loopback_data._REGIONS.get(read.region)
        if ok and source is not None:
            flat = self._blocks.reshape(-1)
            for li, ri in zip(read.local.tolist(), read.remote.tolist(), strict=True):
                end = (li + 1) * self.block_len
                if end < flat.size:
                    flat[end] = source[ri][-1] ^ 0xFF
        return ok


class StillWrites(LoopbackDataTransport):
    """The old direction: copies our blocks into the peer's instead of reading them."""

    def _copy(self, read: Any) -> bool:
        target = loopback_data._REGIONS.get(read.region)
        if target is None:
            return False
        target[read.remote] = self._blocks[read.local]
        return True


class ReportsTwice(LoopbackDataTransport):
    """Reports every finished read again on the next poll (only by overriding ``poll``: the
    base reports each read once)."""

    def poll(self, peer_id: str | None = None) -> PollResult:
        again = getattr(self, "_again", [])
        result = super().poll(peer_id)
        self._again = list(result.done)
        return PollResult([*result.done, *again], list(result.failed))


class ReportsCancelled(LoopbackDataTransport):
    """``cancel`` returns but ends nothing: the read still lands and is reported."""

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        return None


class _LandsLate(LoopbackDataTransport):
    """Reads ended while ``_leaking`` is set are forgotten by the base but still copy on a
    later progress or poll."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._leaking = False
        self._zombies: list[Any] = []

    def _end_reads(self, handles: list[Any]) -> None:
        if self._leaking:
            self._zombies += handles

    def _progress(self) -> None:
        super()._progress()
        zombies, self._zombies = self._zombies, []
        for read in zombies:
            self._copy(read)


class CancelLandsLate(_LandsLate):
    """``cancel`` forgets the id (never reported) but the copy still happens on a later
    progress or poll: bytes land in our region after cancel returned."""

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        self._leaking = True
        try:
            super().cancel(transfer_ids)
        finally:
            self._leaking = False


class RemovePeerLandsLate(_LandsLate):
    """``remove_peer`` drops the peer's reads from its books (never reported, never
    returned) but they still copy on a later progress or poll."""

    def remove_peer(self, peer_id: str) -> list[int]:
        self._leaking = True
        try:
            return super().remove_peer(peer_id)
        finally:
            self._leaking = False


class RemovePeerReturnsReads(LoopbackDataTransport):
    """The old wait-cancel ``remove_peer``: returns the peer's reads as undrained ids."""

    def remove_peer(self, peer_id: str) -> list[int]:
        registration = self._registrations.get(peer_id)
        gone = sorted(registration.reads) if registration is not None else []
        return [*super().remove_peer(peer_id), *gone]


class ForgetsOnProgress(LoopbackDataTransport):
    """``progress`` drains finished reads, which ``poll`` then never reports."""

    def progress(self) -> None:
        super().poll(None)


class AcceptsMismatchedPeer(LoopbackDataTransport):
    """Registers a peer whatever its block length."""

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Any:
        try:
            desc = json.loads(descriptor)
            return loopback_data._Peer(desc["loopback"], int(desc["num_blocks"]))
        except (ValueError, TypeError, KeyError):
            return super()._attach_peer(peer_id, descriptor)


class RaisesRawErrorsOnGarbage(LoopbackDataTransport):
    """A malformed descriptor escapes as ``ValueError``/``KeyError``, not ``PeerRejected``
    (only by overriding ``add_peer``: the base turns a primitive's error into
    ``PeerRejected``)."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        json.loads(descriptor)["loopback"]  # raises on garbage, unmapped
        super().add_peer(peer_id, descriptor)


class CloseNotIdempotent(LoopbackDataTransport):
    """A second ``close`` raises."""

    def close(self) -> list[int]:
        if self._closed:
            raise RuntimeError("already closed")
        return super().close()


class KeepsRegionAfterClose(LoopbackDataTransport):
    """Holds on to the caller's region after ``close`` returned ``[]``."""

    def _shutdown(self) -> list[int]:
        self._kept = self._blocks
        return super()._shutdown()


class IgnoresUnknownDataOptions(LoopbackDataTransport):
    """Accepts (and ignores) any data option."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(replace(settings, options={}))


class AcceptsEmptyRead(LoopbackDataTransport):
    """Posts a read of no blocks (and reports it done) instead of refusing it."""

    def check_read(
        self,
        local_idxs: Sequence[int],
        remote_idxs: Sequence[int],
        peer_num_blocks: int,
        peer_id: str = "",
    ) -> tuple[Any, Any]:
        if len(local_idxs) == 0 and len(remote_idxs) == 0:
            return np.empty(0, np.int64), np.empty(0, np.int64)
        return super().check_read(local_idxs, remote_idxs, peer_num_blocks, peer_id)


class ReusesIds(LoopbackDataTransport):
    """Hands out transfer ids from a short cycle: ids repeat within the transport's life."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._transfer_ids = cast("itertools.count[int]", itertools.cycle(range(1, 4)))


class ReaddSameDescriptorDropsReads(LoopbackDataTransport):
    """Re-adding a peer with the descriptor it is registered with re-registers it: its reads
    in flight end, never reported."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self.remove_peer(peer_id)
        super().add_peer(peer_id, descriptor)


class ReplaceLandsLate(_LandsLate):
    """Replacing a peer (a new descriptor under its id) forgets the old registration's reads
    but they still copy on a later progress or poll."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        self._leaking = True
        try:
            super().add_peer(peer_id, descriptor)
        finally:
            self._leaking = False


class NeverNoticesClosedPeer(LoopbackDataTransport):
    """A read of a peer whose region is gone (the peer closed) stays in flight for ever."""

    def _progress(self) -> None:
        for read in self._reads_in_flight():
            if read.copied is None and read.region in loopback_data._REGIONS:
                read.copied = self._copy(read)


class ReadsAfterPeerClosed(LoopbackDataTransport):
    """Keeps every peer's region from ``add_peer`` on and copies from it after the peer
    closed, reporting the read done (as a shared-memory transport that keeps a closed
    producer's mapping would)."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._kept: dict[str, Any] = {}

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> Any:
        peer = super()._attach_peer(peer_id, descriptor)
        self._kept[peer.region] = loopback_data._REGIONS[peer.region]
        return peer

    def _copy(self, read: Any) -> bool:
        self._blocks[read.local] = self._kept[read.region][read.remote]
        return True


class CrashesOnThirdRead(LoopbackDataTransport):
    """Segfaults (a NULL read) when its third read is posted: the kind of crash a native
    library causes. Not in ``DATA_VARIANTS`` (it would end the suite run): the machine run in
    a child must report it with its steps (``test_machine_in_child.py``)."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._posted = 0

    def _post_read(self, peer: Any, local: Any, remote: Any) -> Any:
        self._posted += 1
        if self._posted == 3:
            ctypes.string_at(0)
        return super()._post_read(peer, local, remote)


class ClaimsNoDram(LoopbackDataTransport):
    """Declares its region memory under a name of its own (as an author of a /dev/shm
    transport might): the data suites must fail, not skip every test."""

    capabilities = replace(LoopbackDataTransport.capabilities, memory_kinds=frozenset({"SHM"}))


DATA_VARIANTS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "ClaimsNoDram": (ClaimsNoDram, ("test_shape_and_descriptor",)),
    "EarlyDone": (EarlyDone, ("test_reads_are_byte_exact_at_scattered_indexes",)),
    "IgnoresPeerInPoll": (IgnoresPeerInPoll, ("test_poll_is_scoped_by_peer",)),
    "NoBoundsCheck": (NoBoundsCheck, ("test_bad_indexes_are_refused_before_posting",)),
    "AcceptsDuplicateLocal": (
        AcceptsDuplicateLocal,
        ("test_bad_indexes_are_refused_before_posting",),
    ),
    "SpillsIntoNextBlock": (
        SpillsIntoNextBlock,
        ("test_reads_are_byte_exact_at_scattered_indexes",),
    ),
    "StillWrites": (StillWrites, ("test_reads_are_byte_exact_at_scattered_indexes",)),
    "ReportsTwice": (ReportsTwice, ("test_each_read_reported_exactly_once",)),
    "ReportsCancelled": (
        ReportsCancelled,
        ("test_cancelled_read_is_never_reported", "test_cancel_is_final"),
    ),
    "CancelLandsLate": (CancelLandsLate, ("test_cancel_is_final",)),
    "RemovePeerLandsLate": (RemovePeerLandsLate, ("test_remove_peer_is_final",)),
    "RemovePeerReturnsReads": (RemovePeerReturnsReads, ("test_remove_peer_is_final",)),
    "ForgetsOnProgress": (ForgetsOnProgress, ("test_progress_reports_and_forgets_nothing",)),
    "AcceptsMismatchedPeer": (AcceptsMismatchedPeer, ("test_mismatched_descriptor_is_refused",)),
    "RaisesRawErrorsOnGarbage": (RaisesRawErrorsOnGarbage, ("test_garbage_descriptor_is_refused",)),
    "CloseNotIdempotent": (
        CloseNotIdempotent,
        ("test_close_is_idempotent_and_releases_the_region",),
    ),
    "KeepsRegionAfterClose": (
        KeepsRegionAfterClose,
        ("test_close_is_idempotent_and_releases_the_region",),
    ),
    "IgnoresUnknownDataOptions": (
        IgnoresUnknownDataOptions,
        ("test_unknown_option_is_refused_naming_it",),
    ),
    "AcceptsEmptyRead": (AcceptsEmptyRead, ("test_bad_indexes_are_refused_before_posting",)),
    "ReusesIds": (ReusesIds, ("test_each_read_reported_exactly_once",)),
    "ReaddSameDescriptorDropsReads": (
        ReaddSameDescriptorDropsReads,
        ("test_re_adding_the_same_descriptor_keeps_its_reads",),
    ),
    "ReplaceLandsLate": (ReplaceLandsLate, ("test_replacing_a_peer_ends_its_reads",)),
    "NeverNoticesClosedPeer": (NeverNoticesClosedPeer, ("test_reads_of_a_closed_peer_fail",)),
    "ReadsAfterPeerClosed": (ReadsAfterPeerClosed, ("test_reads_of_a_closed_peer_fail",)),
}
"""name -> (class, suite tests of which at least one must fail)."""


# -- data, two-sided and cross-process ---------------------------------------------------------


class SocketCancelLandsLate(SocketDataTransport):
    """``cancel`` forgets the id but not the posted receive: the answer of a source that was
    paused lands in our blocks when it resumes (no staging)."""

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        zombies: dict[int, list[int]] = getattr(self, "_zombies", {})
        zombies.update((t, self._pending[t][1]) for t in transfer_ids if t in self._pending)
        self._zombies = zombies
        super().cancel(transfer_ids)

    def _land(self, tid: int, ok: bool, body: bytes) -> None:
        local = getattr(self, "_zombies", {}).pop(tid, None)
        if local is not None and ok and self._blocks is not None:
            self._blocks[local] = np.frombuffer(body, np.uint8).reshape(len(local), -1)
        super()._land(tid, ok, body)


class SocketRemovePeerLandsLate(SocketCancelLandsLate):
    """``remove_peer`` forgets the peer's reads but keeps its connection: their answers land
    when the source resumes."""

    def remove_peer(self, peer_id: str) -> list[int]:
        self._peers.pop(peer_id, None)
        self.cancel([t for t, (p, _) in self._pending.items() if p == peer_id])
        return []


SOCKET_VARIANTS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "SocketCancelLandsLate": (SocketCancelLandsLate, ("test_cancel_is_final",)),
    "SocketRemovePeerLandsLate": (SocketRemovePeerLandsLate, ("test_remove_peer_is_final",)),
}
"""Late landing over a two-sided transport whose source runs in another process."""


# -- control ---------------------------------------------------------------------------------


class Reorders(LoopbackControlTransport):
    """Delivers the frames of each poll in reverse order."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        for end in self._connections.values():
            end.queue.reverse()
        return super().poll(timeout)


class DuplicatesFrames(LoopbackControlTransport):
    """Delivers every frame twice."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        for end in self._connections.values():
            doubled = [f for frame in end.queue for f in (frame, frame)]
            end.queue.clear()
            end.queue.extend(doubled)
        return super().poll(timeout)


class DropsSomeFrames(LoopbackControlTransport):
    """Loses one frame in 50 (2 %) on live connections: an occasional drop, never a gap
    large enough for the short delivery tests to be sure to see."""

    every: int = 50
    dropped = 0
    """Frames seen across every instance (deterministic: the 37th of every ``every``)."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        cls = type(self)
        for end in self._connections.values():
            kept = []
            for frame in end.queue:
                cls.dropped += 1
                if cls.dropped % cls.every != 37:
                    kept.append(frame)
            end.queue.clear()
            end.queue.extend(kept)
        return super().poll(timeout)


class DropsRareFrames(DropsSomeFrames):
    """Loses one frame in 100 (1 %), as a flaky link of a real transport might."""

    every = 100
    dropped = 0


class NotHostPort(LoopbackControlTransport):
    """Reports its address in a scheme of its own, which no request can name."""

    @property
    def local_address(self) -> str:
        return "loop://" + super().local_address


class AcceptsTwice(LoopbackControlTransport):
    """Returns each inbound connection from every poll, not once."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        fresh = list(super().poll(timeout))
        seen = getattr(self, "_seen", [])
        self._seen = seen + fresh
        return [c for c in self._seen if c.alive]


class AcceptsBeforeFirstFrame(LoopbackControlTransport):
    """Returns an inbound connection before any of its frames arrived."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        early = [end for end in self._accepted if not end.inbox and end.alive]
        self._accepted = [end for end in self._accepted if end not in early]
        return [*early, *super().poll(timeout)]


class _HalfCloseConnection(LoopbackConnection):
    def close(self) -> None:
        if self.close_reason is None:  # ``end`` without telling the peer (``_on_end``)
            self.close_reason = "closed"
            self._transport._forget(self)


class CloseInvisible(LoopbackControlTransport):
    """Closing a connection marks only our end dead; the peer never learns."""

    def connect(self, address: str) -> LoopbackConnection:
        conn = super().connect(address)
        conn.__class__ = _HalfCloseConnection
        return conn


class _NoCapConnection(LoopbackConnection):
    def send(self, frame: bytes) -> None:
        owner = self._transport
        cap, owner.max_frame_bytes = owner.max_frame_bytes, 1 << 40
        try:
            super().send(frame)
        finally:
            owner.max_frame_bytes = cap


class NoFrameCap(LoopbackControlTransport):
    """Sends frames of any size."""

    def connect(self, address: str) -> LoopbackConnection:
        conn = super().connect(address)
        conn.__class__ = _NoCapConnection
        return conn


class _SilentConnection(LoopbackConnection):
    def send(self, frame: bytes) -> None:
        if self.alive:
            super().send(frame)


class SendAfterCloseSilently(LoopbackControlTransport):
    """``send`` on a closed connection drops the frame instead of raising."""

    def connect(self, address: str) -> LoopbackConnection:
        conn = super().connect(address)
        conn.__class__ = _SilentConnection
        return conn


class NewConnectionEachConnect(LoopbackControlTransport):
    """``connect`` opens another connection even when a live one exists."""

    def connect(self, address: str) -> LoopbackConnection:
        self._connections.pop(address, None)
        return super().connect(address)


class IgnoresUnknownOptions(LoopbackControlTransport):
    """Accepts (and ignores) any option."""

    def __init__(self, settings: Any) -> None:
        super().__init__(replace(settings, options={}))


class ForgetsAnActiveConnection(LoopbackControlTransport):
    """``take_active`` forgets one connection whenever several got frames or died."""

    def __init__(self, settings: Any) -> None:
        super().__init__(settings)
        self._seen: list[LoopbackConnection] = []
        self._dead: set[int] = set()
        self._news: list[ControlConnection] = []

    def connect(self, address: str) -> LoopbackConnection:
        conn = super().connect(address)
        self._note(conn)
        return conn

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        receiving = [end for end in self._connections.values() if end.queue]
        fresh = super().poll(timeout)
        for conn in [*receiving, *fresh]:
            self._note(conn)
            self._mark(conn)
        for conn in self._seen:
            if not conn.alive and id(conn) not in self._dead:
                self._dead.add(id(conn))
                self._mark(conn)
        return fresh

    def take_active(self) -> list[ControlConnection]:  # type: ignore[override]  # broken on purpose
        news, self._news = self._news, []
        return news[:-1] if len(news) > 1 else news

    def _note(self, conn: ControlConnection) -> None:
        if isinstance(conn, LoopbackConnection) and all(conn is not c for c in self._seen):
            self._seen.append(conn)

    def _mark(self, conn: ControlConnection) -> None:
        if all(conn is not c for c in self._news):
            self._news.append(conn)


CONTROL_VARIANTS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "Reorders": (Reorders, ("test_frames_arrive_in_order_each_once",)),
    "DuplicatesFrames": (DuplicatesFrames, ("test_frames_arrive_in_order_each_once",)),
    "DropsSomeFrames": (DropsSomeFrames, ("test_a_long_stream_loses_no_frame",)),
    "DropsRareFrames": (DropsRareFrames, ("test_a_long_stream_loses_no_frame",)),
    "NotHostPort": (NotHostPort, ("test_local_address_is_host_port",)),
    "AcceptsTwice": (
        AcceptsTwice,
        ("test_inbound_connection_is_returned_once_with_its_first_frames",),
    ),
    "AcceptsBeforeFirstFrame": (
        AcceptsBeforeFirstFrame,
        ("test_inbound_connection_is_returned_once_with_its_first_frames",),
    ),
    "CloseInvisible": (CloseInvisible, ("test_close_is_visible_to_the_peer",)),
    "NoFrameCap": (NoFrameCap, ("test_frame_size_cap",)),
    "SendAfterCloseSilently": (SendAfterCloseSilently, ("test_close_is_idempotent",)),
    "NewConnectionEachConnect": (
        NewConnectionEachConnect,
        ("test_connect_returns_the_live_connection",),
    ),
    "IgnoresUnknownOptions": (IgnoresUnknownOptions, ("test_unknown_option_is_refused_naming_it",)),
    "ForgetsAnActiveConnection": (
        ForgetsAnActiveConnection,
        ("test_take_active_never_misses_a_connection",),
    ),
}
