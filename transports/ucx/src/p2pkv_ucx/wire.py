"""What the ``ucx`` transport puts on the wire besides block payload: msgpack, never pickle.

- **Descriptor** (``descriptor()`` → peer's ``add_peer``): our UCX worker address, region
  shape, a random instance id, the longest run (in blocks) we accept in one message, and
  whether our endpoints use UCX error handling (both sides must agree: UCX cannot connect
  endpoints of different modes, it hangs).
- **NOTICE** messages, consumer → producer (tag kind NOTICE), each naming the consumer by its
  instance id; UCX keeps them in order, and the producer handles them in that order:

  - EXPECT ``(link, gen, slots)``: "write into my ``slots`` for round ``gen``; tag your
    messages to me with ``link``";
  - RETRACT ``(gen, slots)``: round ``gen`` no longer wants ``slots`` (cancelled, timed out);
  - VERDICT ``(seq, refused)``: of your write ``seq``, ``refused`` runs matched no live round
    and were discarded (0: all of it landed).

- **HEADER** (producer → consumer, tag kind HEADER + link + seq): the producer's instance and
  the runs of one write, each ``(dst_start, length, gen)``; run ``i``'s payload follows as one
  SLOT message (one block) or one RUN message with run number ``i``.

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
    "Notice",
    "Retract",
    "Verdict",
    "decode_descriptor",
    "decode_header",
    "decode_notice",
    "encode_descriptor",
    "encode_expect",
    "encode_header",
    "encode_retract",
    "encode_verdict",
]

WIRE_VERSION = 1
_EXPECT, _RETRACT, _VERDICT = 0, 1, 2
_U32 = np.dtype("<u4")
IntArray = npt.NDArray[np.int64]


@dataclass(frozen=True)
class Descriptor:
    address: bytes
    instance: int
    num_blocks: int
    block_len: int
    max_run: int
    error_handling: bool


@dataclass(frozen=True)
class Expect:
    instance: int
    link: int
    gen: int
    slots: IntArray


@dataclass(frozen=True)
class Retract:
    instance: int
    gen: int
    slots: IntArray


@dataclass(frozen=True)
class Verdict:
    instance: int
    seq: int
    refused: int


Notice = Expect | Retract | Verdict


@dataclass(frozen=True)
class Header:
    instance: int
    starts: IntArray
    lengths: IntArray
    gens: IntArray


def encode_descriptor(d: Descriptor) -> bytes:
    return _pack({
        "transport": "ucx", "v": WIRE_VERSION, "address": d.address, "instance": d.instance,
        "num_blocks": d.num_blocks, "block_len": d.block_len, "max_run": d.max_run,
        "error_handling": d.error_handling,
    })


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
    error_handling = obj.get("error_handling")
    if not isinstance(error_handling, bool):
        raise ValueError("descriptor does not say whether it uses endpoint error handling")
    instance, num_blocks, block_len, max_run = (int(n) for n in numbers)  # type: ignore[arg-type]
    return Descriptor(address, instance, num_blocks, block_len, max_run, error_handling)


def encode_expect(instance: int, link: int, gen: int, slots: IntArray) -> bytes:
    return _pack([WIRE_VERSION, _EXPECT, instance, link, gen, _u32(slots)])


def encode_retract(instance: int, gen: int, slots: IntArray) -> bytes:
    return _pack([WIRE_VERSION, _RETRACT, instance, gen, _u32(slots)])


def encode_verdict(instance: int, seq: int, refused: int) -> bytes:
    return _pack([WIRE_VERSION, _VERDICT, instance, seq, refused])


def decode_notice(data: bytes) -> Notice:
    obj = _unpack(data, max_bin=len(data))
    if not (isinstance(obj, list) and len(obj) >= 4 and obj[0] == WIRE_VERSION):
        raise ValueError("malformed NOTICE")
    kind, instance, fields = obj[1], obj[2], obj[3:]
    if not _is_positive(instance):
        raise ValueError("NOTICE without a sender instance")
    if kind == _EXPECT and len(fields) == 3 and _is_positive(fields[0]) and _is_positive(
        fields[1]
    ):
        return Expect(instance, fields[0], fields[1], _ints(fields[2], "slots"))
    if kind == _RETRACT and len(fields) == 2 and _is_positive(fields[0]):
        return Retract(instance, fields[0], _ints(fields[1], "slots"))
    if kind == _VERDICT and len(fields) == 2 and all(_is_count(f) for f in fields):
        return Verdict(instance, fields[0], fields[1])
    raise ValueError(f"malformed NOTICE of kind {kind!r}")


def encode_header(instance: int, starts: IntArray, lengths: IntArray, gens: IntArray) -> bytes:
    return _pack([WIRE_VERSION, instance, _u32(starts), _u32(lengths), _u32(gens)])


def decode_header(data: bytes) -> Header:
    obj = _unpack(data, max_bin=len(data))
    if not (isinstance(obj, list) and len(obj) == 5 and obj[0] == WIRE_VERSION):
        raise ValueError("malformed HEADER")
    if not _is_positive(obj[1]):
        raise ValueError("HEADER without a sender instance")
    starts, lengths, gens = (_ints(obj[i], name) for i, name in
                             ((2, "starts"), (3, "lengths"), (4, "gens")))
    if not len(starts) == len(lengths) == len(gens):
        raise ValueError("HEADER arrays differ in length")
    return Header(obj[1], starts, lengths, gens)


def _pack(obj: Any) -> bytes:
    return bytes(msgpack.packb(obj))


def _unpack(data: bytes, max_bin: int) -> Any:
    try:
        return msgpack.unpackb(
            data, raw=False, strict_map_key=True, max_bin_len=max_bin, max_str_len=64,
            max_array_len=8, max_map_len=16, max_ext_len=0,
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
