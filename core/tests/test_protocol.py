"""The wire codec: round trips, every validation error, caps, compatibility rules."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.config import Limits
from p2pkv.errors import ProtocolError
from p2pkv.protocol import (
    MAX_TAG_CHARS,
    WIRE_MAJOR,
    WIRE_MINOR,
    Bye,
    Fetch,
    Message,
    Ready,
    Release,
    RoundFailed,
    Unknown,
    _decode_strict,
    decode,
    encode,
    message_type,
)
from p2pkv.testing.strategies import hostile_frames, messages
from p2pkv.types import Outcome

LIMITS = Limits()
SMALL = Limits(
    max_frame_bytes=4096,
    max_keys_per_message=4,
    max_key_bytes=8,
    max_request_id_chars=5,
    max_descriptor_bytes=16,
)


@given(messages())
def test_every_message_round_trips(msg: Message) -> None:
    assert decode(encode(msg), LIMITS) == msg


@given(st.binary(max_size=200))
def test_hostile_bytes_raise_only_protocol_errors(frame: bytes) -> None:
    try:
        decode(frame, LIMITS)
    except ProtocolError:
        pass


@given(
    st.dictionaries(
        st.sampled_from(
            [
                "type",
                "kv_request_id",
                "round",
                "keys",
                "slots",
                "pos",
                "read",
                "epoch",
                "seq",
                "hits",
                "reason",
                "wire",
            ]
        ),
        st.one_of(
            st.none(),
            st.integers(-3, 3),
            st.text(max_size=3),
            st.binary(max_size=3),
            st.booleans(),
            st.lists(st.integers(0, 3), max_size=3),
        ),
        max_size=8,
    )
)
def test_hostile_maps_raise_only_protocol_errors(d: dict[str, Any]) -> None:
    try:
        decode(msgpack.packb(d), LIMITS)
    except ProtocolError:
        pass


def _outcome(decoder: Any, frame: bytes, limits: Limits) -> Any:
    try:
        return decoder(frame, limits)
    except ProtocolError as exc:
        return str(exc)


@given(
    st.one_of(
        hostile_frames(SMALL),
        hostile_frames(),
        messages().map(encode),
        st.builds(
            lambda d: msgpack.packb(d, use_bin_type=True),
            st.dictionaries(
                st.sampled_from(
                    [
                        "type",
                        "kv_request_id",
                        "round",
                        "keys",
                        "pos",
                        "slots",
                        "read",
                        "seq",
                        "hits",
                        "epoch",
                    ]
                ),
                st.one_of(
                    st.sampled_from(
                        ["fetch", "ready", "release", "lookup", "lookup_resp", "hello_ack"]
                    ),
                    st.integers(-2, 2**32),
                    st.text(max_size=6),
                    st.lists(st.integers(-1, 2**32), max_size=5),
                    st.lists(st.binary(max_size=9), max_size=5),
                    st.booleans(),
                    st.lists(st.booleans()),
                ),
                max_size=6,
            ),
        ),
    )
)
def test_the_fast_decoder_agrees_with_the_strict_one(frame: bytes) -> None:
    """Whichever decoder takes a frame, it decodes to the same message or fails alike."""
    for limits in (LIMITS, SMALL):
        if len(frame) <= limits.max_frame_bytes:  # larger ones: refused before either
            assert _outcome(decode, frame, limits) == _outcome(_decode_strict, frame, limits)


def test_unknown_fields_and_big_maps_take_the_strict_path() -> None:
    """The fast path refuses what it cannot vouch for; the strict one decides as before."""
    body = {**_valid("fetch"), "future": msgpack.ExtType(1, b"x")}
    with pytest.raises(ProtocolError, match="not a valid msgpack"):
        decode(_frame("fetch", **body), LIMITS)
    padded = {**_valid("release"), **{f"x{i}": i for i in range(70)}}
    with pytest.raises(ProtocolError, match="not a valid msgpack"):  # over 64 map entries
        decode(_frame("release", **padded), LIMITS)
    assert decode(_frame("release", **_valid("release"), later=1), LIMITS) == Release("r", 0, True)


def test_frames_are_the_msgpack_map_of_the_fields() -> None:
    msg = Ready("r", 3, [0, 1], [7, 2**31])
    assert encode(msg) == msgpack.packb(
        {"type": "ready", "kv_request_id": "r", "round": 3, "pos": [0, 1], "slots": [7, 2**31]},
        use_bin_type=True,
    )


def test_keys_stay_bytes_and_slots_stay_ints() -> None:
    msg = decode(encode(Fetch("r", 0, [b"\x00\xffk"])), LIMITS)
    assert isinstance(msg, Fetch) and type(msg.keys[0]) is bytes
    ready = decode(encode(Ready("r", 0, [0], [7])), LIMITS)
    assert isinstance(ready, Ready) and type(ready.slots[0]) is int


def test_message_type_names() -> None:
    assert message_type(Fetch("r", 0, [])) == "fetch"
    assert message_type(Release("r", 1, True)) == "release"
    assert message_type(Unknown("future")) == "future"


def _frame(kind: str, **fields: Any) -> bytes:
    frame: bytes = msgpack.packb({"type": kind, **fields}, use_bin_type=True)
    return frame


def _valid(kind: str) -> dict[str, Any]:
    valid: dict[str, dict[str, Any]] = {
        "hello": {
            "wire": [WIRE_MAJOR, WIRE_MINOR],
            "epoch": 1,
            "address": "h:1",
            "descriptor": b"d",
            "num_blocks": 4,
            "block_len": 8,
            "fingerprint": "",
            "hash_seed": "",
        },
        "hello_ack": {"epoch": 1},
        "fetch": {"kv_request_id": "r", "round": 0, "keys": [b"k"]},
        "ready": {"kv_request_id": "r", "round": 0, "pos": [0], "slots": [3]},
        "release": {"kv_request_id": "r", "round": 0, "read": True},
        "round_failed": {"kv_request_id": "r", "round": 0, "reason": "demand_unmet: x"},
        "lookup": {"seq": 0, "kv_request_id": "r", "keys": [b"k"]},
        "lookup_resp": {"seq": 0, "hits": [True]},
        "bye": {"reason": "x"},
    }
    return valid[kind]


@pytest.mark.parametrize(
    "kind",
    [
        "hello",
        "hello_ack",
        "fetch",
        "ready",
        "release",
        "round_failed",
        "lookup",
        "lookup_resp",
        "bye",
    ],
)
def test_valid_templates_decode_and_unknown_fields_are_ignored(kind: str) -> None:
    decoded = decode(_frame(kind, **_valid(kind), future_field=[1, 2]), LIMITS)
    assert message_type(decoded) == kind


# (message, field, bad value or "<missing>", expected message fragment)
BAD: list[tuple[str, str, Any, str]] = [
    ("hello", "wire", "<missing>", "hello.wire: missing"),
    ("hello", "wire", [1], "hello.wire: expected [major, minor]"),
    ("hello", "wire", [1, -1], "hello.wire: expected [major, minor]"),
    ("hello", "wire", [1, 2, 3], "hello.wire: 3 entries exceeds"),
    ("hello", "epoch", -1, "hello.epoch: -1 is outside"),
    ("hello", "epoch", True, "hello.epoch: expected an integer, got bool"),
    ("hello", "address", "", "hello.address: must not be empty"),
    ("hello", "address", 5, "hello.address: expected a string"),
    ("hello", "descriptor", "text", "hello.descriptor: expected bytes, got str"),
    ("hello", "num_blocks", 0, "hello.num_blocks: 0 is outside 1.."),
    ("hello", "block_len", 0, "hello.block_len: 0 is outside 1.."),
    ("hello", "block_len", 1.5, "hello.block_len: expected an integer, got float"),
    ("hello", "fingerprint", 7, "hello.fingerprint: expected a string"),
    ("hello", "hash_seed", b"x", "hello.hash_seed: expected a string, got bytes"),
    ("hello_ack", "epoch", "1", "hello_ack.epoch: expected an integer"),
    ("fetch", "kv_request_id", "", "fetch.kv_request_id: must not be empty"),
    ("fetch", "kv_request_id", b"r", "fetch.kv_request_id: expected a string, got bytes"),
    ("fetch", "kv_request_id", "<missing>", "fetch.kv_request_id: missing"),
    ("fetch", "round", -1, "fetch.round: -1 is outside"),
    ("fetch", "keys", "k", "fetch.keys: expected a list"),
    ("fetch", "keys", ["k"], "fetch.keys[0]: expected bytes, got str"),
    ("fetch", "keys", [b""], "fetch.keys[0]: key of 0 bytes"),
    ("ready", "pos", [], "ready.pos: must not be empty"),
    ("ready", "pos", [-1], "ready.pos[0]: expected an integer in 0.."),
    ("ready", "pos", [True], "ready.pos[0]: expected an integer in 0.."),
    ("ready", "slots", [0, 1], "ready.slots: 2 slots for 1 positions"),
    ("ready", "slots", [2**32], "ready.slots[0]: expected an integer in 0.."),
    ("ready", "round", "0", "ready.round: expected an integer"),
    ("release", "read", 1, "release.read: expected a boolean, got int"),
    ("release", "kv_request_id", 0, "release.kv_request_id: expected a string"),
    ("lookup", "seq", None, "lookup.seq: expected an integer, got NoneType"),
    ("lookup", "keys", [], "lookup.keys: must not be empty"),
    ("lookup_resp", "hits", [1], "lookup_resp.hits[0]: expected a boolean, got int"),
    ("lookup_resp", "hits", "yes", "lookup_resp.hits: expected a list"),
    ("round_failed", "reason", 3, "round_failed.reason: expected a string"),
    ("round_failed", "reason", "", "round_failed.reason: must not be empty"),
    ("round_failed", "reason", "x" * 1025, "round_failed.reason: 1025 characters exceeds"),
    ("round_failed", "outcome", 7, "round_failed.outcome: expected a string"),
    ("round_failed", "outcome", "x" * 257, "round_failed.outcome: 257 characters exceeds"),
    ("bye", "reason", "<missing>", "bye.reason: missing"),
    ("bye", "outcome", b"peer_dead", "bye.outcome: expected a string, got bytes"),
]


@pytest.mark.parametrize(
    "kind, field, value, expected", BAD, ids=[f"{k}.{f}={v!r:.20}" for k, f, v, _ in BAD]
)
def test_every_validation_error_names_the_field(
    kind: str, field: str, value: Any, expected: str
) -> None:
    body = _valid(kind)
    if value == "<missing>":
        del body[field]
    else:
        body[field] = value
    with pytest.raises(ProtocolError) as info:
        decode(_frame(kind, **body), LIMITS)
    assert expected in str(info.value)


@pytest.mark.parametrize(
    "kind, field, value, expected",
    [
        (
            "fetch",
            "keys",
            [b"a", b"b", b"c", b"d", b"e"],
            "fetch.keys: 5 entries exceeds the cap of 4",
        ),
        ("fetch", "keys", [b"123456789"], "fetch.keys[0]: key of 9 bytes is outside 1..8"),
        ("fetch", "kv_request_id", "abcdef", "fetch.kv_request_id: 6 characters exceeds"),
        ("hello", "descriptor", b"x" * 17, "hello.descriptor: 17 bytes exceeds the cap of 16"),
        ("lookup_resp", "hits", [True] * 5, "lookup_resp.hits: 5 entries exceeds"),
        ("ready", "pos", [0] * 5, "ready.pos: 5 entries exceeds"),
    ],
)
def test_caps_from_limits(kind: str, field: str, value: Any, expected: str) -> None:
    body = _valid(kind)
    body[field] = value
    with pytest.raises(ProtocolError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        decode(_frame(kind, **body), SMALL)


def test_frame_level_errors() -> None:
    with pytest.raises(ProtocolError, match="frame: 5000 bytes exceeds max_frame_bytes=4096"):
        decode(b"\x00" * 5000, SMALL)
    with pytest.raises(ProtocolError, match="frame: not a valid msgpack message"):
        decode(b"\xc1", LIMITS)
    with pytest.raises(ProtocolError, match="frame: expected a map, got list"):
        decode(msgpack.packb([1, 2]), LIMITS)
    with pytest.raises(ProtocolError, match=r"frame\.type: expected a string, got NoneType"):
        decode(msgpack.packb({"round": 1}), LIMITS)
    with pytest.raises(ProtocolError, match="not a valid msgpack"):
        decode(msgpack.packb({1: 2}), LIMITS)  # map keys must be strings
    with pytest.raises(ProtocolError, match="not a valid msgpack"):
        decode(msgpack.packb(msgpack.ExtType(1, b"x")), LIMITS)  # no ext types


def test_wire_2_dropped_the_push_messages() -> None:
    """Wire 2.0: the consumer reads; the push-era messages are unknown types now."""
    assert (WIRE_MAJOR, WIRE_MINOR) == (2, 1)
    for old in ("abort", "abort_ack", "quiesced", "transfer_done"):
        assert decode(_frame(old, kv_request_id="r", round=0), LIMITS) == Unknown(old)


def test_unknown_types_decode_to_unknown() -> None:
    assert decode(_frame("gossip", x=1), LIMITS) == Unknown("gossip")


def test_never_unpickles() -> None:
    import pickle

    with pytest.raises(ProtocolError):
        decode(pickle.dumps({"type": "bye", "reason": "x"}), LIMITS)


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError, match="not a protocol message"):
        encode(replace)  # type: ignore[arg-type]


_OUTCOMES = st.sampled_from([o.value for o in Outcome]) | st.text(max_size=MAX_TAG_CHARS)


@given(
    st.builds(
        RoundFailed,
        kv_request_id=st.text(min_size=1, max_size=8),
        round=st.integers(0, 2**64 - 1),
        reason=st.text(min_size=1, max_size=40),
        outcome=_OUTCOMES,
    )
    | st.builds(Bye, reason=st.text(max_size=40), outcome=_OUTCOMES)
)
def test_wire_2_1_outcome_fields_round_trip(msg: Message) -> None:
    assert decode(encode(msg), LIMITS) == msg


@pytest.mark.parametrize(
    "reason, outcome",
    [
        ("demand_unmet: 1 block missing", "demand_unmet"),
        ("load_timeout", "load_timeout"),
        ("something new", "something new"),
    ],
)
def test_a_wire_2_0_round_failed_takes_its_outcome_from_the_reason(
    reason: str, outcome: str
) -> None:
    frame = _frame("round_failed", kv_request_id="r", round=0, reason=reason)
    assert decode(frame, LIMITS) == RoundFailed("r", 0, reason, outcome)


@pytest.mark.parametrize(
    "reason, outcome",
    [
        ("rejected: block_len 32", Outcome.PEER_REJECTED),
        ("protocol error: ready.slots", Outcome.PROTOCOL_ERROR),
        ("shutdown", Outcome.PEER_DEAD),
        ("", Outcome.PEER_DEAD),
    ],
)
def test_a_wire_2_0_bye_takes_its_outcome_from_the_reason(reason: str, outcome: Outcome) -> None:
    assert decode(_frame("bye", reason=reason), LIMITS) == Bye(reason, outcome.value)


def test_the_outcome_field_wins_over_the_reason() -> None:
    frame = _frame(
        "round_failed",
        kv_request_id="r",
        round=0,
        reason="demand_unmet: x",
        outcome="request_conflict",
    )
    assert decode(frame, LIMITS) == RoundFailed("r", 0, "demand_unmet: x", "request_conflict")
    assert decode(_frame("bye", reason="rejected: x", outcome="peer_dead"), LIMITS) == Bye(
        "rejected: x", "peer_dead"
    )
