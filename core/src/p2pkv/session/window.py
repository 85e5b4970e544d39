"""The load window of one session: how many load rounds (and blocks) a consumer keeps open
with one producer at once, and the queue of rounds waiting for room.

A round is *open* from its fetch until it ends. ``flow.window_rounds`` rounds and
``flow.window_blocks`` blocks may be open at once; a round that does not fit waits here, in
two lanes: PD loads (``remote_prefiller``) always go before prefix pulls
(``remote_kv_source``), and each lane is first come, first served. A round larger than the
block window goes alone (when nothing else is open), so every round can be served. A waiting
round keeps its own load deadline (armed at submit by the consumer role); one that ends while
waiting (deadline, request finished, session closed) just leaves the queue.

Bounded in-flight per peer is what keeps a burst from turning into failures: the producer
pins only what the window allows, the control queues carry at most a window's frames, and
the data transport's shared resources see a bounded share of each peer's reads.

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Generic, Protocol, TypeVar


class Windowed(Protocol):
    """What the window needs of a round: its size in blocks."""

    @property
    def nblocks(self) -> int: ...


R = TypeVar("R", bound=Windowed)


class LoadWindow(Generic[R]):
    """Open rounds (counted) and waiting rounds (two ordered lanes) of one session."""

    __slots__ = ("_lanes", "blocks", "max_blocks", "max_rounds", "rounds")

    def __init__(self, max_rounds: int, max_blocks: int) -> None:
        self.max_rounds = max_rounds
        self.max_blocks = max_blocks
        self.rounds = 0
        """Rounds open now."""
        self.blocks = 0
        """Blocks of the rounds open now."""
        self._lanes: tuple[dict[R, None], dict[R, None]] = ({}, {})
        """Waiting rounds: PD first, then prefix pulls; insertion-ordered (O(1) removal)."""

    def wait(self, rnd: R, *, pull: bool) -> None:
        """Queue ``rnd`` (PD lane unless ``pull``) behind the rounds already waiting."""
        self._lanes[pull][rnd] = None

    def admit(self, expired: Callable[[R], bool]) -> list[R]:
        """Open waiting rounds while they fit, PD lane first, in order; returns those opened
        (counted open already). A round that does not fit stops its lane and every lane
        after it (the lanes are strict priorities; no overtaking within one). A round
        ``expired`` says is past its deadline is skipped and stays waiting (its timer, due in
        the same pass, ends it): a fetch the consumer cannot wait for is never sent."""
        opened: list[R] = []
        for lane in self._lanes:
            full = self._open_from(lane, expired, opened)
            if full:
                break
        return opened

    def _open_from(
        self, lane: dict[R, None], expired: Callable[[R], bool], opened: list[R]
    ) -> bool:
        """Open ``lane``'s rounds in order into ``opened``; True if one did not fit."""
        taken: list[R] = []
        full = False
        for rnd in lane:
            if expired(rnd):
                continue
            if not self._fits(rnd.nblocks):
                full = True
                break
            taken.append(rnd)
            self.rounds += 1
            self.blocks += rnd.nblocks
        for rnd in taken:
            del lane[rnd]
        opened.extend(taken)
        return full

    def _fits(self, nblocks: int) -> bool:
        if self.rounds == 0:
            return True  # nothing open: even a round larger than the window goes
        return self.rounds < self.max_rounds and self.blocks + nblocks <= self.max_blocks

    def close(self, rnd: R) -> None:
        """An open round ended: its room is free (call ``admit`` to use it)."""
        self.rounds -= 1
        self.blocks -= rnd.nblocks

    def leave(self, rnd: R) -> bool:
        """A waiting round ended before it was opened; False if it was not waiting."""
        for lane in self._lanes:
            if rnd in lane:
                del lane[rnd]
                return True
        return False

    def ahead_of(self, rnd: R) -> int:
        """Rounds waiting ahead of ``rnd`` (for a timeout's detail; O(queue))."""
        ahead = 0
        for lane in self._lanes:
            for other in lane:
                if other is rnd:
                    return ahead
                ahead += 1
        return ahead

    @property
    def waiting(self) -> int:
        return len(self._lanes[0]) + len(self._lanes[1])

    def clear(self) -> list[R]:
        """Forget every waiting round (the session closed); returns them."""
        out = [*self._lanes[0], *self._lanes[1]]
        for lane in self._lanes:
            lane.clear()
        return out
