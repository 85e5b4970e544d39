"""The kit's hypothesis strategies: valid messages round-trip, hostile frames never crash the
decoder with anything but ``ProtocolError``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.config import Limits
from p2pkv.errors import ProtocolError
from p2pkv.protocol import Message, Unknown, decode, encode
from p2pkv.testing import strategies as p2st

SMALL = Limits(
    max_frame_bytes=1 << 16,
    max_keys_per_message=8,
    max_key_bytes=16,
    max_request_id_chars=24,
    max_descriptor_bytes=128,
)


@pytest.mark.parametrize("limits", [Limits(), SMALL], ids=["default", "small"])
@given(data=st.data())
def test_valid_messages_round_trip(limits: Limits, data: st.DataObject) -> None:
    msg = data.draw(p2st.messages(limits))
    assert decode(encode(msg), limits) == msg


@given(frame=p2st.frames(SMALL))
def test_frames_decode(frame: bytes) -> None:
    assert not isinstance(decode(frame, SMALL), Unknown)


@given(frame=p2st.hostile_frames(SMALL))
def test_hostile_frames_get_a_message_or_a_protocol_error(frame: bytes) -> None:
    try:
        result = decode(frame, SMALL)
    except ProtocolError as exc:
        assert str(exc)
    else:
        assert isinstance(result, (Unknown, *Message.__args__))


@given(frame=p2st.binary_frames(512))
def test_binary_frames_are_non_empty_and_bounded(frame: bytes) -> None:
    assert 0 < len(frame) <= 512
