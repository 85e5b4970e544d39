"""The staged lane's notifications (see :mod:`p2pkv_nixl.transport`): building a request and
checking every field of one received, without touching NIXL.

A request (consumer -> producer) is :data:`REQUEST_HEAD` (prefix, request id, pool base, pool
blocks, block length, count, blocks per pool slice: the pool is registered in slices of that
many, the last the rest, see :mod:`p2pkv_nixl.slices`), then ``count`` little-endian uint32
source indexes, ``count`` uint32 pool indexes, and the pool's partial NIXL metadata. The
producer answers with its WRITE's completion notification (:data:`DONE` + id) or a failure
(:data:`FAILED` + id + reason). :data:`PING` only wires up or probes a connection and is
ignored by its target.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from p2pkv_nixl.slices import MAX_SLICES

__all__ = [
    "DONE",
    "FAILED",
    "ID",
    "PING",
    "REQUEST",
    "REQUEST_HEAD",
    "Outcome",
    "Refused",
    "StagedRequest",
    "outcome",
    "parse_request",
    "request_id",
    "request_message",
]

REQUEST = b"p2kvR2"
DONE = b"p2kvD1"
FAILED = b"p2kvF1"
PING = b"p2kvP1"
REQUEST_HEAD = struct.Struct("<6sQQIIII")
ID = struct.Struct("<Q")
MAX_REQUEST_BLOCKS = 1 << 26
"""A request naming more blocks is refused unread (no pool is that large)."""


class Refused(Exception):
    """A staged read request we do not serve; ``request`` is its id when it could be read."""

    def __init__(self, reason: str, request: int | None = None) -> None:
        super().__init__(reason)
        self.request = request


@dataclass(frozen=True)
class StagedRequest:
    """A checked request: WRITE our blocks ``src`` into the asker's pool blocks ``stage``."""

    request: int
    base: int
    capacity: int
    slice_blocks: int
    """The pool's blocks per registration (its last slice may be shorter)."""
    src: npt.NDArray[np.int32]
    stage: npt.NDArray[np.int32]
    metadata: bytes


@dataclass(frozen=True)
class Outcome:
    """The producer's answer to our request ``request``: ``ok``, else ``reason``."""

    request: int
    ok: bool
    reason: str


def request_message(
    request: int,
    base: int,
    capacity: int,
    slice_blocks: int,
    block_len: int,
    src: npt.NDArray[np.int64],
    stage: npt.NDArray[np.int32],
    metadata: bytes,
) -> bytes:
    """The request asking a producer to WRITE its blocks ``src`` into our pool's ``stage``."""
    return b"".join(
        (
            REQUEST_HEAD.pack(REQUEST, request, base, capacity, block_len, len(src), slice_blocks),
            src.astype("<u4").tobytes(),
            stage.astype("<u4").tobytes(),
            metadata,
        )
    )


def request_id(message: bytes) -> int | None:
    """The id of a request message, without checking the rest; None if it has none."""
    if len(message) < REQUEST_HEAD.size:
        return None
    return int(REQUEST_HEAD.unpack_from(message)[1])


def parse_request(message: bytes, block_len: int, num_blocks: int) -> StagedRequest:
    """A request's fields, every one checked against our ``block_len`` and ``num_blocks``;
    ``Refused`` says what is wrong (with the request id once it could be read)."""
    if len(message) < REQUEST_HEAD.size:
        raise Refused(f"a request of {len(message)} bytes is truncated")
    _, request, base, capacity, theirs, count, slice_blocks = REQUEST_HEAD.unpack_from(message)
    if theirs != block_len:
        raise Refused(f"block_len {theirs} is not ours ({block_len})", request)
    if not 0 < count <= MAX_REQUEST_BLOCKS:
        raise Refused(f"a request for {count} blocks", request)
    if not (capacity > 0 and base > 0 and base + capacity * block_len <= 2**64):
        raise Refused(f"staging pool at {base:#x} of {capacity} blocks is invalid", request)
    if not (slice_blocks > 0 and -(-capacity // slice_blocks) <= MAX_SLICES):
        raise Refused(f"staging pool slices of {slice_blocks} blocks are invalid", request)
    end = REQUEST_HEAD.size + 8 * count
    if len(message) <= end:
        raise Refused(
            f"a request for {count} blocks of {len(message)} bytes is truncated "
            f"(or lacks the pool metadata)",
            request,
        )
    src = np.frombuffer(message, "<u4", count, REQUEST_HEAD.size)
    stage = np.frombuffer(message, "<u4", count, REQUEST_HEAD.size + 4 * count)
    if int(src.max()) >= num_blocks:
        raise Refused(f"source block {int(src.max())} is outside 0..{num_blocks - 1}", request)
    if int(stage.max()) >= capacity:
        raise Refused(f"pool block {int(stage.max())} is outside 0..{capacity - 1}", request)
    return StagedRequest(
        request,
        base,
        capacity,
        slice_blocks,
        src.astype(np.int32),
        stage.astype(np.int32),
        message[end:],
    )


def outcome(message: bytes) -> Outcome | None:
    """A completion or failure notification's content; ``None`` for anything else."""
    prefix = message[:6]
    if prefix not in (DONE, FAILED) or len(message) < 6 + ID.size:
        return None
    (request,) = ID.unpack_from(message, 6)
    reason = message[6 + ID.size :].decode("utf-8", "replace")
    return Outcome(request, prefix == DONE, reason)
