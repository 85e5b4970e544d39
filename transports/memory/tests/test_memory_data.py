"""The memory data transport against the DataTransport contract."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import msgpack
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.contracts import CancelMode, DataSettings
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError
from p2pkv_memory import MemoryDataTransport

BLOCK = 16


def region(num_blocks: int, block_len: int = BLOCK, fill: int | None = None) -> np.ndarray:
    if fill is None:
        return np.arange(num_blocks * block_len, dtype=np.uint64).astype(np.uint8) ^ 0x5A
    return np.full(num_blocks * block_len, fill, dtype=np.uint8)


@pytest.fixture
def make() -> Iterator[Any]:
    made: list[MemoryDataTransport] = []

    def make(
        buf: np.ndarray, block_len: int = BLOCK, **options: Any
    ) -> MemoryDataTransport:
        t = MemoryDataTransport.create(DataSettings(memoryview(buf), block_len, options))
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


def pair(make: Any, **options: Any) -> tuple[Any, Any, np.ndarray, np.ndarray]:
    src_buf, dst_buf = region(8), region(12, fill=0)
    src, dst = make(src_buf, **options), make(dst_buf)
    src.add_peer("dst", dst.descriptor())
    return src, dst, src_buf, dst_buf


def blocks(buf: np.ndarray) -> np.ndarray:
    return buf.reshape(-1, BLOCK)


def test_shape_and_capabilities(make: Any) -> None:
    t = make(region(8))
    assert (t.num_blocks, t.block_len) == (8, BLOCK)
    assert not t.capabilities.cross_process and not t.capabilities.cross_host
    assert t.kind == "data" and t.name == "memory"


def test_writes_land_byte_exactly_at_scattered_remote_indexes(make: Any) -> None:
    src, _dst, src_buf, dst_buf = pair(make)
    tid = src.write_blocks("dst", [0, 5, 2], [11, 3, 7])
    assert src.poll("dst") == ([tid], [])
    expected = np.zeros((12, BLOCK), dtype=np.uint8)
    expected[[11, 3, 7]] = blocks(src_buf)[[0, 5, 2]]
    assert np.array_equal(blocks(dst_buf), expected)
    assert src.poll("dst") == ((), ())


@given(
    st.lists(
        st.tuples(st.integers(0, 7), st.integers(0, 11)), max_size=12, unique_by=lambda p: p[1]
    )
)
def test_any_write_lands_exactly(pairs: list[tuple[int, int]]) -> None:
    src_buf, dst_buf = region(8), region(12, fill=0)
    src = MemoryDataTransport.create(DataSettings(memoryview(src_buf), BLOCK))
    dst = MemoryDataTransport.create(DataSettings(memoryview(dst_buf), BLOCK))
    try:
        src.add_peer("dst", dst.descriptor())
        local = [p[0] for p in pairs]
        remote = [p[1] for p in pairs]
        tid = src.write_blocks("dst", local, remote)
        assert src.poll("dst").done == [tid]
        expected = np.zeros((12, BLOCK), dtype=np.uint8)
        expected[remote] = blocks(src_buf)[local]
        assert np.array_equal(blocks(dst_buf), expected)
    finally:
        src.close()
        dst.close()


def test_numpy_index_arrays_are_accepted(make: Any) -> None:
    src, _dst, src_buf, dst_buf = pair(make)
    src.write_blocks("dst", np.array([1, 2]), np.array([3, 4], dtype=np.uint32))
    src.poll("dst")
    assert np.array_equal(blocks(dst_buf)[3:5], blocks(src_buf)[1:3])


def test_completion_polls_copy_at_completion(make: Any) -> None:
    src, _dst, src_buf, dst_buf = pair(make, completion_polls=2)
    tid = src.write_blocks("dst", [1], [0])
    assert src.poll("dst") == ((), ())
    assert src.poll("dst") == ((), ())
    assert not blocks(dst_buf)[0].any()
    assert src.poll("dst") == ([tid], [])
    assert np.array_equal(blocks(dst_buf)[0], blocks(src_buf)[1])


def test_poll_is_scoped_per_peer(make: Any) -> None:
    src = make(region(8))
    a, b = make(region(8, fill=0)), make(region(8, fill=0))
    src.add_peer("a", a.descriptor())
    src.add_peer("b", b.descriptor())
    ta = src.write_blocks("a", [0], [0])
    tb = src.write_blocks("b", [1], [1])
    assert src.poll("a") == ([ta], [])
    assert src.poll("a") == ((), ())
    assert src.poll("unknown") == ((), ())
    assert src.poll("b") == ([tb], [])
    tc, td = src.write_blocks("a", [2], [2]), src.write_blocks("b", [3], [3])
    done = src.poll(None).done
    assert sorted(done) == [tc, td]


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([8], [0], "local block index 8"),
        ([-1], [0], "local block index -1"),
        ([0], [12], "remote .* block index 12"),
        ([0, 1], [0], "2 local but 1 remote"),
        ([0.5], [0], "integers"),
        ([[0]], [[0]], "integers"),
        ([True], [0], "integers"),
    ],
)
def test_bounds_checked_before_anything_is_posted(
    make: Any, local: Any, remote: Any, match: str
) -> None:
    src, _dst, _src_buf, dst_buf = pair(make)
    with pytest.raises(TransferSubmitError, match=match):
        src.write_blocks("dst", local, remote)
    assert src.poll(None) == ((), ())
    assert not dst_buf.any()


def test_unknown_peer_is_a_submit_error(make: Any) -> None:
    src = make(region(8))
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        src.write_blocks("nobody", [0], [0])


def test_empty_write_completes(make: Any) -> None:
    src, *_ = pair(make)
    tid = src.write_blocks("dst", [], [])
    assert src.poll("dst").done == [tid]


def test_ids_are_unique(make: Any) -> None:
    src, *_ = pair(make)
    ids = [src.write_blocks("dst", [0], [0]) for _ in range(5)]
    assert len(set(ids)) == 5


@pytest.mark.parametrize(
    ("descriptor", "match"),
    [
        (b"\xc1garbage", "malformed"),
        (msgpack.packb([1, 2]), "not a memory transport descriptor"),
        (msgpack.packb({"transport": "nixl"}), "not a memory transport descriptor"),
        (msgpack.packb({"transport": "memory", "region": 1, "num_blocks": 1, "block_len": 16}),
         "needs region"),
        (msgpack.packb({"transport": "memory", "region": "x", "num_blocks": 0, "block_len": 16}),
         "needs region"),
        (msgpack.packb({"transport": "memory", "region": "x", "num_blocks": 4, "block_len": 16}),
         "not registered in this process"),
    ],
)
def test_malformed_descriptor_is_rejected(make: Any, descriptor: bytes, match: str) -> None:
    with pytest.raises(PeerRejected, match=match):
        make(region(8)).add_peer("p", descriptor)


def test_mismatched_block_len_is_rejected(make: Any) -> None:
    a = make(region(8))
    b = make(region(8, block_len=32), block_len=32)
    with pytest.raises(PeerRejected, match="block_len 32 does not match ours \\(16\\)"):
        a.add_peer("b", b.descriptor())


def test_descriptor_shape_must_match_region(make: Any) -> None:
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
        ({"wait_cancel_refuses": 1}, "wait_cancel_refuses"),
        ({"drain_polls": -2}, "drain_polls"),
    ],
)
def test_bad_options_name_the_key(make: Any, options: dict[str, Any], key: str) -> None:
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


def test_wait_cancel_stops_uncopied_transfer(make: Any) -> None:
    src, _dst, _src_buf, dst_buf = pair(make, completion_polls=1)
    tid = src.write_blocks("dst", [0], [0])
    assert src.cancel([tid, 999], CancelMode.WAIT) == []
    assert src.poll("dst") == ((), ())
    assert src.poll("dst") == ((), ())
    assert not dst_buf.any()


def test_wait_cancel_keeps_in_flight_ids_when_refusing(make: Any) -> None:
    src, *_ = pair(make, completion_polls=1, wait_cancel_refuses=True)
    tid = src.write_blocks("dst", [0], [0])
    assert src.cancel([tid], CancelMode.WAIT) == [tid]
    assert src.poll("dst") == ((), ())
    assert src.poll("dst") == ([tid], [])


def test_immediate_cancel_forgets(make: Any) -> None:
    src, *_ = pair(make, wait_cancel_refuses=True)
    tid = src.write_blocks("dst", [0], [0])
    assert src.cancel([tid], CancelMode.IMMEDIATE) == []
    assert src.poll(None) == ((), ())


def test_remove_peer_drains_or_returns_undrained(make: Any) -> None:
    src, _dst, _src_buf, dst_buf = pair(
        make, completion_polls=5, wait_cancel_refuses=True, drain_polls=2
    )
    tid = src.write_blocks("dst", [0], [0])
    assert src.remove_peer("dst") == [tid]
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        src.write_blocks("dst", [0], [0])
    for _ in range(3):
        src.poll("dst")
    assert src.poll("dst") == ([tid], [])
    assert dst_buf.any()


def test_remove_peer_drains_within_budget(make: Any) -> None:
    src, *_ = pair(make, completion_polls=2, wait_cancel_refuses=True, drain_polls=5)
    src.write_blocks("dst", [0], [0])
    assert src.remove_peer("dst") == []
    assert src.poll(None) == ((), ())
    assert src.remove_peer("never-added") == []


def test_close_returns_undrained_and_keeps_region(make: Any) -> None:
    src_buf, dst_buf = region(8), region(8, fill=0)
    src = MemoryDataTransport.create(
        DataSettings(memoryview(src_buf), BLOCK,
                     {"completion_polls": 1, "wait_cancel_refuses": True, "drain_polls": 1})
    )
    dst = make(dst_buf)
    other = make(region(8, fill=0))
    other.add_peer("src", src.descriptor())
    src.add_peer("dst", dst.descriptor())
    tid = src.write_blocks("dst", [0], [0])
    assert src.close() == [tid]
    other.write_blocks("src", [0], [0])  # region still registered: writes into it still work
    assert other.poll("src").done
    assert src.close() == []  # each close polls drain_polls more times: now it drained
    with pytest.raises(TransferSubmitError, match="closed"):
        src.write_blocks("dst", [0], [0])


def test_write_into_closed_region_fails(make: Any) -> None:
    src, dst, *_ = pair(make, completion_polls=1)
    eager = make(region(8))
    eager.add_peer("dst", dst.descriptor())
    tid = src.write_blocks("dst", [0], [0])
    dst.close()
    assert src.poll("dst") == ((), ())
    assert src.poll("dst") == ([], [tid])
    with pytest.raises(TransferSubmitError, match="no longer registered"):
        eager.write_blocks("dst", [0], [0])
    with pytest.raises(PeerRejected, match="not registered"):
        make(region(8)).add_peer("dst", dst.descriptor())


def test_readd_peer_replaces_it(make: Any) -> None:
    src = make(region(8))
    a, b = make(region(8, fill=0)), make(region(4, fill=0))
    src.add_peer("p", a.descriptor())
    src.add_peer("p", b.descriptor())
    with pytest.raises(TransferSubmitError, match="remote"):
        src.write_blocks("p", [0], [5])
