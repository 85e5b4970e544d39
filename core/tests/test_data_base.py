"""The ``DataTransport`` base: the read check, the re-add rule, exactly-once reports, error
mapping and the after-close behaviour, on a scripted backend that implements only the
primitives."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.contracts import EMPTY_POLL, Capabilities, DataSettings, DataTransport, ReadState
from p2pkv.data_base import Indexes, check_read
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError


@dataclass(frozen=True)
class _Peer:
    name: str
    num_blocks: int


@dataclass
class _Read:
    peer: str
    local: Indexes
    remote: Indexes
    state: ReadState = ReadState.PENDING
    raises: bool = False


class Scripted(DataTransport):
    """Descriptors are ``b"name:num_blocks"``; reads end when the test sets their state."""

    name: ClassVar[str] = "scripted"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self.posted: list[_Read] = []
        self.ended: list[_Read] = []
        self.detached: list[str] = []
        self.post_error: Exception | None = None
        self.undrained: list[int] = []
        self.unusable: set[_Peer] = set()

    def descriptor(self) -> bytes:
        return b"self:%d" % self.num_blocks

    def _attach_peer(self, peer_id: str, descriptor: bytes) -> _Peer:
        name, blocks = descriptor.decode().split(":")  # garbage raises ValueError
        return _Peer(name, int(blocks))

    def _peer_usable(self, peer: _Peer) -> bool:
        return peer not in self.unusable

    def _detach_peer(self, peer: _Peer) -> list[int]:
        self.detached.append(peer.name)
        return []

    def _post_read(self, peer: _Peer, local: Indexes, remote: Indexes) -> _Read:
        if self.post_error is not None:
            raise self.post_error
        read = _Read(peer.name, local, remote)
        self.posted.append(read)
        return read

    def _read_state(self, read: _Read) -> ReadState:
        if read.raises:
            raise RuntimeError("backend hiccup")
        return read.state

    def _end_reads(self, handles: list[Any]) -> None:
        self.ended += handles

    def _shutdown(self) -> list[int]:
        return self.undrained


def make(num_blocks: int = 8, block_len: int = 4) -> Scripted:
    return Scripted(DataSettings(memoryview(bytearray(num_blocks * block_len)), block_len))


# -- check_read ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("local", "remote", "match"),
    [
        ([8], [0], "local block index 8 is outside 0..7"),
        ([-1], [0], "local block index -1"),
        ([0], [4], "remote block index 4 is outside 0..3"),
        ([0, 1, 2], [0, -2, 1], "remote block index -2"),
        ([0, 1], [0], "2 local but 1 remote"),
        ([], [], "empty"),
        ([3, 1, 3], [0, 1, 2], "local block index 3 is named twice"),
        ([0.5], [0], "integers"),
        ([True], [0], "integers"),
        ([0, 1], [True, False], "remote block indexes must be"),
        ([0, [1]], [0, 1], "local block indexes must be"),
        ([[0]], [[0]], "integers"),
        (np.zeros((1, 1), np.int64), [0], "integers"),
    ],
)
def test_check_read_refuses_naming_the_index(local: Any, remote: Any, match: str) -> None:
    with pytest.raises(TransferSubmitError, match=match):
        check_read(local, remote, 8, 4)


def test_check_read_finds_a_repeat_in_a_long_read() -> None:
    with pytest.raises(TransferSubmitError, match="local block index 5 is named twice"):
        check_read([*range(100), 5], [0] * 101, 100, 1)


_INDEX = st.one_of(
    st.integers(-3, 12),
    st.booleans(),
    st.booleans().map(np.bool_),
    st.floats(0, 4),
    st.lists(st.integers(0, 3), min_size=1, max_size=1),
    st.just(2**64 - 1),
    st.integers(0, 7).map(np.int32),
)
"""Index entries of every kind, good and bad (out of range, bools, floats, nested, huge)."""


@given(
    st.lists(st.one_of(st.integers(0, 7), _INDEX), max_size=80),
    st.lists(st.one_of(st.integers(0, 3), _INDEX), max_size=80),
)
def test_two_lists_are_checked_as_any_sequence_is(local: list[Any], remote: list[Any]) -> None:
    """Two lists (checked in Python when short, else by one numpy call) give what the same
    indexes as tuples give (the general path): the same arrays, or the same refusal."""

    def outcome(a: Any, b: Any) -> tuple[list[int], list[int]] | str:
        try:
            checked = check_read(a, b, 8, 4, "p")
        except TransferSubmitError as exc:
            return str(exc)
        assert checked[0].dtype == checked[1].dtype == np.int64
        return checked[0].tolist(), checked[1].tolist()

    assert outcome(local, remote) == outcome(tuple(local), tuple(remote))


def test_check_read_returns_fresh_int64_arrays() -> None:
    given = np.array([1, 2], np.uint32)
    # Numpy arrays and integers are indexes too (typed Sequence[int]); a remote block may repeat.
    local, remote = check_read(given, [np.int16(3), 3], 8, 4)  # type: ignore[arg-type,list-item]
    assert local.dtype == remote.dtype == np.int64
    assert local.tolist() == [1, 2] and remote.tolist() == [3, 3]
    given[0] = 7
    assert local[0] == 1, "the caller may reuse its array"


@pytest.mark.parametrize(
    ("region", "block_len", "match"),
    [
        (bytearray(8), 4, "memoryview"),
        (memoryview(bytes(8)), 4, "writable"),
        (memoryview(bytearray(16))[::2], 4, "contiguous"),
        (memoryview(bytearray(8)), 0, "block_len"),
        (memoryview(bytearray(8)), True, "block_len"),
        (memoryview(bytearray(10)), 4, "multiple"),
        (memoryview(bytearray(0)), 4, "multiple"),
    ],
)
def test_region_is_checked_once(region: Any, block_len: Any, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        Scripted(DataSettings(region, block_len))


def test_shape_and_blocks_view() -> None:
    t = make(8, 4)
    assert (t.num_blocks, t.block_len, t._blocks.shape) == (8, 4, (8, 4))
    assert isinstance(Scripted.create(DataSettings(memoryview(bytearray(4)), 4)), Scripted)


# -- reads, reports ---------------------------------------------------------------------------


def test_each_read_is_reported_once_and_poll_is_scoped() -> None:
    t = make()
    t.add_peer("a", b"a:4")
    t.add_peer("b", b"b:4")
    ta, tb = t.read_blocks("a", [0], [0]), t.read_blocks("b", [1], [1])
    assert ta != tb
    t.posted[0].state = ReadState.DONE
    t.posted[1].state = ReadState.FAILED
    assert t.poll("b") == ([], [tb])
    assert t.poll("b") is EMPTY_POLL and t.poll("nobody") is EMPTY_POLL
    assert t.poll(None) == ([ta], [])
    assert t.poll(None) is EMPTY_POLL


def test_a_state_that_raises_fails_and_ends_the_read() -> None:
    t = make()
    t.add_peer("a", b"a:4")
    tid = t.read_blocks("a", [0], [0])
    t.posted[0].raises = True
    assert t.poll("a") == ([], [tid])
    assert t.ended == t.posted, "the failed read was ended, not left in flight"
    assert t.poll("a") is EMPTY_POLL


def test_cancel_is_final_and_ignores_unknown_and_reported_ids() -> None:
    t = make()
    t.add_peer("a", b"a:4")
    gone, kept = t.read_blocks("a", [0], [0]), t.read_blocks("a", [1], [1])
    t.cancel([gone, 12345])
    assert t.ended == [t.posted[0]]
    t.posted[1].state = t.posted[0].state = ReadState.DONE
    assert t.poll("a") == ([kept], [])
    t.cancel([kept])
    assert t.ended == [t.posted[0]], "a reported read is not ended again"


def test_backend_errors_are_mapped() -> None:
    t = make()
    with pytest.raises(PeerRejected, match=r"'g'.*malformed") as info:
        t.add_peer("g", b"garbage")
    assert isinstance(info.value.__cause__, ValueError)
    with pytest.raises(PeerRejected, match="0 blocks"):
        t.add_peer("z", b"z:0")
    t.add_peer("a", b"a:4")
    t.post_error = OSError("no route")
    with pytest.raises(TransferSubmitError, match="no route") as sub:
        t.read_blocks("a", [0], [0])
    assert isinstance(sub.value.__cause__, OSError)
    t.post_error = TransferSubmitError("staging pool full")
    with pytest.raises(TransferSubmitError, match=r"^staging pool full$"):
        t.read_blocks("a", [0], [0])
    with pytest.raises(TransferSubmitError, match="unknown peer"):
        t.read_blocks("nobody", [0], [0])


# -- peers ----------------------------------------------------------------------------------


def test_same_descriptor_keeps_the_registration_and_its_reads() -> None:
    t = make()
    t.add_peer("p", b"a:4")
    tid = t.read_blocks("p", [0], [0])
    t.add_peer("p", b"a:4")
    assert t.ended == [] and t.detached == []
    t.posted[0].state = ReadState.DONE
    assert t.poll("p") == ([tid], [])


def test_same_descriptor_replaces_a_record_the_backend_calls_unusable() -> None:
    t = make()
    t.add_peer("p", b"a:4")
    t.read_blocks("p", [0], [0])
    t.unusable.add(_Peer("a", 4))  # e.g. its endpoint failed while it was paused
    t.add_peer("p", b"a:4")
    assert t.ended == [t.posted[0]] and t.detached == ["a"]
    t.posted[0].state = ReadState.DONE
    assert t.poll(None) is EMPTY_POLL, "a read of the replaced record was reported"
    t.unusable.clear()
    tid = t.read_blocks("p", [1], [1])  # the fresh record serves
    t.posted[1].state = ReadState.DONE
    assert t.poll("p") == ([tid], [])


def test_another_descriptor_ends_the_old_reads_first() -> None:
    t = make()
    t.add_peer("p", b"old:4")
    old = t.read_blocks("p", [0], [0])
    with pytest.raises(PeerRejected):
        t.add_peer("p", b"bad")
    assert t.ended == [], "a rejected descriptor leaves the old registration alone"
    t.add_peer("p", b"new:2")
    assert t.ended == [t.posted[0]] and t.detached == ["old"]
    with pytest.raises(TransferSubmitError, match=r"remote .*index 3"):
        t.read_blocks("p", [0], [3])  # the new registration's shape
    t.posted[0].state = ReadState.DONE
    assert t.poll(None) is EMPTY_POLL, f"read {old} of the old registration was reported"


def test_remove_peer_ends_its_reads_and_returns_only_internal_ids() -> None:
    t = make()
    t.add_peer("p", b"p:4")
    t.read_blocks("p", [0], [0])
    assert t.remove_peer("p") == [] and t.detached == ["p"]
    assert t.ended == t.posted
    t.posted[0].state = ReadState.DONE
    assert t.poll(None) is EMPTY_POLL
    assert t.remove_peer("p") == []


# -- close ----------------------------------------------------------------------------------


def test_after_close() -> None:
    with make() as t:
        t.add_peer("p", b"p:4")
        t.read_blocks("p", [0], [0])
    assert t.ended == t.posted, "leaving the with block closed the transport"
    assert t._blocks.size == 0, "the base keeps no view of the caller's region"
    assert t.close() == []
    with pytest.raises(TransferSubmitError, match="closed"):
        t.read_blocks("p", [0], [0])
    with pytest.raises(PeerRejected, match="closed"):
        t.add_peer("p", b"p:4")
    assert t.poll(None) is EMPTY_POLL and t.poll("p") is EMPTY_POLL
    assert t.remove_peer("p") == []
    t.cancel([1])
    t.progress()


def test_undrained_close_keeps_the_region_view() -> None:
    t = make()
    t.undrained = [9, 3]
    assert t.close() == [3, 9]
    assert t._blocks.shape == (8, 4), "memory still in use stays referenced"
    assert t.close() == []
