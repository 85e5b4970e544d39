"""Block content derived from the block's key, so a receiver can check every byte.

Block content is ``pattern ^ seed(key)`` in 64-bit words, where ``pattern`` is a fixed
per-position sequence (every word of a block differs) and ``seed`` is a 64-bit hash of the
key (odd, so never 0). A block that landed in the wrong slot, came from the wrong key, was
cut short, or was never written fails the check.

Verification is destructive on purpose: it XORs the seed back out in place and compares with
``pattern``, which leaves the slot holding ``pattern`` — content no key produces — so a slot
reused for the same key later cannot pass on stale bytes. It costs two passes over the block
and no allocation of block size beyond numpy's comparison temporary.

Not thread-safe; each ``BlockRegion`` belongs to one thread.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

__all__ = ["BlockRegion", "key_seed"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def key_seed(key: bytes) -> int:
    """The 64-bit seed of a key's content (odd, never zero)."""
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") | 1


class BlockRegion:
    """A region of ``num_blocks`` blocks of ``block_len`` bytes (a multiple of 8) over ``buf``.

    ``buf`` is any writable buffer of at least ``num_blocks * block_len`` bytes (numpy array,
    ``memoryview``, ``mmap``); the region views it, it does not copy it.
    """

    def __init__(self, buf: object, block_len: int, num_blocks: int | None = None) -> None:
        if block_len <= 0 or block_len % 8:
            raise ValueError(f"block_len must be a positive multiple of 8, got {block_len}")
        raw = np.frombuffer(buf, dtype=np.uint8)  # type: ignore[call-overload]
        if num_blocks is None:
            num_blocks = raw.nbytes // block_len
        if num_blocks * block_len > raw.nbytes:
            raise ValueError(f"buffer of {raw.nbytes} B cannot hold {num_blocks} x {block_len} B")
        if not raw.flags.writeable:
            raise ValueError("region buffer must be writable")
        self.block_len = block_len
        self.num_blocks = num_blocks
        self.words = raw[: num_blocks * block_len].view(np.uint64).reshape(num_blocks, -1)
        self.pattern = np.arange(block_len // 8, dtype=np.uint64) * _GOLDEN

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_len

    def fill(self, slots: Sequence[int], keys: Sequence[bytes]) -> None:
        """Write each key's content into its slot."""
        for slot, key in zip(slots, keys, strict=True):
            np.bitwise_xor(self.pattern, np.uint64(key_seed(key)), out=self.words[slot])

    def fill_seeds(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        """Like ``fill`` with precomputed seeds (odd 64-bit ints)."""
        for slot, seed in zip(slots, seeds, strict=True):
            np.bitwise_xor(self.pattern, np.uint64(seed), out=self.words[slot])

    def verify(self, slots: Sequence[int], keys: Sequence[bytes]) -> list[int]:
        """Check (and consume) each slot against its key; returns the slots that mismatched."""
        return self.verify_seeds(slots, [key_seed(k) for k in keys])

    def verify_seeds(self, slots: Sequence[int], seeds: Sequence[int]) -> list[int]:
        """Like ``verify`` with precomputed seeds."""
        bad = []
        for slot, seed in zip(slots, seeds, strict=True):
            row = self.words[slot]
            np.bitwise_xor(row, np.uint64(seed), out=row)
            if not np.array_equal(row, self.pattern):
                bad.append(slot)
        return bad

    def poison(self, slots: Sequence[int]) -> None:
        """Overwrite slots with content no key produces (``pattern``)."""
        for slot in slots:
            self.words[slot] = self.pattern
