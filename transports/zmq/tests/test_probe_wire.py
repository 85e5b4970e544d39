"""The probe exchange's codec (docs/protocol.md §11): every valid identity round-trips, and
any bytes decode to an identity or fail with ``ProbeWireError``, never anything else; any
message on a tier's PULL is a probe (with the prober's address), a malformed probe (why), or
no probe at all."""

from __future__ import annotations

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv_zmq.identity import link_id, new_incarnation
from p2pkv_zmq.probe_wire import (
    MAX_IDENTITY_BYTES,
    PROBE,
    Identity,
    ProbeWireError,
    decode_identity,
    encode_identity,
    identity_answer,
    probe_request,
)

pytestmark = pytest.mark.hypothesis

identities = st.builds(
    Identity,
    nonce=st.binary(min_size=8, max_size=64),
    version=st.from_regex(r"\A[0-9A-Za-z.+!_-]{1,64}\Z"),
    wire=st.tuples(st.integers(0, 65535), st.integers(0, 65535)),
    control=st.text(min_size=1, max_size=64),
    security=st.sampled_from(["curve", "none"]),
)


@given(identities)
def test_every_identity_round_trips(identity: Identity) -> None:
    assert decode_identity(encode_identity(identity)) == identity


@given(st.binary(max_size=MAX_IDENTITY_BYTES + 16))
def test_any_bytes_decode_or_fail_cleanly(payload: bytes) -> None:
    try:
        decode_identity(payload)
    except ProbeWireError:
        pass


_EXTRA = st.none() | st.integers(-(2**63), 2**63 - 1) | st.binary(max_size=8) | st.text(max_size=8)


@given(identities, st.dictionaries(st.text(max_size=8), _EXTRA, max_size=4))
def test_unknown_fields_are_ignored_and_known_ones_checked(
    identity: Identity, extra: dict[str, object]
) -> None:
    raw = msgpack.unpackb(encode_identity(identity), raw=False)
    payload = msgpack.packb({**extra, **raw}, use_bin_type=True)
    assert decode_identity(payload) == identity
    for name, bad in (
        ("nonce", b"short"),
        ("wire", [2]),
        ("security", "plain"),
        ("p2pkv", "a b"),
        ("control", ""),
        ("wire", [True, 1]),
    ):
        with pytest.raises(ProbeWireError, match=f"^identity.{name}: "):
            decode_identity(msgpack.packb({**raw, name: bad}, use_bin_type=True))


@pytest.mark.parametrize(
    "payload, message",
    [
        (b"\xc1", "identity: not one msgpack map (FormatError)"),
        (msgpack.packb([1, 2]), "identity: expected a map, got list"),
        (
            msgpack.packb({"nonce": msgpack.ExtType(1, b"x")}),
            "identity: not one msgpack map (ProbeWireError)",
        ),
        (
            b"\x80" * (MAX_IDENTITY_BYTES + 1),
            f"identity: {MAX_IDENTITY_BYTES + 1} bytes, more than {MAX_IDENTITY_BYTES}",
        ),
    ],
)
def test_what_is_refused(payload: bytes, message: str) -> None:
    with pytest.raises(ProbeWireError) as refused:
        decode_identity(payload)
    assert str(refused.value) == message


def test_a_tiers_answer_names_its_version_and_security() -> None:
    answer = decode_identity(identity_answer(b"n" * 16, curve=True))
    assert (answer.nonce, answer.control, answer.security) == (b"n" * 16, "zmq", "curve")


_PART = st.binary(max_size=24) | st.sampled_from([b"", PROBE, b"open", b"gone"])


@given(st.lists(_PART, max_size=5))
def test_any_message_is_a_probe_a_malformed_probe_or_none(parts: list[bytes]) -> None:
    found = probe_request(parts)
    is_probe = len(parts) == 4 and parts[1] == b"" and parts[2] == PROBE
    assert (found is not None) == is_probe
    assert found is None or isinstance(found, str) or found == (PROBE, found[1])


@given(st.binary(min_size=8, max_size=64), st.integers(1, 65535))
def test_a_well_formed_probe_names_the_probers_address(nonce: bytes, port: int) -> None:
    address = f"10.1.2.3:{port}"
    link = link_id(address, new_incarnation())
    assert probe_request([link, b"", PROBE, nonce]) == (PROBE, address)


@pytest.mark.parametrize(
    "link, nonce, why",
    [
        (b"10.1.2.3:80", b"n" * 16, "malformed link id in a probe (not a p2pkv probe?)"),
        (None, b"n" * 7, "a probe whose nonce is not 8..64 bytes"),
        (None, b"n" * 65, "a probe whose nonce is not 8..64 bytes"),
    ],
)
def test_a_malformed_probe_says_why(link: bytes | None, nonce: bytes, why: str) -> None:
    link = link or link_id("10.1.2.3:80", new_incarnation())
    assert probe_request([link, b"", PROBE, nonce]) == why
