"""The consumer's staging buffers: every arriving run is received here, never into the region.

A run is copied into its slots only after UCX completed its receive without error, which is
what makes ending a read final at once (see :mod:`p2pkv_ucx.transport`).

**Shares.** The budget (data option ``staging_bytes``) is shared by every peer we read from,
and a peer that stops mid-transfer (SIGSTOP, a cut cable) keeps the buffers of its runs
being received until its reads end, which may be a heartbeat timeout later. So no peer takes
more than its share: with ``k`` peers holding staging or with runs waiting for it, a peer may
hold ``budget // max(2, k)`` bytes, and never less than one largest message. A frozen peer
thus holds at most half the budget, and every other peer's runs keep landing in the rest.
A run beyond its peer's share waits (its probe handle is kept: a rendezvous run moves no
payload until it is received) and goes first once that peer's share has room again. The
policy is the one the tier's read gate applies to nixl's staging pool
(:mod:`p2pkv.session.reads`; docs/configuration.md, "Shares of shared budgets").
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Generic, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = ["Bytes", "Staging"]

Bytes = npt.NDArray[np.uint8]
K = TypeVar("K", bound=Hashable)


class Staging(Generic[K]):
    """Staging buffers: the bytes live reads hold (bounded, shared among peers by shares, see
    the module docstring) and a pool of idle buffers.

    ``used`` counts the buffers of live reads' runs being received; a read that ends gives its
    bytes back at once (``release``), while its buffers stay with UCX until it lets go of
    them (``recycle``). The budget is at least two largest messages, so that one peer never
    holds all of it. Peers are keys ``K`` (the transport's peer records). Driver thread
    only.
    """

    def __init__(self, block_len: int, budget: int, largest: int) -> None:
        self.block_len = block_len
        self.largest = largest
        self.budget = max(budget, 2 * largest)
        self.used = 0
        self._held: dict[K, int] = {}
        """Peer -> bytes its runs being received hold (only > 0)."""
        self._waiting: dict[K, None] = {}
        """Peers with runs waiting for their share, in the order they started waiting."""
        self._idle: dict[int, list[Bytes]] = {}
        self._idle_bytes = 0

    def room(self) -> bool:
        """True when a message of the largest size fits the budget."""
        return self.used + self.largest <= self.budget

    def share(self) -> int:
        """Bytes one peer may hold now (see the module docstring)."""
        users = len(self._held) + sum(1 for peer in self._waiting if peer not in self._held)
        return max(self.largest, self.budget // max(2, users))

    def admits(self, peer: K, nbytes: int) -> bool:
        """Whether ``peer`` may take a run of ``nbytes`` now: it fits the budget, and the
        peer's share (a peer holding nothing always fits its share)."""
        if self.used + nbytes > self.budget:
            return False
        held = self._held.get(peer, 0)
        return not held or held + nbytes <= self.share()

    def held_by(self, peer: K) -> int:
        return self._held.get(peer, 0)

    def take(self, peer: K, blocks: int) -> Bytes:
        """A buffer of ``blocks`` blocks, counted as used by ``peer``."""
        nbytes = blocks * self.block_len
        self.used += nbytes
        self._held[peer] = self._held.get(peer, 0) + nbytes
        idle = self._idle.get(blocks)
        if idle:
            self._idle_bytes -= nbytes
            return idle.pop()
        return np.empty(nbytes, np.uint8)

    def release(self, peer: K, nbytes: int) -> None:
        """Stop counting ``nbytes`` of ``peer``'s as used (their buffers come back through
        ``recycle``)."""
        if not nbytes:
            return
        self.used -= nbytes
        left = self._held[peer] - nbytes
        if left:
            self._held[peer] = left
        else:
            del self._held[peer]

    def wait(self, peer: K, waiting: bool) -> None:
        """Note whether ``peer`` has runs waiting for its share (it counts among the peers
        the budget is shared by)."""
        if waiting:
            self._waiting.setdefault(peer, None)
        else:
            self._waiting.pop(peer, None)

    @property
    def waiting(self) -> list[K]:
        """Peers with runs waiting for their share, longest waiting first."""
        return list(self._waiting)

    def recycle(self, buf: Bytes) -> None:
        """Keep a buffer UCX no longer touches for reuse (up to the budget of idle bytes)."""
        if self._idle_bytes + buf.nbytes <= self.budget:
            self._idle.setdefault(buf.nbytes // self.block_len, []).append(buf)
            self._idle_bytes += buf.nbytes
