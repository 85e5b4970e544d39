"""Consumer-side fences: destination slots that a producer might still write into.

A load round that ends without the producer confirming that none of its writes into the
round's slots is live (``transfer_done`` / ``abort_ack``) -- the session died, the abort ack
never came, a protocol error -- has its result reported at once, but its slots are **fenced**
against that producer's address: a one-sided write posted before can still land (a partition
heals and TCP retransmits), and nothing on our side can recall it. A later load whose slots
intersect a fence is not sent until the fence is lifted:

* by ``quiesced`` from that producer on a newer session (it has no write to us from an earlier
  session live any more): every fence against that address created before the session
  started is lifted;
* by its deadline, ``timeouts.fence`` after it was set (any write still in flight is then
  assumed to have failed), logged once and reported to the ``timeout`` observer.

Layout: one int64 per slot holding the id of the fence covering it (0 = none), and the live
fences by id (increasing with creation). Checking a load is one numpy ``any()`` over its slots,
and nothing at all while no fence exists. Fence ids order fences against sessions: a session
remembers ``next_id`` when it is created, and its ``quiesced`` lifts only fences below that.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import numpy.typing as npt

from p2pkv.config import Timeouts
from p2pkv.registry import Observers
from p2pkv.session.deadlines import Deadlines, Timer

__all__ = ["FenceWaiter", "Fences"]

log = logging.getLogger(__name__)


class FenceWaiter(Protocol):
    """Holds loads waiting for fences (a session's consumer role)."""

    def retry_fenced(self) -> bool:
        """Send what is no longer fenced; True while something still waits."""
        ...


class _Fence:
    __slots__ = ("kv", "peer", "slots", "timer")

    def __init__(self, peer: str, kv: str, slots: npt.NDArray[np.int64]) -> None:
        self.peer = peer
        self.kv = kv
        self.slots = slots
        self.timer: Timer | None = None


class Fences:
    """The fences of one tier's region (see the module docstring)."""

    def __init__(self, num_blocks: int, deadlines: Deadlines, clock: Callable[[], float],
                 timeouts: Timeouts, observers: Observers) -> None:
        self._owner = np.zeros(num_blocks, dtype=np.int64)
        self._deadlines = deadlines
        self._clock = clock
        self._timeouts = timeouts
        self._observers = observers
        self.live: dict[int, _Fence] = {}
        self.next_id = 1
        """The id the next fence gets; fences below a session's snapshot of it predate it."""
        self._waiters: dict[FenceWaiter, None] = {}

    def fence(self, peer: str, kv: str, slots: Sequence[int]) -> None:
        """Fence ``slots`` against ``peer`` (a write of request ``kv`` may still land)."""
        if not len(slots):
            return
        fid = self.next_id
        self.next_id += 1
        fence = _Fence(peer, kv, np.asarray(slots, dtype=np.int64))
        self._owner[fence.slots] = fid
        fence.timer = self._deadlines.at(
            self._clock() + self._timeouts.fence, self._expired, fid
        )
        self.live[fid] = fence

    def blocked(self, slots: Sequence[int]) -> bool:
        """Some of ``slots`` is fenced."""
        return bool(self.live) and bool(self._owner[slots].any())

    def wait(self, waiter: FenceWaiter) -> None:
        """Call ``waiter.retry_fenced()`` after fences are lifted, until it returns False."""
        self._waiters[waiter] = None

    def lift_before(self, peer: str, floor: int) -> int:
        """``peer`` confirmed quiescence on a session created when ``next_id`` was ``floor``:
        lift its older fences. Returns how many were lifted."""
        ids = [fid for fid, f in self.live.items() if fid < floor and f.peer == peer]
        for fid in ids:
            self._lift(fid)
        if ids:
            self._wake()
        return len(ids)

    def _expired(self, fid: int) -> None:
        fence = self.live[fid]
        fence.timer = None
        log.warning("fence on %d slot(s) of request %r against %s lifted by its deadline "
                    "(%.0fs) without the producer confirming quiescence", len(fence.slots),
                    fence.kv, fence.peer, self._timeouts.fence)
        if self._observers.enabled:
            self._observers.timeout(kind="fence", kv_request_id=fence.kv, peer=fence.peer)
        self._lift(fid)
        self._wake()

    def _lift(self, fid: int) -> None:
        fence = self.live.pop(fid)
        self._deadlines.cancel(fence.timer)
        slots = fence.slots
        owner = self._owner
        owner[slots[owner[slots] == fid]] = 0

    def _wake(self) -> None:
        waiters, self._waiters = self._waiters, {}
        for waiter in waiters:
            if waiter.retry_fenced():
                self._waiters[waiter] = None

    def clear(self) -> None:
        """Forget every fence (the tier shut down)."""
        for fence in self.live.values():
            self._deadlines.cancel(fence.timer)
        self.live.clear()
        self._owner[:] = 0
        self._waiters.clear()

    def __len__(self) -> int:
        return len(self.live)
