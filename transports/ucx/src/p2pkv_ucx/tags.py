"""The 64-bit UCX tag of every message the ``ucx`` transport sends (wire 2).

UCX matches tags per *worker*, not per connection, so a tag must say who sent the message.
``link`` is the id the *consumer* (the side that reads, and receives the data) gave the
producer; it travels in every READ notice, and the producer tags the data it serves with it::

    DATA    00 | link:22 | rid:20 | run:20      one run of read ``rid``, producer -> consumer
    NOTICE  01 | sender:62                      READ / CANCEL / REFUSE (payload names sender)

A NOTICE's tag carries its sender's instance id (the payload names it too): the receiver
applies each sender's notices in order, and one sender's notice that UCX has not finished
receiving (a rendezvous one, from a peer that stopped mid-send) holds up only that sender's
later notices, never another peer's. A sender of the first wire-2 release puts 0 there: its
notices then share one order, as before.

``rid`` numbers the consumer's reads on one link; when it would wrap the consumer moves the
peer to a fresh link, and links are never reused, so no DATA tag is ever used twice by one
transport (a stale message can never match a later read). ``run`` is the run's position in
the read. Kinds 2 and 3 are reserved.
"""

from __future__ import annotations

__all__ = [
    "DATA",
    "KIND_MASK",
    "MAX_LINK",
    "MAX_RUNS",
    "NOTICE",
    "RID_LIMIT",
    "data_tag",
    "kind_tag",
    "notice_tag",
    "read_key",
    "run_of",
    "sender_of",
    "split",
]

DATA, NOTICE = 0, 1
_KIND_SHIFT, _LINK_SHIFT, _RID_SHIFT = 62, 40, 20
MAX_LINK = (1 << 22) - 1
RID_LIMIT = 1 << 20
"""Reads per link; the consumer moves a peer to a new link before a rid would repeat."""
_RUN_MASK = (1 << 20) - 1
_KEY_MASK = (1 << 42) - 1
MAX_RUNS = _RUN_MASK + 1
"""Messages (runs) one read may need."""
KIND_MASK = 3 << _KIND_SHIFT


def kind_tag(kind: int) -> int:
    """The tag (and, under ``KIND_MASK``, the match pattern) of every message of ``kind``."""
    return kind << _KIND_SHIFT


def notice_tag(instance: int) -> int:
    """The tag of every NOTICE ``instance`` (a 62-bit id) sends."""
    return kind_tag(NOTICE) | instance


def sender_of(tag: int) -> int:
    """The sender part of a NOTICE's tag (its instance; 0 from an older sender)."""
    return tag & ~KIND_MASK


def data_tag(link: int, rid: int, run: int) -> int:
    """The tag of run ``run`` of read ``rid`` on ``link`` (0 < link <= MAX_LINK)."""
    return (link << _LINK_SHIFT) | (rid << _RID_SHIFT) | run


def read_key(tag: int) -> int:
    """The (link, rid) part of a DATA tag, as one integer: names the read it belongs to."""
    return (tag >> _RID_SHIFT) & _KEY_MASK


def run_of(tag: int) -> int:
    """The run number of a DATA tag."""
    return tag & _RUN_MASK


def split(tag: int) -> tuple[int, int, int, int]:
    """(kind, link, rid, run) of a tag."""
    return (
        tag >> _KIND_SHIFT,
        (tag >> _LINK_SHIFT) & MAX_LINK,
        (tag >> _RID_SHIFT) & (RID_LIMIT - 1),
        tag & _RUN_MASK,
    )
