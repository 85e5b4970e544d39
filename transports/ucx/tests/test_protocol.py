"""The transport's own protocol pieces: options, tags, wire codecs, run planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.errors import ConfigError
from p2pkv.runs import SLICE_BYTES, SLICE_BYTES_ENV
from p2pkv_ucx import tags, wire
from p2pkv_ucx.options import ERROR_HANDLING_ENV, UcxOptions

# -- options ---------------------------------------------------------------------------------


def test_defaults_are_the_safe_mode() -> None:
    opts = UcxOptions.from_mapping({}, environ={})
    assert opts.endpoint_error_handling is True
    assert opts.transfer_timeout > 0 and opts.drain_timeout > 0


@pytest.mark.parametrize(
    "options, key",
    [
        ({"no_such_option": 1}, "no_such_option"),
        ({"endpoint_error_handling": "yes"}, "endpoint_error_handling"),
        ({"transfer_timeout": "1s"}, "transfer_timeout"),
        ({"transfer_timeout": -1}, "transfer_timeout"),
        ({"drain_timeout": True}, "drain_timeout"),
        ({"max_message_bytes": 0}, "max_message_bytes"),
        ({"staging_bytes": 0}, "staging_bytes"),
        ({"staging_bytes": 1.5}, "staging_bytes"),
        ({"coalesce": 1}, "coalesce"),
        ({"ucx_config": {"TLS": 3}}, "ucx_config"),
    ],
)
def test_bad_options_are_refused_naming_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        UcxOptions.from_mapping(options, environ={})


def test_environment_sets_the_error_handling_default_and_options_win() -> None:
    assert (
        UcxOptions.from_mapping({}, environ={ERROR_HANDLING_ENV: "0"}).endpoint_error_handling
        is False
    )
    explicit = UcxOptions.from_mapping(
        {"endpoint_error_handling": True}, environ={ERROR_HANDLING_ENV: "false"}
    )
    assert explicit.endpoint_error_handling is True
    with pytest.raises(ConfigError, match=ERROR_HANDLING_ENV):
        UcxOptions.from_mapping({}, environ={ERROR_HANDLING_ENV: "maybe"})


def test_environment_sets_the_slice_size_default_and_options_win() -> None:
    assert UcxOptions.from_mapping({}, environ={}).slice_bytes == SLICE_BYTES
    assert UcxOptions.from_mapping({}, environ={SLICE_BYTES_ENV: "65536"}).slice_bytes == 65536
    explicit = UcxOptions.from_mapping({"slice_bytes": 4096}, environ={SLICE_BYTES_ENV: "65536"})
    assert explicit.slice_bytes == 4096
    for bad in ("0", "-1", "1.5", "big"):
        with pytest.raises(ConfigError, match=SLICE_BYTES_ENV):
            UcxOptions.from_mapping({}, environ={SLICE_BYTES_ENV: bad})


def test_integer_seconds_are_accepted() -> None:
    assert UcxOptions.from_mapping({"transfer_timeout": 5}, environ={}).transfer_timeout == 5.0


# -- tags ------------------------------------------------------------------------------------


@given(
    st.integers(1, tags.MAX_LINK),
    st.integers(0, tags.RID_LIMIT - 1),
    st.integers(0, tags.MAX_RUNS - 1),
)
def test_tags_keep_their_fields_apart(link: int, rid: int, run: int) -> None:
    tag = tags.data_tag(link, rid, run)
    assert tags.split(tag) == (tags.DATA, link, rid, run)
    assert tag < 1 << 62 and tag & tags.KIND_MASK == tags.kind_tag(tags.DATA)
    assert tags.run_of(tag) == run
    assert tags.read_key(tag) == tags.read_key(tags.data_tag(link, rid, 0))  # one read, any run
    others = {
        tags.data_tag(link + 1, rid, run),
        tags.data_tag(link, (rid + 1) % tags.RID_LIMIT, run),
    }
    assert tags.read_key(tag) not in {tags.read_key(t) for t in others}
    assert tags.split(tags.kind_tag(tags.NOTICE))[0] == tags.NOTICE


# -- wire ------------------------------------------------------------------------------------


def test_descriptor_round_trip() -> None:
    d = wire.Descriptor(b"\x01\x02address", 12345, 64, 4096, 8, False)
    assert wire.decode_descriptor(wire.encode_descriptor(d)) == d


def test_descriptor_of_another_wire_version_is_refused() -> None:
    import msgpack

    d = wire.Descriptor(b"a", 1, 64, 4096, 8, False)
    obj = msgpack.unpackb(wire.encode_descriptor(d))
    obj["v"] = 1
    with pytest.raises(ValueError, match="version 1"):
        wire.decode_descriptor(msgpack.packb(obj))


@given(
    st.lists(st.tuples(st.integers(0, 2**32 - 1), st.integers(1, 2**32 - 1)), max_size=300),
    st.integers(1, tags.MAX_LINK),
    st.integers(0, 2**32 - 1),
    st.text(max_size=80),
)
def test_notices_round_trip(runs: list[tuple[int, int]], link: int, rid: int, reason: str) -> None:
    arr = np.array(runs, np.int64).reshape(-1, 2)
    r = wire.decode_notice(wire.encode_read(7, link, rid, arr[:, 0], arr[:, 1]))
    assert isinstance(r, wire.Read) and (r.instance, r.link, r.rid) == (7, link, rid)
    assert [r.starts.tolist(), r.lengths.tolist()] == arr.T.tolist()
    c = wire.decode_notice(wire.encode_cancel(8, link, arr[:, 0]))
    assert isinstance(c, wire.Cancel) and (c.instance, c.link, c.rids.tolist()) == (
        8,
        link,
        arr[:, 0].tolist(),
    )
    f = wire.decode_notice(wire.encode_refuse(9, link, rid, reason))
    assert f == wire.Refuse(9, link, rid, wire.short_reason(reason))
    assert len(f.reason.encode()) <= wire.MAX_REASON


@given(st.binary(max_size=200))
def test_hostile_bytes_only_raise_value_error(data: bytes) -> None:
    for decode in (wire.decode_descriptor, wire.decode_notice):
        try:
            decode(data)
        except ValueError:
            pass


@pytest.mark.parametrize(
    "obj",
    [
        [2, 0, 7, 1, 0, b"\x00\x00\x00", b""],  # READ: starts not whole uint32s
        [2, 0, 7, 1, 0, b"\x00" * 4, b""],  # READ: arrays differ in length
        [2, 0, 7, 0, 0, b"", b""],  # READ: link 0
        [1, 0, 7, 1, 0, b"", b""],  # wire version 1
        [2, 0, 7, 1, True, b"", b""],  # READ: bool rid
        [2, 0, 0, 1, 0, b"", b""],  # no sender instance
        [2, 1, 7, 1],  # CANCEL without rids
        [2, 2, 7, 1, -1, "x"],  # REFUSE: negative rid
        [2, 2, 7, 1, 0, b"x"],  # REFUSE: reason not text
        [2, 9, 7, 1, 0],  # unknown notice
        {"transport": "ucx"},  # not an array
    ],
)
def test_malformed_notice_is_refused(obj: object) -> None:
    import msgpack

    with pytest.raises(ValueError):
        wire.decode_notice(msgpack.packb(obj))
