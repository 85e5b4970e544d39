"""Hypothesis strategies for p2pkv frames and protocol messages, valid and hostile.

For authors who fuzz their own code (a transport's framing, a proxy, a codec wrapper)::

    from hypothesis import given
    from p2pkv.protocol import decode, encode
    from p2pkv.testing import strategies as p2st


    @given(p2st.messages())
    def test_round_trip(msg):
        assert decode(encode(msg), LIMITS) == msg


    @given(p2st.hostile_frames())
    def test_never_crashes(frame):
        try:
            decode(frame, LIMITS)
        except ProtocolError:
            pass

Valid strategies (``messages`` and the per-type ones, ``frames``) produce only what
``p2pkv.protocol.decode`` accepts under the given :class:`~p2pkv.config.Limits`. Hostile ones
(``hostile_frames``) produce what a broken or malicious peer could send: random bytes, valid
frames cut short, fields of the wrong type, missing or out of range, lists and strings over the
caps, non-map frames, non-string keys, extension types, deep nesting. A hostile frame may
happen to be valid; a decoder must answer each with a message or ``ProtocolError``, never
anything else. Sizes stay small (tens of entries) so examples are cheap; pass a small
``Limits`` to reach the caps.
"""

from __future__ import annotations

from typing import Any

import msgpack
from hypothesis import strategies as st
from msgspec.structs import fields

from p2pkv.config import Limits
from p2pkv.protocol import (
    MAX_ADDRESS_CHARS,
    MAX_REASON_CHARS,
    MAX_TAG_CHARS,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Ready,
    Release,
    RoundFailed,
    encode,
)

__all__ = [
    "binary_frames",
    "byes",
    "fetches",
    "frames",
    "hello_acks",
    "hellos",
    "hostile_frames",
    "lookup_resps",
    "lookups",
    "messages",
    "readies",
    "releases",
    "round_faileds",
]

DEFAULT_LIMITS = Limits()
_U64 = (1 << 64) - 1
_SMALL = 16
"""Longest list a valid strategy draws (keeps examples cheap)."""


def _text(max_chars: int, min_chars: int = 0) -> st.SearchStrategy[str]:
    return st.text(
        alphabet=st.characters(codec="utf-8"), min_size=min_chars, max_size=min(max_chars, 40)
    )


def _u64() -> st.SearchStrategy[int]:
    return st.one_of(st.integers(0, 1000), st.integers(0, _U64))


def _keys(limits: Limits, min_size: int = 0) -> st.SearchStrategy[list[bytes]]:
    key = st.binary(min_size=1, max_size=min(limits.max_key_bytes, 48))
    return st.lists(key, min_size=min_size, max_size=min(limits.max_keys_per_message, _SMALL))


def _request_id(limits: Limits) -> st.SearchStrategy[str]:
    return _text(limits.max_request_id_chars, min_chars=1)


def hellos(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[Hello]:
    return st.builds(
        Hello,
        wire=st.tuples(st.integers(0, 1 << 16), st.integers(0, 1 << 16)),
        epoch=_u64(),
        address=_text(MAX_ADDRESS_CHARS, min_chars=1),
        descriptor=st.binary(max_size=min(limits.max_descriptor_bytes, 256)),
        num_blocks=st.integers(1, _U64),
        block_len=st.integers(1, _U64),
        fingerprint=_text(MAX_TAG_CHARS),
        hash_seed=_text(MAX_TAG_CHARS),
    )


def hello_acks() -> st.SearchStrategy[HelloAck]:
    return st.builds(HelloAck, epoch=_u64())


@st.composite
def fetches(draw: st.DrawFn, limits: Limits = DEFAULT_LIMITS) -> Fetch:
    """Fetches, the terminal (empty) one included."""
    return Fetch(draw(_request_id(limits)), draw(_u64()), draw(_keys(limits)))


@st.composite
def readies(draw: st.DrawFn, limits: Limits = DEFAULT_LIMITS) -> Ready:
    n = draw(st.integers(1, min(limits.max_keys_per_message, _SMALL)))
    ints = st.lists(st.integers(0, (1 << 32) - 1), min_size=n, max_size=n)
    return Ready(draw(_request_id(limits)), draw(_u64()), draw(ints), draw(ints))


def lookups(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[Lookup]:
    return st.builds(
        Lookup, seq=_u64(), kv_request_id=_request_id(limits), keys=_keys(limits, min_size=1)
    )


def lookup_resps(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[LookupResp]:
    hits = st.lists(st.booleans(), max_size=min(limits.max_keys_per_message, _SMALL))
    return st.builds(LookupResp, seq=_u64(), hits=hits)


def releases(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[Release]:
    return st.builds(Release, kv_request_id=_request_id(limits), round=_u64(), read=st.booleans())


def round_faileds(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[RoundFailed]:
    return st.builds(
        RoundFailed,
        kv_request_id=_request_id(limits),
        round=_u64(),
        reason=_text(MAX_REASON_CHARS, min_chars=1),
    )


def byes() -> st.SearchStrategy[Bye]:
    return st.builds(Bye, reason=_text(MAX_REASON_CHARS))


def messages(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[Message]:
    """Every message type, each valid under ``limits``."""
    return st.one_of(
        hellos(limits),
        hello_acks(),
        fetches(limits),
        readies(limits),
        releases(limits),
        round_faileds(limits),
        lookups(limits),
        lookup_resps(limits),
        byes(),
    )


def frames(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[bytes]:
    """Encoded valid messages."""
    return messages(limits).map(encode)


def binary_frames(max_bytes: int = 4096) -> st.SearchStrategy[bytes]:
    """Opaque frames for control transports (which carry bytes, never parse them)."""
    return st.one_of(
        st.binary(min_size=1, max_size=min(max_bytes, 64)),
        st.binary(min_size=1, max_size=max_bytes),
    )


# -- hostile --------------------------------------------------------------------------------

_PACKABLE_INTS = st.integers(-(1 << 63), _U64)
_WRONG_VALUES = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(1 << 63), -1),
    st.just(_U64),
    st.floats(),
    st.text(max_size=8),
    st.binary(max_size=8),
    st.lists(_PACKABLE_INTS, max_size=3),
    st.dictionaries(st.text(max_size=4), _PACKABLE_INTS, max_size=2),
)


def _pack(obj: Any) -> bytes:
    out: bytes = msgpack.packb(obj, use_bin_type=True)
    return out


@st.composite
def _mutated(draw: st.DrawFn, limits: Limits) -> bytes:
    """A valid message's map with one field dropped, mistyped, oversized or out of range."""
    msg = draw(messages(limits))
    body: dict[str, Any] = msgpack.unpackb(encode(msg), raw=False)
    names = [f.name for f in fields(msg)] or ["type"]
    name = draw(st.sampled_from([*names, "type"]))
    how = draw(st.sampled_from(["drop", "wrong", "huge", "negative", "oversize"]))
    if how == "drop":
        body.pop(name, None)
    elif how == "wrong":
        body[name] = draw(_WRONG_VALUES)
    elif how == "huge":
        body[name] = _U64
    elif how == "negative":
        body[name] = -1
    else:
        over = limits.max_keys_per_message + 1
        if isinstance(body.get(name), list):
            item = body[name][0] if body[name] else 0
            body[name] = [item] * over
        elif isinstance(body.get(name), str):
            body[name] = "x" * (max(limits.max_request_id_chars, MAX_REASON_CHARS) + 1)
        elif isinstance(body.get(name), bytes):
            body[name] = b"\x01" * (max(limits.max_key_bytes, 1) + 1)
        else:
            body[name] = [0] * over
    return _pack(body)


@st.composite
def _truncated(draw: st.DrawFn, limits: Limits) -> bytes:
    frame = draw(frames(limits))
    return frame[: draw(st.integers(0, max(0, len(frame) - 1)))]


def _deep(depth: int) -> bytes:
    return b"\x91" * depth + b"\x00"  # fixarray(1) nested ``depth`` times


def hostile_frames(limits: Limits = DEFAULT_LIMITS) -> st.SearchStrategy[bytes]:
    """What a broken or malicious peer could send (see the module docstring)."""
    return st.one_of(
        st.binary(max_size=64),
        _truncated(limits),
        _mutated(limits),
        st.builds(_pack, _WRONG_VALUES),  # not a map at all
        st.builds(lambda k: _pack({k: 1, "type": "bye"}), _PACKABLE_INTS),  # non-string key
        st.just(msgpack.packb({"type": "bye", "reason": msgpack.ExtType(1, b"x")})),
        st.builds(_deep, st.integers(1, 100_000)),
        st.builds(lambda t: _pack({"type": t}), _text(MAX_TAG_CHARS * 2)),  # unknown types
    )
