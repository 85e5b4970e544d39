"""The transport's own protocol pieces: options, tags, wire codecs, run planning."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.errors import ConfigError
from p2pkv_ucx import tags, wire
from p2pkv_ucx.options import ERROR_HANDLING_ENV, UcxOptions
from p2pkv_ucx.runs import plan_runs

# -- options ---------------------------------------------------------------------------------


def test_defaults_are_the_safe_mode() -> None:
    opts = UcxOptions.from_mapping({}, environ={})
    assert opts.endpoint_error_handling is True
    assert opts.transfer_timeout > 0 and opts.drain_timeout > 0


@pytest.mark.parametrize("options, key", [
    ({"no_such_option": 1}, "no_such_option"),
    ({"endpoint_error_handling": "yes"}, "endpoint_error_handling"),
    ({"transfer_timeout": "1s"}, "transfer_timeout"),
    ({"transfer_timeout": -1}, "transfer_timeout"),
    ({"drain_timeout": True}, "drain_timeout"),
    ({"max_message_bytes": 0}, "max_message_bytes"),
    ({"coalesce": 1}, "coalesce"),
    ({"ucx_config": {"TLS": 3}}, "ucx_config"),
])
def test_bad_options_are_refused_naming_the_key(options: dict[str, object], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        UcxOptions.from_mapping(options, environ={})


def test_environment_sets_the_error_handling_default_and_options_win() -> None:
    assert UcxOptions.from_mapping({}, environ={ERROR_HANDLING_ENV: "0"}).endpoint_error_handling \
        is False
    explicit = UcxOptions.from_mapping({"endpoint_error_handling": True},
                                       environ={ERROR_HANDLING_ENV: "false"})
    assert explicit.endpoint_error_handling is True
    with pytest.raises(ConfigError, match=ERROR_HANDLING_ENV):
        UcxOptions.from_mapping({}, environ={ERROR_HANDLING_ENV: "maybe"})


def test_integer_seconds_are_accepted() -> None:
    assert UcxOptions.from_mapping({"transfer_timeout": 5}, environ={}).transfer_timeout == 5.0


# -- tags ------------------------------------------------------------------------------------


@given(st.integers(1, tags.MAX_LINK), st.integers(0, tags.SEQ_MASK),
       st.integers(0, tags.MAX_RUNS - 1))
def test_tags_keep_their_fields_apart(link: int, seq: int, run: int) -> None:
    data = tags.run_tag(link, seq, run)
    assert tags.split(data) == (tags.RUN, link, seq, run)
    assert tags.split(tags.header_tag(link, seq)) == (tags.HEADER, link, seq, 0)
    assert data < 1 << 64
    assert data & tags.WRITE_MASK == tags.run_tag(link, seq, 0)  # one write, any run
    assert data & tags.KIND_MASK == tags.kind_tag(tags.RUN)


@given(st.integers(1, tags.MAX_LINK), st.integers(1, 2**32 - 1),
       st.integers(0, tags.MAX_SLOTS - 1))
def test_slot_tags_name_link_round_and_slot(link: int, gen: int, slot: int) -> None:
    tag = tags.slot_tag(link, gen, slot)
    assert tag & tags.KIND_MASK == tags.kind_tag(tags.SLOT) and tag < 1 << 62
    assert tags.slot_tag(link, gen, 0) | slot == tag
    others = {tags.slot_tag(link + 1, gen, slot), tags.slot_tag(link, gen + 1, slot)}
    assert tag not in others


# -- wire ------------------------------------------------------------------------------------


def test_descriptor_round_trip() -> None:
    d = wire.Descriptor(b"\x01\x02address", 12345, 64, 4096, 8, False)
    assert wire.decode_descriptor(wire.encode_descriptor(d)) == d


@given(st.lists(st.integers(0, 2**32 - 1), max_size=300), st.integers(1, tags.MAX_LINK),
       st.integers(1, 2**32 - 1), st.integers(0, tags.MAX_RUNS))
def test_notices_round_trip(slots: list[int], link: int, gen: int, count: int) -> None:
    arr = np.array(slots, np.int64)
    e = wire.decode_notice(wire.encode_expect(7, link, gen, arr))
    assert isinstance(e, wire.Expect)
    assert (e.instance, e.link, e.gen, e.slots.tolist()) == (7, link, gen, slots)
    r = wire.decode_notice(wire.encode_retract(8, gen, arr))
    assert isinstance(r, wire.Retract) and (r.instance, r.gen, r.slots.tolist()) == (8, gen, slots)
    v = wire.decode_notice(wire.encode_verdict(9, link, count))
    assert v == wire.Verdict(9, link, count)


@given(st.lists(st.tuples(st.integers(0, 2**20), st.integers(1, 64), st.integers(1, 99)),
                max_size=100))
def test_header_round_trip(runs: list[tuple[int, int, int]]) -> None:
    arr = np.array(runs, np.int64).reshape(-1, 3)
    h = wire.decode_header(wire.encode_header(5, arr[:, 0], arr[:, 1], arr[:, 2]))
    assert h.instance == 5
    assert [h.starts.tolist(), h.lengths.tolist(), h.gens.tolist()] == arr.T.tolist()


@given(st.binary(max_size=200))
def test_hostile_bytes_only_raise_value_error(data: bytes) -> None:
    for decode in (wire.decode_descriptor, wire.decode_notice, wire.decode_header):
        try:
            decode(data)
        except ValueError:
            pass


@pytest.mark.parametrize("obj", [
    [1, 0, 7, 1, 1, b"\x00\x00\x00"],   # EXPECT: slots not whole uint32s
    [1, 0, 7, 0, 1, b""],               # EXPECT: link 0
    [2, 0, 7, 1, 1, b""],               # wire version
    [1, 0, 7, 1, True, b""],            # EXPECT: bool gen
    [1, 0, 0, 1, 1, b""],               # no sender instance
    [1, 1, 7, 1],                       # RETRACT without slots
    [1, 2, 7, 3, -1],                   # VERDICT: negative count
    [1, 9, 7, 3, 0],                    # unknown notice
    {"transport": "ucx"},               # not an array
])
def test_malformed_notice_is_refused(obj: object) -> None:
    import msgpack

    with pytest.raises(ValueError):
        wire.decode_notice(msgpack.packb(obj))


def test_header_arrays_must_agree() -> None:
    import msgpack

    four = np.arange(4, dtype="<u4").tobytes()
    with pytest.raises(ValueError, match="differ"):
        wire.decode_header(msgpack.packb([1, 5, four, four, four[:8]]))
    with pytest.raises(ValueError, match="instance"):
        wire.decode_header(msgpack.packb([1, 0, four, four, four]))


# -- runs ------------------------------------------------------------------------------------


@given(st.data(), st.integers(1, 9))
def test_runs_cover_the_write_exactly(data: st.DataObject, max_run: int) -> None:
    n = data.draw(st.integers(0, 60))
    src = np.array(data.draw(st.lists(st.integers(0, 80), min_size=n, max_size=n)), np.int64)
    dst = np.array(data.draw(st.permutations(range(80)))[:n], np.int64)
    gens = np.array(data.draw(st.lists(st.integers(1, 3), min_size=n, max_size=n)), np.int64)
    s, d, lengths, g = plan_runs(src, dst, gens, max_run)
    assert lengths.sum() == n and (lengths >= 1).all() and (lengths <= max_run).all()
    rebuilt = [
        (int(s[r] + k), int(d[r] + k), int(g[r])) for r in range(len(lengths))
        for k in range(int(lengths[r]))
    ]
    assert rebuilt == list(zip(src.tolist(), dst.tolist(), gens.tolist(), strict=True))


def test_runs_coalesce_only_what_is_contiguous_on_both_sides() -> None:
    src = np.array([0, 1, 2, 3, 10, 11, 12, 20], np.int64)
    dst = np.array([5, 6, 7, 9, 0, 1, 2, 3], np.int64)
    s, d, lengths, _ = plan_runs(src, dst, np.ones(8, np.int64), 64)
    assert list(zip(s.tolist(), d.tolist(), lengths.tolist(), strict=True)) == [
        (0, 5, 3), (3, 9, 1), (10, 0, 3), (20, 3, 1)
    ]
    _, _, one_by_one, _ = plan_runs(src, dst, np.ones(8, np.int64), 1)
    assert one_by_one.tolist() == [1] * 8
