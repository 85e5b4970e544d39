"""The session wire format: versioned msgpack maps, strictly validated (docs/protocol.md).

Every frame is one msgpack map with a ``"type"`` string and the fields of that message.
Nothing is ever unpickled; ``bin`` values stay ``bytes``; map keys are strings. Decoding
checks the frame size, every field's type and range, and the caps from
:class:`p2pkv.config.Limits`; a violation raises :class:`p2pkv.errors.ProtocolError` whose
message starts with ``<type>.<field>`` so both sides can log exactly what was wrong.

Compatibility: unknown fields are ignored (a newer minor version may add optional fields);
a message type this side does not know decodes to :class:`Unknown` and the session decides
(ignored when the peer announced a newer minor version, a protocol error otherwise). Only
``hello`` carries the wire version; a peer with another major version is rejected during the
handshake. A field added in a minor version decodes to its old meaning when missing (2.1:
``round_failed.outcome`` and ``bye.outcome``, which 2.0 peers only put at the head of
``reason``).

Two decoders, one contract. The fast one (msgspec, typed in C) takes a frame of the hot
message types (``hello_ack``, ``fetch``, ``ready``, ``release``, ``lookup``, ``lookup_resp``)
that is a small map (at most 15 entries) of exactly the known fields, each of the right type,
and checks the caps from ``Limits`` in a few C-level passes. Any other frame (another type, an
unknown field, a wrong value, a cap exceeded) goes to the strict decoder (msgpack and a
per-field check), which names the field at fault or returns the message: so a frame decodes
to the same message, or fails with the same error, whichever decoder takes it. Encoding is
msgspec's (the message types are msgspec structs; the bytes are what msgpack writes for the
same map). ``fetch`` keys and ``ready`` positions/slots stay plain lists (no per-block
objects beyond the list items).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgpack
import msgspec

from p2pkv.config import Limits
from p2pkv.errors import ProtocolError
from p2pkv.types import Outcome

WIRE_MAJOR = 2
"""Bumped only for incompatible changes; peers with another major are rejected. 2.0: the
consumer reads (``ready``/``release``); producers no longer write into consumers' regions."""
WIRE_MINOR = 1
"""Bumped for additive changes (new optional fields or message types). 2.1: ``outcome`` of
``round_failed`` and ``bye``."""

MAX_REASON_CHARS = 1024
"""Cap on free-text ``reason`` fields."""
MAX_ADDRESS_CHARS = 1024
MAX_TAG_CHARS = 256
"""Cap on ``fingerprint`` and ``hash_seed``."""
_U64 = 1 << 64
_U32 = 1 << 32
U64 = Annotated[int, msgspec.Meta(ge=0)]
"""A msgpack integer that is not negative (msgpack integers stop below 2**64)."""
U32 = Annotated[int, msgspec.Meta(ge=0, lt=_U32)]
Key = Annotated[bytes, msgspec.Meta(min_length=1)]


class _Wire(msgspec.Struct, frozen=True, gc=False, tag_field="type", forbid_unknown_fields=True):
    """A message: a msgpack map of ``type`` (the tag) and the fields. Unknown fields are
    refused here only by the fast decoder, which hands such frames to the strict one."""


class Hello(_Wire, frozen=True, tag="hello"):
    """First message on a connection, both ways: who we are and what our region looks like."""

    wire: tuple[int, int]
    epoch: int
    """Random per tier incarnation; a new epoch on a live session means the peer restarted."""
    address: str
    """The sender's dialable control address (must equal what the receiver sees)."""
    descriptor: bytes
    """The sender's data-transport descriptor (``DataTransport.descriptor()``)."""
    num_blocks: int
    block_len: int
    fingerprint: str
    hash_seed: str
    lease_ms: int = 0
    """How long the sender, as a producer, pins the blocks it offers (``timeouts.lease``, in
    ms; 0 = not announced). A consumer accepts reads from it only within the shorter of this
    and its own lease."""


class HelloAck(_Wire, frozen=True, tag="hello_ack"):
    """We registered the peer's hello with this ``epoch`` (an echo of ``Hello.epoch``)."""

    epoch: U64


class Fetch(_Wire, frozen=True, tag="fetch"):
    """Consumer -> producer: I want ``keys`` (round ``round`` of ``kv_request_id``).

    ``round`` numbers the loads of one ``kv_request_id`` on one session (0, 1, ...; each
    completes independently). The consumer's lease clock for the round starts when it sends
    this. Empty ``keys`` is the terminal fetch: the consumer is done with the request, the
    producer releases everything it holds for it and answers nothing.
    """

    kv_request_id: str
    round: U64
    keys: list[Key]


class Ready(_Wire, frozen=True, tag="ready"):
    """Producer -> consumer: key ``keys[pos[i]]`` of the round is in my slot ``slots[i]``,
    pinned from now for the lease (``timeouts.lease``) or until the round's ``release``.

    A round gets one or more ``ready`` (supply may arrive in parts); together they name each
    key of the round exactly once.
    """

    kv_request_id: str
    round: U64
    pos: list[U32]
    slots: list[U32]


class Release(_Wire, frozen=True, tag="release"):
    """Consumer -> producer: I am done with round ``round``; unpin its slots. ``read``: every
    block of it arrived within the lease (the store jobs are delivered)."""

    kv_request_id: str
    round: U64
    read: bool


class Lookup(_Wire, frozen=True, tag="lookup"):
    """Consumer -> producer (symmetric mode): which of ``keys`` can you serve?"""

    seq: U64
    kv_request_id: str
    keys: list[Key]


class LookupResp(_Wire, frozen=True, tag="lookup_resp"):
    """Producer -> consumer: ``hits[i]`` answers ``keys[i]`` of lookup ``seq``."""

    seq: U64
    hits: list[bool]


class RoundFailed(_Wire, frozen=True, tag="round_failed"):
    """Producer -> consumer: round ``round`` cannot be served, the load fails ``outcome`` (an
    ``Outcome`` value: demand unmet, request conflict, shutdown, lease passed; ``reason`` starts
    with it too, for 2.0 consumers). No ``ready`` for it follows; blocks already offered stay
    pinned until the consumer's ``release`` (which it sends on receipt) or the lease."""

    kv_request_id: str
    round: int
    reason: str
    outcome: str = Outcome.TRANSFER_FAILED.value


class Bye(_Wire, frozen=True, tag="bye"):
    """Either way: I am closing this session, because ``reason``; the receiver's jobs fail
    ``outcome``: ``peer_rejected`` (a refused handshake, ``reason`` then starts with
    ``rejected: ``), ``protocol_error`` (``protocol error: ...``) or ``peer_dead``."""

    reason: str
    outcome: str = Outcome.PEER_DEAD.value


@dataclass(frozen=True, slots=True)
class Unknown:
    """A well-formed frame of a message type this side does not know."""

    type: str


Message = Hello | HelloAck | Fetch | Ready | Release | RoundFailed | Lookup | LookupResp | Bye


def message_type(msg: Message | Unknown) -> str:
    """The wire ``type`` string of ``msg`` (a message's struct tag)."""
    if isinstance(msg, Unknown):
        return msg.type
    return str(msg.__struct_config__.tag)


# -- encoding -------------------------------------------------------------------------------


def encode(msg: Message) -> bytes:
    """One frame for ``msg``. Fields are written as given (the sender is trusted to be valid)."""
    if not isinstance(msg, _Wire):
        raise TypeError(f"not a protocol message: {msg!r}")
    return _ENCODE(msg)


_ENCODE = msgspec.msgpack.Encoder().encode


# -- decoding -------------------------------------------------------------------------------


class _Fields:
    """Typed access to one decoded map; every error names ``<type>.<field>``."""

    __slots__ = ("d", "kind")

    def __init__(self, kind: str, d: dict[str, Any]) -> None:
        self.kind = kind
        self.d = d

    def err(self, field: str, what: str) -> ProtocolError:
        return ProtocolError(f"{self.kind}.{field}: {what}")

    def get(self, field: str) -> Any:
        try:
            return self.d[field]
        except KeyError:
            raise self.err(field, "missing") from None

    def int_(self, field: str, low: int = 0, high: int = _U64) -> int:
        v = self.get(field)
        if type(v) is not int:
            raise self.err(field, f"expected an integer, got {_tname(v)}")
        if not low <= v < high:
            raise self.err(field, f"{v} is outside {low}..{high - 1}")
        return v

    def bool_(self, field: str) -> bool:
        v = self.get(field)
        if type(v) is not bool:
            raise self.err(field, f"expected a boolean, got {_tname(v)}")
        return v

    def str_(
        self, field: str, max_chars: int, *, default: str | None = None, nonempty: bool = False
    ) -> str:
        if default is not None and field not in self.d:
            return default
        v = self.get(field)
        if type(v) is not str:
            raise self.err(field, f"expected a string, got {_tname(v)}")
        if len(v) > max_chars:
            raise self.err(field, f"{len(v)} characters exceeds the cap of {max_chars}")
        if nonempty and not v:
            raise self.err(field, "must not be empty")
        return v

    def bytes_(self, field: str, max_bytes: int) -> bytes:
        v = self.get(field)
        if type(v) is not bytes:
            raise self.err(field, f"expected bytes, got {_tname(v)}")
        if len(v) > max_bytes:
            raise self.err(field, f"{len(v)} bytes exceeds the cap of {max_bytes}")
        return v

    def list_(self, field: str, max_len: int) -> list[Any]:
        v = self.get(field)
        if type(v) is not list:
            raise self.err(field, f"expected a list, got {_tname(v)}")
        if len(v) > max_len:
            raise self.err(field, f"{len(v)} entries exceeds the cap of {max_len}")
        return v

    def ints(self, field: str, max_len: int) -> list[int]:
        """A list of non-negative integers below 2**32 (positions, slots)."""
        values = self.list_(field, max_len)
        if _all(values, int) and (not values or (min(values) >= 0 and max(values) < _U32)):
            return values
        for i, v in enumerate(values):
            if type(v) is not int or not 0 <= v < _U32:
                raise self.err(f"{field}[{i}]", f"expected an integer in 0..{_U32 - 1}, got {v!r}")
        return values

    def keys(self, field: str, limits: Limits) -> list[bytes]:
        keys = self.list_(field, limits.max_keys_per_message)
        cap = limits.max_key_bytes
        if _all(keys, bytes):
            lens = set(map(len, keys))
            if not lens or (min(lens) > 0 and max(lens) <= cap):
                return keys  # fast path: checked in C; the loop below names the culprit
        for i, k in enumerate(keys):
            if type(k) is not bytes:
                raise self.err(f"{field}[{i}]", f"expected bytes, got {_tname(k)}")
            if not 0 < len(k) <= cap:
                raise self.err(f"{field}[{i}]", f"key of {len(k)} bytes is outside 1..{cap}")
        return keys

    def request_id(self, limits: Limits) -> str:
        return self.str_("kv_request_id", limits.max_request_id_chars, nonempty=True)


def _tname(v: object) -> str:
    return type(v).__name__


def _all(values: list[Any], t: type) -> bool:
    """Every element is exactly of type ``t`` (one C-level pass; True for an empty list)."""
    return not values or set(map(type, values)) == {t}


def _hello(f: _Fields, limits: Limits) -> Hello:
    wire = f.list_("wire", 2)
    if len(wire) != 2 or any(type(x) is not int or x < 0 for x in wire):
        raise f.err("wire", f"expected [major, minor] non-negative integers, got {wire!r}")
    return Hello(
        wire=(wire[0], wire[1]),
        epoch=f.int_("epoch"),
        address=f.str_("address", MAX_ADDRESS_CHARS, nonempty=True),
        descriptor=f.bytes_("descriptor", limits.max_descriptor_bytes),
        num_blocks=f.int_("num_blocks", 1),
        block_len=f.int_("block_len", 1),
        fingerprint=f.str_("fingerprint", MAX_TAG_CHARS, default=""),
        hash_seed=f.str_("hash_seed", MAX_TAG_CHARS, default=""),
        lease_ms=f.int_("lease_ms") if "lease_ms" in f.d else 0,
    )


def _hello_ack(f: _Fields, limits: Limits) -> HelloAck:
    return HelloAck(epoch=f.int_("epoch"))


def _fetch(f: _Fields, limits: Limits) -> Fetch:
    return Fetch(f.request_id(limits), f.int_("round"), f.keys("keys", limits))


def _ready(f: _Fields, limits: Limits) -> Ready:
    kv = f.request_id(limits)
    rnd = f.int_("round")
    cap = limits.max_keys_per_message
    pos = f.ints("pos", cap)
    slots = f.ints("slots", cap)
    if not pos:
        raise f.err("pos", "must not be empty")
    if len(slots) != len(pos):
        raise f.err("slots", f"{len(slots)} slots for {len(pos)} positions")
    return Ready(kv, rnd, pos, slots)


def _release(f: _Fields, limits: Limits) -> Release:
    return Release(f.request_id(limits), f.int_("round"), f.bool_("read"))


def _lookup(f: _Fields, limits: Limits) -> Lookup:
    seq = f.int_("seq")
    kv = f.request_id(limits)
    keys = f.keys("keys", limits)
    if not keys:
        raise f.err("keys", "must not be empty")
    return Lookup(seq, kv, keys)


def _lookup_resp(f: _Fields, limits: Limits) -> LookupResp:
    seq = f.int_("seq")
    hits = f.list_("hits", limits.max_keys_per_message)
    if _all(hits, bool):
        return LookupResp(seq, hits)
    for i, h in enumerate(hits):
        if type(h) is not bool:
            raise f.err(f"hits[{i}]", f"expected a boolean, got {_tname(h)}")
    return LookupResp(seq, hits)


def _round_failed(f: _Fields, limits: Limits) -> RoundFailed:
    kv, rnd = f.request_id(limits), f.int_("round")
    reason = f.str_("reason", MAX_REASON_CHARS, nonempty=True)
    wire_2_0 = reason.partition(":")[0].strip()  # a 2.0 reason starts with the outcome
    return RoundFailed(kv, rnd, reason, f.str_("outcome", MAX_TAG_CHARS, default=wire_2_0))


def _bye(f: _Fields, limits: Limits) -> Bye:
    reason = f.str_("reason", MAX_REASON_CHARS)
    wire_2_0 = (
        Outcome.PEER_REJECTED
        if reason.startswith("rejected: ")
        else Outcome.PROTOCOL_ERROR
        if reason.startswith("protocol error")
        else Outcome.PEER_DEAD
    )
    return Bye(reason, f.str_("outcome", MAX_TAG_CHARS, default=wire_2_0.value))


_DECODERS: dict[str, Callable[[_Fields, Limits], Message]] = {
    "hello": _hello,
    "hello_ack": _hello_ack,
    "fetch": _fetch,
    "ready": _ready,
    "release": _release,
    "round_failed": _round_failed,
    "lookup": _lookup,
    "lookup_resp": _lookup_resp,
    "bye": _bye,
}


def decode(frame: bytes, limits: Limits) -> Message | Unknown:
    """Parse and validate one frame; ``ProtocolError`` (naming the field) on any violation."""
    if len(frame) > limits.max_frame_bytes:
        raise ProtocolError(
            f"frame: {len(frame)} bytes exceeds max_frame_bytes={limits.max_frame_bytes}"
        )
    if frame and 0x80 <= frame[0] <= 0x8F:  # a fixmap: at most 15 entries
        try:
            msg: Message = _FAST_DECODE(frame)
        except (msgspec.ValidationError, msgspec.DecodeError):
            pass  # the strict decoder says what is wrong, or what it is
        else:
            if _WITHIN_CAPS[type(msg)](msg, limits):
                return msg
    return _decode_strict(frame, limits)


# -- the fast decoder: msgspec, then the caps of ``Limits`` ----------------------------------


def _rid_ok(kv: str, limits: Limits) -> bool:
    return 0 < len(kv) <= limits.max_request_id_chars


def _keys_ok(keys: list[bytes], limits: Limits) -> bool:
    """Within the count and length caps (msgspec checked the types and that none is empty)."""
    return len(keys) <= limits.max_keys_per_message and (
        not keys or max(map(len, keys)) <= limits.max_key_bytes
    )


def _fetch_ok(m: Fetch, limits: Limits) -> bool:
    return _rid_ok(m.kv_request_id, limits) and _keys_ok(m.keys, limits)


def _ready_ok(m: Ready, limits: Limits) -> bool:
    n = len(m.pos)
    return (
        _rid_ok(m.kv_request_id, limits)
        and 0 < n <= limits.max_keys_per_message
        and len(m.slots) == n
    )


def _release_ok(m: Release, limits: Limits) -> bool:
    return _rid_ok(m.kv_request_id, limits)


def _lookup_ok(m: Lookup, limits: Limits) -> bool:
    return bool(m.keys) and _rid_ok(m.kv_request_id, limits) and _keys_ok(m.keys, limits)


def _lookup_resp_ok(m: LookupResp, limits: Limits) -> bool:
    return len(m.hits) <= limits.max_keys_per_message


def _hello_ack_ok(m: HelloAck, limits: Limits) -> bool:
    return True


_WITHIN_CAPS: dict[type, Callable[[Any, Limits], bool]] = {
    HelloAck: _hello_ack_ok,
    Fetch: _fetch_ok,
    Ready: _ready_ok,
    Release: _release_ok,
    Lookup: _lookup_ok,
    LookupResp: _lookup_resp_ok,
}
"""The hot message types, each with the caps msgspec cannot check (they come from
``Limits``). The others (``hello``, ``round_failed``, ``bye``: a handful per session) have
defaults that depend on other fields or cross-field checks; the strict decoder takes them."""
_FAST_DECODE = msgspec.msgpack.Decoder(
    HelloAck | Fetch | Ready | Release | Lookup | LookupResp
).decode


# -- the strict decoder ---------------------------------------------------------------------


def _decode_strict(frame: bytes, limits: Limits) -> Message | Unknown:
    cap = limits.max_frame_bytes
    try:
        d = msgpack.unpackb(
            frame,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=cap,
            max_bin_len=cap,
            max_array_len=cap,  # bounded by the frame size; fields check their own caps
            max_map_len=64,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types for bad input
        raise ProtocolError(
            f"frame: not a valid msgpack message ({type(exc).__name__}: {exc})"
        ) from None
    if type(d) is not dict:
        raise ProtocolError(f"frame: expected a map, got {_tname(d)}")
    kind = d.get("type")
    if type(kind) is not str:
        raise ProtocolError(f"frame.type: expected a string, got {_tname(kind)}")
    decoder = _DECODERS.get(kind)
    if decoder is None:
        if len(kind) > MAX_TAG_CHARS:
            raise ProtocolError(f"frame.type: {len(kind)} characters exceeds {MAX_TAG_CHARS}")
        return Unknown(kind)
    return decoder(_Fields(kind, d), limits)
