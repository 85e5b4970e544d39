"""What the ``ucx`` transport puts on the wire besides block payload: msgpack, never pickle.

- **Descriptor** (``descriptor()`` → peer's ``add_peer``): our UCX worker address, region
  shape, a random instance id, and the longest run (in blocks) we accept in one message.
- **EXPECT** (consumer → producer, tag kind EXPECT): "I expect your write into my slots
  ``slots``, round ``gen``; tag your messages to me with link ``link``".
- **HEADER** (producer → consumer, tag kind HEADER + link + seq): the runs of one write, each
  ``(dst_start, length, gen)``; run ``i``'s payload follows as DATA with run number ``i``.

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
    "Descriptor",
    "Expect",
    "Header",
    "decode_descriptor",
    "decode_expect",
    "decode_header",
    "encode_descriptor",
    "encode_expect",
    "encode_header",
]

WIRE_VERSION = 1
_U32 = np.dtype("<u4")
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Descriptor:
    address: bytes
    instance: int
    num_blocks: int
    block_len: int
    max_run: int


@dataclass(frozen=True)
class Expect:
    instance: int
    link: int
    gen: int
    slots: IntArray


@dataclass(frozen=True)
class Header:
    starts: IntArray
    lengths: IntArray
    gens: IntArray


def encode_descriptor(d: Descriptor) -> bytes:
    return bytes(msgpack.packb({
        "transport": "ucx", "v": WIRE_VERSION, "address": d.address, "instance": d.instance,
        "num_blocks": d.num_blocks, "block_len": d.block_len, "max_run": d.max_run,
    }))


def decode_descriptor(data: bytes) -> Descriptor:
    obj = _unpack(data, max_bin=1 << 16)
    if not isinstance(obj, dict) or obj.get("transport") != "ucx":
        raise ValueError("not a ucx transport descriptor")
    if obj.get("v") != WIRE_VERSION:
        raise ValueError(f"descriptor version {obj.get('v')!r}, expected {WIRE_VERSION}")
    address = obj.get("address")
    numbers = [obj.get(k) for k in ("instance", "num_blocks", "block_len", "max_run")]
    if not isinstance(address, bytes) or not address:
        raise ValueError("descriptor has no worker address")
    if not all(_is_positive(n) for n in numbers):
        raise ValueError(f"descriptor needs positive integers, got {numbers!r}")
    return Descriptor(address, *numbers)


def encode_expect(instance: int, link: int, gen: int, slots: IntArray) -> bytes:
    return bytes(msgpack.packb([WIRE_VERSION, instance, link, gen, _u32(slots)]))


def decode_expect(data: bytes) -> Expect:
    obj = _unpack(data, max_bin=len(data))
    if not (isinstance(obj, list) and len(obj) == 5 and obj[0] == WIRE_VERSION):
        raise ValueError("malformed EXPECT")
    _, instance, link, gen, slots = obj
    if not (_is_positive(instance) and _is_positive(link) and _is_positive(gen)):
        raise ValueError("EXPECT needs positive instance, link and gen")
    return Expect(instance, link, gen, _ints(slots, "slots"))


def encode_header(starts: IntArray, lengths: IntArray, gens: IntArray) -> bytes:
    return bytes(msgpack.packb([WIRE_VERSION, _u32(starts), _u32(lengths), _u32(gens)]))


def decode_header(data: bytes) -> Header:
    obj = _unpack(data, max_bin=len(data))
    if not (isinstance(obj, list) and len(obj) == 4 and obj[0] == WIRE_VERSION):
        raise ValueError("malformed HEADER")
    starts, lengths, gens = (_ints(obj[i], name) for i, name in
                             ((1, "starts"), (2, "lengths"), (3, "gens")))
    if not len(starts) == len(lengths) == len(gens):
        raise ValueError("HEADER arrays differ in length")
    return Header(starts, lengths, gens)


def _unpack(data: bytes, max_bin: int) -> Any:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bin, max_str_len=64,
            max_array_len=8, max_map_len=16, max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types
        raise ValueError(f"undecodable ({type(exc).__name__}: {exc})") from None


def _is_positive(n: Any) -> bool:
    return isinstance(n, int) and not isinstance(n, bool) and 0 < n < (1 << 63)


def _u32(values: IntArray) -> bytes:
    return values.astype(_U32).tobytes()


def _ints(raw: Any, what: str) -> IntArray:
    if not isinstance(raw, bytes) or len(raw) % _U32.itemsize:
        raise ValueError(f"{what} must be uint32 bytes")
    return np.frombuffer(raw, _U32).astype(np.int64)
