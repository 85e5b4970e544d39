"""Deliberately broken transports: each breaks one rule of the contract, and the kit must
catch every one (``test_kit_catches_broken.py``).

Each variant subclasses a correct transport (the example plugin's ``loopback`` ones, or the
kit's cross-process reference ``socket_transport``) and overrides one method, so the only
defect is the one its docstring names.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from p2pkv.contracts import ControlConnection, PollResult
from p2pkv.errors import TransferSubmitError
from p2pkv_loopback import data as loopback_data
from p2pkv_loopback.control import LoopbackConnection, LoopbackControlTransport
from p2pkv_loopback.data import LoopbackDataTransport
from socket_transport import SocketDataTransport

# -- data ------------------------------------------------------------------------------------


class EarlyDone(LoopbackDataTransport):
    """Reports a read done before its bytes are copied (they land one poll later)."""

    def progress(self) -> None:
        return None

    def poll(self, peer_id: str | None = None) -> PollResult:
        late = getattr(self, "_late", [])
        for region, local, remote in late:
            self._copy(region, local, remote)
        self._late: list[Any] = []
        done = []
        for tid, (peer, region, local, remote) in list(self._pending.items()):
            if peer_id is None or peer == peer_id:
                done.append(tid)
                self._late.append((region, local, remote))
                del self._pending[tid]
        return PollResult(done, [])


class IgnoresPeerInPoll(LoopbackDataTransport):
    """``poll(peer_id)`` drains every peer's completions."""

    def poll(self, peer_id: str | None = None) -> PollResult:
        return super().poll(None)


class NoBoundsCheck(LoopbackDataTransport):
    """Posts reads without checking block indexes (numpy wraps negatives, fails late)."""

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        if peer_id not in self._peers:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        tid = next(self._ids)
        region = self._peers[peer_id][0]
        self._pending[tid] = (peer_id, region, list(local_idxs), list(remote_idxs))
        return tid

    def _copy(self, region: str, local: list[int], remote: list[int]) -> bool:
        try:
            return super()._copy(region, local, remote)
        except (IndexError, ValueError):
            return False


class AcceptsDuplicateLocal(LoopbackDataTransport):
    """Accepts a read that names one of our blocks twice (two sources for one slot)."""

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        local = list(local_idxs)
        if len(set(local)) == len(local):
            return super().read_blocks(peer_id, local, remote_idxs)
        unique = list(dict.fromkeys(local))
        tid = super().read_blocks(peer_id, unique, list(remote_idxs)[:len(unique)])
        self._pending[tid] = (*self._pending[tid][:2], local, list(remote_idxs))
        return tid


class SpillsIntoNextBlock(LoopbackDataTransport):
    """Copies one byte too many: the first byte of our next block is clobbered."""

    def _copy(self, region: str, local: list[int], remote: list[int]) -> bool:
        ok = super()._copy(region, local, remote)
        source = loopback_data._REGIONS.get(region)
        if ok and source is not None and self._blocks is not None:
            flat = self._blocks.reshape(-1)
            for li, ri in zip(local, remote, strict=True):
                end = (li + 1) * self.block_len
                if end < flat.size:
                    flat[end] = source[ri][-1] ^ 0xFF
        return ok


class StillWrites(LoopbackDataTransport):
    """The old direction: copies our blocks into the peer's instead of reading them."""

    def _copy(self, region: str, local: list[int], remote: list[int]) -> bool:
        target = loopback_data._REGIONS.get(region)
        if target is None or self._blocks is None:
            return False
        target[remote] = self._blocks[local]
        return True


class ReportsTwice(LoopbackDataTransport):
    """Reports every finished read again on the next poll."""

    def poll(self, peer_id: str | None = None) -> PollResult:
        again = getattr(self, "_again", [])
        result = super().poll(peer_id)
        self._again = list(result.done)
        return PollResult([*result.done, *again], list(result.failed))


class ReportsCancelled(LoopbackDataTransport):
    """``cancel`` returns but ends nothing: the read still lands and is reported."""

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        return None


class CancelLandsLate(LoopbackDataTransport):
    """``cancel`` forgets the id (never reported) but the copy still happens on a later
    progress or poll: bytes land in our region after cancel returned."""

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        zombies = getattr(self, "_zombies", [])
        zombies += [self._pending[t][1:] for t in transfer_ids if t in self._pending]
        self._zombies: list[Any] = zombies
        super().cancel(transfer_ids)

    def progress(self) -> None:
        super().progress()
        for region, local, remote in getattr(self, "_zombies", []):
            self._copy(region, local, remote)
        self._zombies = []


class RemovePeerLandsLate(LoopbackDataTransport):
    """``remove_peer`` drops the peer's reads from its books (never reported, never
    returned) but they still copy on a later progress or poll."""

    def remove_peer(self, peer_id: str) -> list[int]:
        gone = [t for t, (peer, *_) in self._pending.items() if peer == peer_id]
        self._zombies: list[Any] = [
            *getattr(self, "_zombies", []), *(self._pending.pop(t)[1:] for t in gone)
        ]
        for tid in gone:
            self._outcome.pop(tid, None)
        self._peers.pop(peer_id, None)
        return []

    def progress(self) -> None:
        super().progress()
        for region, local, remote in getattr(self, "_zombies", []):
            self._copy(region, local, remote)
        self._zombies = []


class RemovePeerReturnsReads(LoopbackDataTransport):
    """The old wait-cancel ``remove_peer``: returns the peer's reads as undrained ids."""

    def remove_peer(self, peer_id: str) -> list[int]:
        gone = sorted(t for t, (peer, *_) in self._pending.items() if peer == peer_id)
        return [*super().remove_peer(peer_id), *gone]


class ForgetsOnProgress(LoopbackDataTransport):
    """``progress`` drains finished reads, which ``poll`` then never reports."""

    def progress(self) -> None:
        super().progress()
        for tid in list(self._outcome):
            self._pending.pop(tid, None)
            self._outcome.pop(tid)


class AcceptsMismatchedPeer(LoopbackDataTransport):
    """Registers a peer whatever its block length."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        import json

        try:
            desc = json.loads(descriptor)
            self._peers[peer_id] = (desc["loopback"], int(desc["num_blocks"]))
        except (ValueError, TypeError, KeyError):
            super().add_peer(peer_id, descriptor)


class RaisesRawErrorsOnGarbage(LoopbackDataTransport):
    """A malformed descriptor escapes as ``ValueError``/``KeyError``, not ``PeerRejected``."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        import json

        desc = json.loads(descriptor)
        self._peers[peer_id] = (desc["loopback"], int(desc["num_blocks"]))


class CloseNotIdempotent(LoopbackDataTransport):
    """A second ``close`` raises."""

    def close(self) -> list[int]:
        if self._blocks is None:
            raise RuntimeError("already closed")
        return super().close()


class KeepsRegionAfterClose(LoopbackDataTransport):
    """Holds on to the caller's region after ``close`` returned ``[]``."""

    def close(self) -> list[int]:
        if self._blocks is not None:
            self._kept = self._blocks
        return super().close()


DATA_VARIANTS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "EarlyDone": (EarlyDone, ("test_reads_are_byte_exact_at_scattered_indexes",)),
    "IgnoresPeerInPoll": (IgnoresPeerInPoll, ("test_poll_is_scoped_by_peer",)),
    "NoBoundsCheck": (NoBoundsCheck, ("test_bad_indexes_are_refused_before_posting",)),
    "AcceptsDuplicateLocal": (
        AcceptsDuplicateLocal, ("test_bad_indexes_are_refused_before_posting",)
    ),
    "SpillsIntoNextBlock": (
        SpillsIntoNextBlock, ("test_reads_are_byte_exact_at_scattered_indexes",)
    ),
    "StillWrites": (StillWrites, ("test_reads_are_byte_exact_at_scattered_indexes",)),
    "ReportsTwice": (ReportsTwice, ("test_each_read_reported_exactly_once",)),
    "ReportsCancelled": (
        ReportsCancelled, ("test_cancelled_read_is_never_reported", "test_cancel_is_final")
    ),
    "CancelLandsLate": (CancelLandsLate, ("test_cancel_is_final",)),
    "RemovePeerLandsLate": (RemovePeerLandsLate, ("test_remove_peer_is_final",)),
    "RemovePeerReturnsReads": (RemovePeerReturnsReads, ("test_remove_peer_is_final",)),
    "ForgetsOnProgress": (ForgetsOnProgress, ("test_progress_reports_and_forgets_nothing",)),
    "AcceptsMismatchedPeer": (AcceptsMismatchedPeer, ("test_mismatched_descriptor_is_refused",)),
    "RaisesRawErrorsOnGarbage": (
        RaisesRawErrorsOnGarbage, ("test_garbage_descriptor_is_refused",)
    ),
    "CloseNotIdempotent": (
        CloseNotIdempotent, ("test_close_is_idempotent_and_releases_the_region",)
    ),
    "KeepsRegionAfterClose": (
        KeepsRegionAfterClose, ("test_close_is_idempotent_and_releases_the_region",)
    ),
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
        for end in self.ends:
            end.queue.reverse()
        return super().poll(timeout)


class DuplicatesFrames(LoopbackControlTransport):
    """Delivers every frame twice."""

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        for end in self.ends:
            doubled = [f for frame in end.queue for f in (frame, frame)]
            end.queue.clear()
            end.queue.extend(doubled)
        return super().poll(timeout)


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
        early = [end for end in self._unannounced if not end.inbox and not end.dead]
        self._unannounced = [end for end in self._unannounced if end not in early]
        return [*early, *super().poll(timeout)]


class _HalfCloseConnection(LoopbackConnection):
    def close(self) -> None:
        self.dead = True
        self.owner.ends.discard(self)


class CloseInvisible(LoopbackControlTransport):
    """Closing a connection marks only our end dead; the peer never learns."""

    def connect(self, address: str) -> ControlConnection:
        conn = super().connect(address)
        conn.__class__ = _HalfCloseConnection
        return conn


class _NoCapConnection(LoopbackConnection):
    def send(self, frame: bytes) -> None:
        cap, self.owner.max_frame_bytes = self.owner.max_frame_bytes, 1 << 40
        try:
            super().send(frame)
        finally:
            self.owner.max_frame_bytes = cap


class NoFrameCap(LoopbackControlTransport):
    """Sends frames of any size."""

    def connect(self, address: str) -> ControlConnection:
        conn = super().connect(address)
        conn.__class__ = _NoCapConnection
        return conn


class _SilentConnection(LoopbackConnection):
    def send(self, frame: bytes) -> None:
        if self.alive:
            super().send(frame)


class SendAfterCloseSilently(LoopbackControlTransport):
    """``send`` on a closed connection drops the frame instead of raising."""

    def connect(self, address: str) -> ControlConnection:
        conn = super().connect(address)
        conn.__class__ = _SilentConnection
        return conn


class NewConnectionEachConnect(LoopbackControlTransport):
    """``connect`` opens another connection even when a live one exists."""

    def connect(self, address: str) -> ControlConnection:
        self._dialed.pop(address, None)
        return super().connect(address)


class IgnoresUnknownOptions(LoopbackControlTransport):
    """Accepts (and ignores) any option."""

    def __init__(self, settings: Any) -> None:
        from dataclasses import replace

        super().__init__(replace(settings, options={}))


CONTROL_VARIANTS: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "Reorders": (Reorders, ("test_frames_arrive_in_order_each_once",)),
    "DuplicatesFrames": (DuplicatesFrames, ("test_frames_arrive_in_order_each_once",)),
    "AcceptsTwice": (
        AcceptsTwice, ("test_inbound_connection_is_returned_once_with_its_first_frames",)
    ),
    "AcceptsBeforeFirstFrame": (
        AcceptsBeforeFirstFrame,
        ("test_inbound_connection_is_returned_once_with_its_first_frames",),
    ),
    "CloseInvisible": (CloseInvisible, ("test_close_is_visible_to_the_peer",)),
    "NoFrameCap": (NoFrameCap, ("test_frame_size_cap",)),
    "SendAfterCloseSilently": (SendAfterCloseSilently, ("test_close_is_idempotent",)),
    "NewConnectionEachConnect": (
        NewConnectionEachConnect, ("test_connect_returns_the_live_connection",)
    ),
    "IgnoresUnknownOptions": (
        IgnoresUnknownOptions, ("test_unknown_option_is_refused_naming_it",)
    ),
}
