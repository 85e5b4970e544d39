"""The memory data transport against the DataTransport contract (reads, final cancel)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.contracts import DataSettings
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError
from p2pkv.reference import MemoryDataTransport

BLOCK = 16


def region(num_blocks: int, block_len: int = BLOCK, fill: int | None = None) -> np.ndarray:
    if fill is None:
        return np.arange(num_blocks * block_len, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    return np.full(num_blocks * block_len, fill, dtype=np.uint8)


MakeData = Callable[..., MemoryDataTransport]
"""The ``make`` fixture: ``make(buf, block_len, **options)``, closed after the test."""


@pytest.fixture
def make() -> Iterator[MakeData]:
    made: list[MemoryDataTransport] = []

    def make(buf: np.ndarray, block_len: int = BLOCK, **options: Any) -> MemoryDataTransport:
        t = MemoryDataTransport.create(DataSettings(buf.data, block_len, options))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def pair(
    make: MakeData, **options: Any
) -> tuple[MemoryDataTransport, MemoryDataTransport, np.ndarray, np.ndarray]:
    """(consumer, producer, consumer's buffer (12 zero blocks), producer's buffer (8 blocks))."""
    src_buf, dst_buf = region(8), region(12, fill=0)
    src, dst = make(src_buf), make(dst_buf, **options)
    dst.add_peer("src", src.descriptor())
    return dst, src, dst_buf, src_buf


def blocks(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1, BLOCK)


def test_shape_and_capabilities(make: MakeData) -> None:
    t = make(region(8))
    assert (t.num_blocks, t.block_len) == (8, BLOCK)
    caps = t.capabilities
    assert not caps.cross_process and not caps.cross_host and not caps.two_sided
    assert t.kind == "data" and t.name == "memory"


def test_reads_land_byte_exactly_at_scattered_local_indexes(make: MakeData) -> None:
    dst, _src, dst_buf, src_buf = pair(make)
    before = src_buf.copy()
    tid = dst.read_blocks("src", [11, 3, 7], [0, 5, 2])
    assert dst.poll("src") == ([tid], [])
    expected = np.zeros((12, BLOCK), dtype=np.uint8)
    expected[[11, 3, 7]] = blocks(src_buf)[[0, 5, 2]]
    assert np.array_equal(blocks(dst_buf), expected)
    assert np.array_equal(src_buf, before), "a read never writes the source"
    assert dst.poll("src") == ((), ())


@given(
    st.lists(
        st.tuples(st.integers(0, 11), st.integers(0, 7)),
        min_size=1,
        max_size=12,
        unique_by=lambda p: p[0],
    )
)
def test_any_read_lands_exactly(pairs: list[tuple[int, int]]) -> None:
    src_buf, dst_buf = region(8), region(12, fill=0)
    src = MemoryDataTransport.create(DataSettings(src_buf.data, BLOCK))
    dst = MemoryDataTransport.create(DataSettings(dst_buf.data, BLOCK))
    try:
        dst.add_peer("src", src.descriptor())
        local = [p[0] for p in pairs]
        remote = [p[1] for p in pairs]
        tid = dst.read_blocks("src", local, remote)
        assert dst.poll("src").done == [tid]
        expected = np.zeros((12, BLOCK), dtype=np.uint8)
        expected[local] = blocks(src_buf)[remote]
        assert np.array_equal(blocks(dst_buf), expected)
    finally:
        src.close()
        dst.close()


def test_numpy_indexes_are_accepted(make: MakeData) -> None:
    dst, _src, dst_buf, src_buf = pair(make)
    # Accepted though the contract types them Sequence[int]: the point of this test.
    dst.read_blocks("src", np.array([3, 4]), np.array([1, 2], dtype=np.uint32))  # type: ignore[arg-type]
    dst.read_blocks("src", [np.int64(5), np.int32(6)], [np.uint8(3), 4])  # type: ignore[list-item]
    dst.poll("src")
    assert np.array_equal(blocks(dst_buf)[3:7], blocks(src_buf)[1:5])


def test_completion_polls_copy_at_completion(make: MakeData) -> None:
    dst, _src, dst_buf, src_buf = pair(make, completion_polls=2)
    tid = dst.read_blocks("src", [0], [1])
    assert dst.poll("src") == ((), ())
    assert dst.poll("src") == ((), ())
    assert not blocks(dst_buf)[0].any()
    blocks(src_buf)[1] = 77  # the source changed before the read completed: it copies this
    assert dst.poll("src") == ([tid], [])
    assert (blocks(dst_buf)[0] == 77).all()


def test_poll_is_scoped_per_peer(make: MakeData) -> None:
    dst = make(region(8, fill=0))
    a, b = make(region(8)), make(region(8))
    dst.add_peer("a", a.descriptor())
    dst.add_peer("b", b.descriptor())
    ta = dst.read_blocks("a", [0], [0])
    tb = dst.read_blocks("b", [1], [1])
    assert dst.poll("a") == ([ta], [])
    assert dst.poll("a") == ((), ())
    assert dst.poll("unknown") == ((), ())
    assert dst.poll("b") == ([tb], [])
    tc, td = dst.read_blocks("a", [2], [2]), dst.read_blocks("b", [3], [3])
    assert sorted(dst.poll(None).done) == [tc, td]


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([12], [0], "local block index 12"),
        ([-1], [0], "local block index -1"),
        ([0], [8], "remote .* block index 8"),
        ([0, 1], [0], "2 local but 1 remote"),
        ([0, 0], [1, 2], "local block index 0 is named twice"),
        ([], [], "empty"),
        ([0.5], [0], "integers"),
        ([[0]], [[0]], "integers"),
        ([True], [0], "integers"),
    ],
)
def test_indexes_checked_before_anything_is_posted(
    make: MakeData, local: Any, remote: Any, match: str
) -> None:
    dst, _src, dst_buf, _src_buf = pair(make)
    with pytest.raises(TransferSubmitError, match=match):
        dst.read_blocks("src", local, remote)
    assert dst.poll(None) == ((), ())
    assert not dst_buf.any()


def test_the_same_remote_block_may_fill_two_slots(make: MakeData) -> None:
    dst, _src, dst_buf, src_buf = pair(make)
    tid = dst.read_blocks("src", [0, 1], [4, 4])
    assert dst.poll("src").done == [tid]
    assert np.array_equal(blocks(dst_buf)[0], blocks(src_buf)[4])
    assert np.array_equal(blocks(dst_buf)[1], blocks(src_buf)[4])


def test_unknown_peer_is_a_submit_error(make: MakeData) -> None:
    dst = make(region(8))
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        dst.read_blocks("nobody", [0], [0])


def test_ids_are_unique(make: MakeData) -> None:
    dst, *_ = pair(make)
    ids = [dst.read_blocks("src", [0], [0]) for _ in range(5)]
    assert len(set(ids)) == 5


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (b"\xc1garbage", "malformed"),
        (msgpack.packb([1, 2]), "not a memory transport descriptor"),
        (msgpack.packb({"transport": "nixl"}), "not a memory transport descriptor"),
        (
            msgpack.packb({"transport": "memory", "region": 1, "num_blocks": 1, "block_len": 16}),
            "needs region",
        ),
        (
            msgpack.packb({"transport": "memory", "region": "x", "num_blocks": 0, "block_len": 16}),
            "needs region",
        ),
        (
            msgpack.packb({"transport": "memory", "region": "x", "num_blocks": 4, "block_len": 16}),
            "not registered in this process",
        ),
    ],
)
def test_malformed_descriptor_is_rejected(make: MakeData, descriptor: bytes, match: str) -> None:
    with pytest.raises(PeerRejected, match=match):
        make(region(8)).add_peer("p", descriptor)


def test_mismatched_block_len_is_rejected(make: MakeData) -> None:
    a = make(region(8))
    b = make(region(8, block_len=32), block_len=32)
    with pytest.raises(PeerRejected, match="block_len 32 does not match ours \\(16\\)"):
        a.add_peer("b", b.descriptor())


def test_descriptor_shape_must_match_region(make: MakeData) -> None:
    a, b = make(region(8)), make(region(8))
    desc = msgpack.unpackb(b.descriptor())
    desc["num_blocks"] = 99
    with pytest.raises(PeerRejected, match="99x16"):
        a.add_peer("b", msgpack.packb(desc))


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"nope": 1}, "nope"),
        ({"completion_polls": -1}, "completion_polls"),
        ({"completion_polls": 1.5}, "completion_polls"),
        ({"wait_cancel_refuses": True}, "wait_cancel_refuses"),  # gone with CancelMode
        ({"drain_polls": 2}, "drain_polls"),  # nothing to drain: reads end at once
    ],
)
def test_bad_options_name_the_key(make: MakeData, options: dict[str, Any], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        make(region(8), **options)


@pytest.mark.parametrize(
    ("buf", "block_len", "match"),
    [
        (memoryview(b"\0" * 32), BLOCK, "writable"),
        (memoryview(bytearray(30)), BLOCK, "multiple"),
        (memoryview(bytearray(0)), BLOCK, "multiple"),
        (memoryview(bytearray(32)), 0, "block_len"),
        (memoryview(bytearray(64))[::2], BLOCK, "contiguous"),
    ],
)
def test_bad_region_is_a_config_error(buf: memoryview, block_len: int, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        MemoryDataTransport.create(DataSettings(buf, block_len))


# -- ending reads: final, never copied, never reported ---------------------------------------


def test_cancel_is_final(make: MakeData) -> None:
    dst, _src, dst_buf, _src_buf = pair(make, completion_polls=1)
    tid = dst.read_blocks("src", [0], [0])
    assert dst.cancel([tid, 999]) is None
    for _ in range(3):
        assert dst.poll("src") == ((), ())
    assert not dst_buf.any(), "a cancelled read copied"


def test_cancel_of_a_reported_id_is_ignored(make: MakeData) -> None:
    dst, *_ = pair(make)
    tid = dst.read_blocks("src", [0], [0])
    assert dst.poll("src").done == [tid]
    dst.cancel([tid])
    assert dst.poll(None) == ((), ())


def test_remove_peer_ends_its_reads_finally(make: MakeData) -> None:
    dst, src, dst_buf, _src_buf = pair(make, completion_polls=2)
    other = make(region(8))
    dst.add_peer("other", other.descriptor())
    gone = dst.read_blocks("src", [0], [0])
    kept = dst.read_blocks("other", [1], [1])
    assert dst.remove_peer("src") == [], "no internal transfers: nothing is ever undrained"
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        dst.read_blocks("src", [0], [0])
    dst.add_peer("src", src.descriptor())
    seen = [dst.poll(None) for _ in range(4)]
    assert [tid for r in seen for tid in r.done] == [kept]
    assert gone not in {tid for r in seen for tid in (*r.done, *r.failed)}
    assert not blocks(dst_buf)[0].any(), "a read of a removed peer copied later"
    assert dst.remove_peer("never-added") == []


def test_readd_peer_ends_the_old_registrations_reads(make: MakeData) -> None:
    dst = make(region(8, fill=0), completion_polls=1)
    a, b = make(region(8)), make(region(4))
    dst.add_peer("p", a.descriptor())
    old = dst.read_blocks("p", [0], [0])
    dst.add_peer("p", b.descriptor())
    with pytest.raises(TransferSubmitError, match="remote"):
        dst.read_blocks("p", [0], [5])  # the new registration's shape
    assert dst.poll("p") == ((), ())
    assert dst.poll("p") == ((), ())
    assert old  # ended, never reported


def test_close_ends_reads_and_refuses_later_calls(make: MakeData) -> None:
    src_buf, dst_buf = region(8), region(8, fill=0)
    dst = MemoryDataTransport.create(DataSettings(dst_buf.data, BLOCK, {"completion_polls": 1}))
    src = make(src_buf)
    dst.add_peer("src", src.descriptor())
    dst.read_blocks("src", [0], [0])
    assert dst.close() == []
    assert dst.close() == []
    assert dst.poll(None) == ((), ())
    dst.cancel([1])
    assert dst.remove_peer("src") == []
    with pytest.raises(TransferSubmitError, match="closed"):
        dst.read_blocks("src", [0], [0])
    with pytest.raises(PeerRejected, match="closed"):
        dst.add_peer("src", src.descriptor())
    assert not dst_buf.any()


def test_read_from_a_closed_region_fails(make: MakeData) -> None:
    dst, src, *_ = pair(make, completion_polls=1)
    eager = make(region(8))
    eager.add_peer("src", src.descriptor())
    tid = dst.read_blocks("src", [0], [0])
    src.close()
    assert dst.poll("src") == ((), ())
    assert dst.poll("src") == ([], [tid])
    with pytest.raises(TransferSubmitError, match="no longer registered"):
        eager.read_blocks("src", [0], [0])
    with pytest.raises(PeerRejected, match="not registered"):
        make(region(8)).add_peer("src", src.descriptor())


def test_a_closed_consumer_is_not_readable(make: MakeData) -> None:
    dst, src, *_ = pair(make)
    src.add_peer("dst", dst.descriptor())
    dst.close()
    with pytest.raises(TransferSubmitError, match="no longer registered"):
        src.read_blocks("dst", [0], [0])
