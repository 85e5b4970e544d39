"""The consumer's staging buffers: every arriving run is received here, never into the region.

A run is copied into its slots only after UCX completed its receive without error, which is
what makes ending a read final at once (see :mod:`p2pkv_ucx.transport`).
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

__all__ = ["Bytes", "Staging"]

Bytes = npt.NDArray[np.uint8]


class Staging:
    """Staging buffers: the bytes live reads hold (bounded) and a pool of idle buffers.

    ``used`` counts the buffers of live reads' runs being received; a read that ends gives its
    share back at once (``release``), while its buffers stay with UCX until it lets go of
    them (``recycle``), so a stuck peer cannot starve the others' reads. Driver thread only.
    """

    def __init__(self, block_len: int, budget: int, largest: int) -> None:
        self.block_len = block_len
        self.largest = largest
        self.budget = max(budget, largest)
        self.used = 0
        self._idle: dict[int, list[Bytes]] = {}
        self._idle_bytes = 0

    def room(self) -> bool:
        """True when a message of the largest size fits the budget."""
        return self.used + self.largest <= self.budget

    def take(self, blocks: int) -> Bytes:
        """A buffer of ``blocks`` blocks, counted as used."""
        nbytes = blocks * self.block_len
        self.used += nbytes
        idle = self._idle.get(blocks)
        if idle:
            self._idle_bytes -= nbytes
            return idle.pop()
        return np.empty(nbytes, np.uint8)

    def release(self, nbytes: int) -> None:
        """Stop counting ``nbytes`` as used (their buffers come back through ``recycle``)."""
        self.used -= nbytes

    def recycle(self, buf: Bytes) -> None:
        """Keep a buffer UCX no longer touches for reuse (up to the budget of idle bytes)."""
        if self._idle_bytes + buf.nbytes <= self.budget:
            self._idle.setdefault(buf.nbytes // self.block_len, []).append(buf)
            self._idle_bytes += buf.nbytes
