"""The 64-bit UCX tag of every message the ``ucx`` transport sends.

UCX matches tags per *worker*, not per connection, so a tag must say who sent the message.
``link`` is the id the *receiver* gave the sender when it added it (unique per receiver,
never reused)::

    SLOT    00 | link:22 | gen:16 | slot:24     one block, into a receive posted by expect_blocks
    NOTICE  01 | 0                               consumer -> producer (payload names the sender)
    HEADER  10 | link:22 | seq:20 | 0            the runs of one write
    RUN     11 | link:22 | seq:20 | run:20       one coalesced run of that write

``gen`` is the consumer's round (its low 16 bits), ``seq`` the producer's write number on the
link (modulo 2**20), ``run`` the run's position in the write.
"""

from __future__ import annotations

__all__ = [
    "HEADER",
    "KIND_MASK",
    "MAX_LINK",
    "MAX_RUNS",
    "MAX_SLOTS",
    "NOTICE",
    "RUN",
    "SEQ_MASK",
    "SLOT",
    "WRITE_MASK",
    "header_tag",
    "kind_tag",
    "run_tag",
    "slot_tag",
    "split",
]

SLOT, NOTICE, HEADER, RUN = 0, 1, 2, 3
_KIND_SHIFT, _LINK_SHIFT, _SEQ_SHIFT, _GEN_SHIFT = 62, 40, 20, 24
MAX_LINK = (1 << 22) - 1
SEQ_MASK = (1 << 20) - 1
_RUN_MASK = (1 << 20) - 1
_GEN_MASK = (1 << 16) - 1
MAX_RUNS = _RUN_MASK + 1
"""Messages one ``write_blocks`` call may need."""
MAX_SLOTS = 1 << 24
"""Blocks a region may hold (a slot index must fit its tag field)."""
KIND_MASK = 3 << _KIND_SHIFT
WRITE_MASK = ((1 << 64) - 1) ^ _RUN_MASK
"""Matches every run of one write: kind, link and seq, any run."""


def kind_tag(kind: int) -> int:
    return kind << _KIND_SHIFT


def slot_tag(link: int, gen: int, slot: int) -> int:
    return (link << _LINK_SHIFT) | ((gen & _GEN_MASK) << _GEN_SHIFT) | slot


def header_tag(link: int, seq: int) -> int:
    return (HEADER << _KIND_SHIFT) | (link << _LINK_SHIFT) | (seq << _SEQ_SHIFT)


def run_tag(link: int, seq: int, run: int) -> int:
    return (RUN << _KIND_SHIFT) | (link << _LINK_SHIFT) | (seq << _SEQ_SHIFT) | run


def split(tag: int) -> tuple[int, int, int, int]:
    """(kind, link, seq, run) of a HEADER or RUN tag."""
    return (
        tag >> _KIND_SHIFT,
        (tag >> _LINK_SHIFT) & MAX_LINK,
        (tag >> _SEQ_SHIFT) & SEQ_MASK,
        tag & _RUN_MASK,
    )
