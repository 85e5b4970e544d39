"""Sabotaged variants of the kit's reference transport (``socket_transport``): each breaks one
rule that issue #20 (and, for the last two, issue #46: a frozen peer stalls others) found the
suites missing, and the suites must catch every one, every time
(``test_kit_catches_broken.py``, ``suite_runs.RUNS`` runs each).

Each variant subclasses :class:`SocketDataTransport` and changes one behaviour, named by its
docstring; everything else is the working transport.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import numpy as np
from p2pkv.contracts import DataSettings, PollResult
from socket_transport import SocketDataTransport, _Link

__all__ = ["SABOTAGE"]


class ReportsAfterRemovePeer(SocketDataTransport):
    """``remove_peer`` ends the peer's reads but keeps them in its books: the next ``poll``
    reports them (failed)."""

    def remove_peer(self, peer_id: str) -> list[int]:
        kept = {t: read for t, read in self._pending.items() if read[0] == peer_id}
        undrained = super().remove_peer(peer_id)
        self._pending.update(kept)
        self._outcome.update(dict.fromkeys(kept, False))
        return undrained


class RemovePeerKeepsReads(SocketDataTransport):
    """``remove_peer`` forgets the peer's registration only: its reads stay alive, land and
    are reported."""

    def remove_peer(self, peer_id: str) -> list[int]:
        self._peers.pop(peer_id, None)
        return []


class SocketRemovePeerReturnsReads(SocketDataTransport):
    """``remove_peer`` ends the peer's reads and returns their ids as undrained."""

    def remove_peer(self, peer_id: str) -> list[int]:
        reads = [t for t, read in self._pending.items() if read[0] == peer_id]
        return [*super().remove_peer(peer_id), *reads]


class DoneBeforeLanding(SocketDataTransport):
    """Reports a read done as soon as its answer arrived, and copies the bytes into our blocks
    on the next call (``progress`` or ``poll``)."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._late: list[tuple[list[int], bytes]] = []

    def progress(self) -> None:
        for local, body in self._late:
            self._blocks[local] = np.frombuffer(body, np.uint8).reshape(len(local), -1)
        self._late = []
        super().progress()

    def _land(self, tid: int, ok: bool, body: bytes) -> None:
        read = self._pending.get(tid)
        if read is None or tid in self._outcome:
            return
        if ok:
            self._late.append((read[1], body))
        self._outcome[tid] = ok


class _DeafLink(_Link):
    """A connection that never admits it died."""

    @property
    def dead(self) -> bool:
        return False

    @dead.setter
    def dead(self, value: bool) -> None:
        pass


class NeverNoticesDeadPeer(SocketDataTransport):
    """Never notices that a peer closed or died: reads from it stay in flight for ever."""

    def _link(self, peer_id: str) -> _Link:
        link = super()._link(peer_id)
        link.__class__ = _DeafLink
        return link


class StarvedIOThread(SocketDataTransport):
    """Does all its I/O on a thread of its own; ``poll`` only reports. In CPython a caller
    spinning on ``poll`` holds the GIL, and the thread gets it back once per switch interval."""

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._lock = threading.RLock()  # add_peer calls remove_peer, which calls cancel
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="starved-io", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.0005):
            with self._lock:
                super().progress()

    def progress(self) -> None:
        return None

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        with self._lock:
            super().add_peer(peer_id, descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        with self._lock:
            return super().remove_peer(peer_id)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        with self._lock:
            return super().read_blocks(peer_id, local_idxs, remote_idxs)

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Never blocks: while the I/O thread holds the lock there is nothing to report yet
        (so the caller's polling never hands the thread the GIL by waiting for it)."""
        if not self._lock.acquire(blocking=False):
            return PollResult([], [])
        try:
            return super().poll(peer_id)
        finally:
            self._lock.release()

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        with self._lock:
            super().cancel(transfer_ids)

    def close(self) -> list[int]:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(10)
        return super().close()


class BlocksInRemovePeer(SocketDataTransport):
    """``remove_peer`` waits, progressing, until every connection peers opened to us has
    closed, for up to ``WAIT`` seconds: a graceful endpoint close that waits for the peer. A
    frozen peer never closes, so the call keeps the caller's thread the whole time."""

    WAIT = 2.0

    def remove_peer(self, peer_id: str) -> list[int]:
        undrained = super().remove_peer(peer_id)
        deadline = time.monotonic() + self.WAIT
        while self._served and time.monotonic() < deadline:
            self.progress()
        return undrained


class SharesBudgetWithoutShares(SocketDataTransport):
    """Keeps a staging budget of ``BUDGET`` blocks that every peer's reads share, first come
    first served: reads are admitted in the order they were posted, each once the budget has
    room, and an admitted read holds its blocks until it ends; an answer lands only for an
    admitted read. No share per peer, and nothing declared (no ``read_capacity``, no
    ``TransferBusy``): a peer frozen with reads admitted holds the budget, and every later
    read of every other peer waits behind them."""

    BUDGET = 4

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._queue: deque[tuple[int, int]] = deque()
        """(read id, blocks) posted and not admitted yet, in order."""
        self._admitted: dict[int, int] = {}
        self._early: dict[int, tuple[bool, bytes]] = {}
        """Answers that arrived for reads not admitted yet."""

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        tid = super().read_blocks(peer_id, local_idxs, remote_idxs)
        self._queue.append((tid, len(local_idxs)))
        self._admit()
        return tid

    def _admit(self) -> None:
        while self._queue:
            tid, blocks = self._queue[0]
            if tid in self._pending and sum(self._admitted.values()) + blocks > self.BUDGET:
                return
            self._queue.popleft()
            if tid in self._pending:
                self._admitted[tid] = blocks
                early = self._early.pop(tid, None)
                if early is not None:
                    super()._land(tid, *early)

    def _land(self, tid: int, ok: bool, body: bytes) -> None:
        if tid in self._admitted:
            super()._land(tid, ok, body)
        elif tid in self._pending:
            self._early[tid] = (ok, body)

    def _release(self, ids: Sequence[int]) -> None:
        for tid in ids:
            self._admitted.pop(tid, None)
            self._early.pop(tid, None)
        self._admit()

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = super().poll(peer_id)
        self._release([*result.done, *result.failed])
        return result

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        super().cancel(transfer_ids)
        self._release(transfer_ids)


SABOTAGE: dict[str, tuple[type[Any], tuple[str, ...]]] = {
    "ReportsAfterRemovePeer": (ReportsAfterRemovePeer, ("test_remove_peer_is_final",)),
    "RemovePeerKeepsReads": (RemovePeerKeepsReads, ("test_remove_peer_is_final",)),
    "SocketRemovePeerReturnsReads": (SocketRemovePeerReturnsReads, ("test_remove_peer_is_final",)),
    "DoneBeforeLanding": (
        DoneBeforeLanding,
        ("test_each_read_reported_exactly_once", "test_poll_none_drains_every_peer"),
    ),
    "NeverNoticesDeadPeer": (
        NeverNoticesDeadPeer,
        ("test_reads_of_a_closed_peer_fail", "test_peer_killed_is_survivable"),
    ),
    "StarvedIOThread": (
        StarvedIOThread,
        ("test_a_read_completes_within_a_bounded_number_of_polls",),
    ),
    "BlocksInRemovePeer": (BlocksInRemovePeer, ("test_removing_a_frozen_peer_is_bounded",)),
    "SharesBudgetWithoutShares": (
        SharesBudgetWithoutShares,
        ("test_a_frozen_source_stalls_no_other_source",),
    ),
}
"""Variant -> (class, the suite tests that must catch it)."""
