"""What the ``ucx`` transport puts on the wire besides block payload: msgpack, never pickle.

Wire version 2 (p2pkv wire 2.0, "the consumer owns every write into its region"):

- **Descriptor** (``descriptor()`` → peer's ``add_peer``): our UCX worker address, region
  shape, a random instance id, the longest run (in blocks) we send or receive as one
  message, the blocks per slice of our region (no message crosses a slice boundary, see
  ``slice_bytes`` in :mod:`p2pkv_ucx.options`), and whether our endpoints use UCX error
  handling (both sides must agree: UCX cannot connect endpoints of different modes, it hangs).
- **NOTICE** messages (tag kind NOTICE, with the sender's instance id in the tag's other
  bits, :func:`p2pkv_ucx.tags.notice_tag`), each naming its sender by instance id; UCX keeps
  each sender's in order, and the receiver handles each sender's in that order:

  - READ ``(link, rid, starts, lengths)``, consumer → producer: "send me your blocks
    ``starts[i] .. starts[i] + lengths[i] - 1`` as one DATA message each, tagged with
    ``link``, ``rid`` and the run number ``i``". Destinations never travel: the consumer
    alone decides where a run lands, after it arrived whole;
  - CANCEL ``(link, rids)``, consumer → producer: those reads are over; do not serve the ones
    you have not started;
  - REFUSE ``(link, rid, reason)``, producer → consumer: read ``rid`` will not be served
    (malformed, outside my region).

Decoders validate types and sizes and raise ``ValueError`` with the reason; integer arrays
travel as little-endian ``uint32`` bytes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np
import numpy.typing as npt

__all__ = [
    "WIRE_VERSION",
    "Cancel",
    "Descriptor",
    "Notice",
    "Read",
    "Refuse",
    "decode_descriptor",
    "decode_notice",
    "encode_cancel",
    "encode_descriptor",
    "encode_read",
    "encode_refuse",
    "short_reason",
]

WIRE_VERSION = 2
"""2: consumer-initiated reads (READ/CANCEL/REFUSE); 1 had EXPECT/HEADER/VERDICT writes."""
_READ, _CANCEL, _REFUSE = 0, 1, 2
_U32 = np.dtype("<u4")
MAX_REASON = 60
"""UTF-8 bytes of a REFUSE reason kept on the wire (cut at a character boundary)."""
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Descriptor:
    address: bytes
    instance: int
    num_blocks: int
    block_len: int
    max_run: int
    error_handling: bool
    slice_blocks: int = 1 << 32
    """Blocks per slice of the region (the default: one slice, whatever its size)."""


@dataclass(frozen=True)
class Read:
    instance: int
    link: int
    rid: int
    starts: IntArray
    lengths: IntArray


@dataclass(frozen=True)
class Cancel:
    instance: int
    link: int
    rids: IntArray


@dataclass(frozen=True)
class Refuse:
    instance: int
    link: int
    rid: int
    reason: str


Notice = Read | Cancel | Refuse


def encode_descriptor(d: Descriptor) -> bytes:
    return _pack(
        {
            "transport": "ucx",
            "v": WIRE_VERSION,
            "address": d.address,
            "instance": d.instance,
            "num_blocks": d.num_blocks,
            "block_len": d.block_len,
            "max_run": d.max_run,
            "error_handling": d.error_handling,
            "slice_blocks": d.slice_blocks,
        }
    )


def decode_descriptor(data: bytes) -> Descriptor:
    """The peer's descriptor; ``ValueError`` naming the problem (another wire version too)."""
    obj = _unpack(data, max_bin=1 << 16)
    if not isinstance(obj, dict) or obj.get("transport") != "ucx":
        raise ValueError("not a ucx transport descriptor")
    if obj.get("v") != WIRE_VERSION:
        raise ValueError(
            f"descriptor of ucx wire version {obj.get('v')!r}, expected "
            f"{WIRE_VERSION} (upgrade p2pkv-ucx on both sides)"
        )
    address = obj.get("address")
    numbers = [
        obj.get(k) for k in ("instance", "num_blocks", "block_len", "max_run", "slice_blocks")
    ]
    if not isinstance(address, bytes) or not address:
        raise ValueError("descriptor has no worker address")
    if not all(_is_positive(n) for n in numbers):
        raise ValueError(f"descriptor needs positive integers, got {numbers!r}")
    error_handling = obj.get("error_handling")
    if not isinstance(error_handling, bool):
        raise ValueError("descriptor does not say whether it uses endpoint error handling")
    instance, num_blocks, block_len, max_run, slices = (
        int(n)  # type: ignore[arg-type]
        for n in numbers
    )
    return Descriptor(address, instance, num_blocks, block_len, max_run, error_handling, slices)


def encode_read(instance: int, link: int, rid: int, starts: IntArray, lengths: IntArray) -> bytes:
    return _pack([WIRE_VERSION, _READ, instance, link, rid, _u32(starts), _u32(lengths)])


def encode_cancel(instance: int, link: int, rids: IntArray) -> bytes:
    return _pack([WIRE_VERSION, _CANCEL, instance, link, _u32(rids)])


def encode_refuse(instance: int, link: int, rid: int, reason: str) -> bytes:
    return _pack([WIRE_VERSION, _REFUSE, instance, link, rid, short_reason(reason)])


def short_reason(reason: str) -> str:
    """``reason`` cut to at most ``MAX_REASON`` UTF-8 bytes, at a character boundary."""
    return reason.encode()[:MAX_REASON].decode("utf-8", "ignore")


def decode_notice(data: bytes) -> Notice:
    """A NOTICE; ``ValueError`` for anything malformed (never another exception type)."""
    obj = _unpack(data, max_bin=len(data))
    if not (isinstance(obj, list) and len(obj) >= 5 and obj[0] == WIRE_VERSION):
        raise ValueError("malformed NOTICE")
    kind, instance, link, fields = obj[1], obj[2], obj[3], obj[4:]
    if not _is_positive(instance) or not _is_positive(link):
        raise ValueError("NOTICE without a sender instance or link")
    if kind == _READ and len(fields) == 3 and _is_count(fields[0]):
        starts, lengths = _ints(fields[1], "starts"), _ints(fields[2], "lengths")
        if len(starts) != len(lengths):
            raise ValueError("READ arrays differ in length")
        return Read(instance, link, fields[0], starts, lengths)
    if kind == _CANCEL and len(fields) == 1:
        return Cancel(instance, link, _ints(fields[0], "rids"))
    if kind == _REFUSE and len(fields) == 2 and _is_count(fields[0]) and isinstance(fields[1], str):
        return Refuse(instance, link, fields[0], fields[1])
    raise ValueError(f"malformed NOTICE of kind {kind!r}")


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj))


def _unpack(data: bytes, max_bin: int) -> Any:
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            max_bin_len=max_bin,
            max_str_len=64,
            max_array_len=8,
            max_map_len=16,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable ({type(exc).__name__}: {exc})") from None


def _is_count(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 <= n < (1 << 63)


def _is_positive(n: Any) -> bool:
    return _is_count(n) and n > 0


def _u32(values: IntArray) -> bytes:
    return values.astype(_U32).tobytes()


def _ints(raw: Any, what: str) -> IntArray:
    if not isinstance(raw, bytes) or len(raw) % _U32.itemsize:
        raise ValueError(f"{what} must be uint32 bytes")
    return np.frombuffer(raw, _U32).astype(np.int64)
