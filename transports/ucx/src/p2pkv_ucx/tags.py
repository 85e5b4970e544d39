"""The 64-bit UCX tag of every message the ``ucx`` transport sends.

UCX matches tags per *worker*, not per connection, so a tag must say who sent the message::

    bit 63..62  kind   1 NOTICE, 2 HEADER, 3 DATA (0 is never used by p2pkv-ucx)
    bit 61..40  link   the id the *receiver* gave the sender (unique per receiver, never reused)
    bit 39..20  seq    the sender's write number on that link, modulo 2**20
    bit 19..0   run    the run's position in its write (DATA only)

A NOTICE (consumer to producer: EXPECT, RETRACT, VERDICT) carries only the kind; its payload
names the sender. A HEADER (kind, link, seq) announces the runs of one write; DATA (kind,
link, seq, run) is one run's payload.
"""

from __future__ import annotations

__all__ = [
    "DATA",
    "HEADER",
    "KIND_MASK",
    "MAX_LINK",
    "MAX_RUNS",
    "NOTICE",
    "SEQ_MASK",
    "WRITE_MASK",
    "data_tag",
    "header_tag",
    "kind_tag",
    "split",
]

NOTICE, HEADER, DATA = 1, 2, 3
_KIND_SHIFT, _LINK_SHIFT, _SEQ_SHIFT = 62, 40, 20
MAX_LINK = (1 << 22) - 1
SEQ_MASK = (1 << 20) - 1
_RUN_MASK = (1 << 20) - 1
MAX_RUNS = _RUN_MASK + 1
"""Runs (messages) one ``write_blocks`` call may need."""
KIND_MASK = 3 << _KIND_SHIFT
WRITE_MASK = ((1 << 64) - 1) ^ _RUN_MASK
"""Matches every run of one write: kind, link and seq, any run."""


def kind_tag(kind: int) -> int:
    return kind << _KIND_SHIFT


def header_tag(link: int, seq: int) -> int:
    return (HEADER << _KIND_SHIFT) | (link << _LINK_SHIFT) | (seq << _SEQ_SHIFT)


def data_tag(link: int, seq: int, run: int) -> int:
    return (DATA << _KIND_SHIFT) | (link << _LINK_SHIFT) | (seq << _SEQ_SHIFT) | run


def split(tag: int) -> tuple[int, int, int, int]:
    """(kind, link, seq, run) of a tag."""
    return (
        tag >> _KIND_SHIFT,
        (tag >> _LINK_SHIFT) & MAX_LINK,
        (tag >> _SEQ_SHIFT) & SEQ_MASK,
        tag & _RUN_MASK,
    )
