"""Every fault kind of the FaultInjector, with memory transports inside."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from p2pkv.contracts import ControlConnection, ControlSettings, DataSettings
from p2pkv.errors import ConnectionClosed, TransferSubmitError
from p2pkv.reference import (
    Fault,
    FaultInjector,
    MemoryControlTransport,
    MemoryDataTransport,
)
from p2pkv.reference.faults import FaultyControlTransport, FaultyDataTransport

BLOCK = 8


@pytest.fixture
def faults() -> FaultInjector:
    return FaultInjector(seed=1234)


Controls = tuple[FaultyControlTransport, MemoryControlTransport]
"""The ``controls`` fixture: a fault-injected transport and a plain one."""


@pytest.fixture
def controls(faults: FaultInjector) -> Iterator[Controls]:
    a = faults.control(MemoryControlTransport.create(ControlSettings("127.0.0.1", 0)))
    b = MemoryControlTransport.create(ControlSettings("127.0.0.1", 0))
    yield a, b
    a.close()
    b.close()


def link(
    a: FaultyControlTransport, b: MemoryControlTransport
) -> tuple[ControlConnection, ControlConnection]:
    conn = a.connect(b.local_address)
    conn.send(b"hello")
    (peer,) = b.poll()
    assert list(peer.recv()) == [b"hello"]
    return conn, peer


def deliver(b: MemoryControlTransport, peer: ControlConnection) -> list[bytes]:
    b.poll()
    return list(peer.recv())


def test_no_rule_no_fault(controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    for i in range(5):
        conn.send(bytes([i]))
    assert deliver(b, peer) == [bytes([i]) for i in range(5)]
    assert a.capabilities == b.capabilities and conn.alive


def test_drop_next_frame_only(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    rule = faults.arm(Fault.DROP, peer=b.local_address, count=1)
    conn.send(b"1")
    conn.send(b"2")
    assert deliver(b, peer) == [b"2"]
    assert rule.fired == 1


def test_rule_for_another_peer_does_not_fire(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    rule = faults.arm(Fault.DROP, peer="10.0.0.1:1")
    conn.send(b"1")
    assert deliver(b, peer) == [b"1"]
    assert rule.fired == 0


def test_delay_holds_for_n_polls(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.arm(Fault.DELAY, count=1, polls=2)
    conn.send(b"late")
    conn.send(b"early")
    assert deliver(b, peer) == [b"early"]
    a.poll()
    assert deliver(b, peer) == []
    a.poll()
    assert deliver(b, peer) == [b"late"]


def test_duplicate(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.arm(Fault.DUPLICATE, count=1)
    conn.send(b"x")
    conn.send(b"y")
    assert deliver(b, peer) == [b"x", b"x", b"y"]


def test_reorder_swaps_with_next_frame(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.arm(Fault.REORDER, count=1)
    conn.send(b"1")
    conn.send(b"2")
    conn.send(b"3")
    assert deliver(b, peer) == [b"2", b"1", b"3"]


def test_reordered_frame_is_released_by_poll(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.arm(Fault.REORDER, count=1)
    conn.send(b"only")
    assert deliver(b, peer) == []
    a.poll()
    assert deliver(b, peer) == [b"only"]


def test_kill_rule_kills_both_ends(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.arm(Fault.KILL, count=1)
    with pytest.raises(ConnectionClosed):
        conn.send(b"x")
    assert not conn.alive
    b.poll()
    assert not peer.alive
    with pytest.raises(ConnectionClosed):
        conn.send(b"y")


def test_kill_now(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.kill(conn)
    assert not conn.alive
    b.poll()
    assert not peer.alive
    with pytest.raises(TypeError):
        faults.kill(peer)


def test_connect_returns_the_same_wrapper(controls: Controls) -> None:
    a, b = controls
    assert a.connect(b.local_address) is a.connect(b.local_address)


def test_partition_kills_and_blocks_until_healed(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    faults.partition(a.local_address, b.local_address)
    assert not conn.alive
    b.poll()
    assert not peer.alive
    again = a.connect(b.local_address)
    assert not again.alive
    # inbound from the other side of the partition is closed unseen
    back = b.connect(a.local_address)
    back.send(b"x")
    assert a.poll() == []
    b.poll()
    assert not back.alive
    faults.heal(a.local_address, b.local_address)
    fresh = a.connect(b.local_address)
    fresh.send(b"ok")
    (accepted,) = b.poll()
    assert list(accepted.recv()) == [b"ok"]


def test_probability_is_deterministic_from_the_seed() -> None:
    def run(seed: int) -> list[bytes]:
        faults = FaultInjector(seed)
        a = faults.control(MemoryControlTransport.create(ControlSettings("127.0.0.1", 0)))
        b = MemoryControlTransport.create(ControlSettings("127.0.0.1", 0))
        try:
            faults.arm(Fault.DROP, probability=0.5)
            conn = a.connect(b.local_address)
            for i in range(64):
                conn.send(bytes([i]))
            (peer,) = b.poll()
            return list(peer.recv())
        finally:
            a.close()
            b.close()

    first = run(5)
    assert first == run(5)
    assert 0 < len(first) < 64
    assert first != run(6)


def test_arm_validates(faults: FaultInjector) -> None:
    with pytest.raises(ValueError, match="probability"):
        faults.arm(Fault.DROP, probability=1.5)
    with pytest.raises(ValueError, match="count"):
        faults.arm(Fault.DROP, count=0)
    with pytest.raises(ValueError, match="polls"):
        faults.arm(Fault.DELAY, polls=0)


def test_disarm(faults: FaultInjector, controls: Controls) -> None:
    a, b = controls
    conn, peer = link(a, b)
    rule = faults.arm(Fault.DROP)
    faults.disarm(rule)
    faults.arm(Fault.DROP)
    faults.disarm()
    conn.send(b"kept")
    assert deliver(b, peer) == [b"kept"]


def test_wrappers_cannot_be_created_from_settings() -> None:
    with pytest.raises(TypeError):
        FaultyControlTransport.create(ControlSettings("127.0.0.1", 0))
    with pytest.raises(TypeError):
        FaultyDataTransport.create(DataSettings(memoryview(bytearray(8)), 8))


# -- data faults -----------------------------------------------------------------------------


Datas = tuple[FaultyDataTransport, MemoryDataTransport, np.ndarray]
"""The ``datas`` fixture: (wrapped consumer, producer, the consumer's buffer)."""


@pytest.fixture
def datas(faults: FaultInjector) -> Iterator[Datas]:
    """(wrapped consumer "dst", producer, consumer's buffer); the consumer reads from "src"."""
    src_buf = np.arange(4 * BLOCK, dtype=np.uint8)
    dst_buf = np.zeros(4 * BLOCK, dtype=np.uint8)
    dst = faults.data(MemoryDataTransport.create(DataSettings(dst_buf.data, BLOCK)), local="dst")
    src = MemoryDataTransport.create(DataSettings(src_buf.data, BLOCK))
    dst.add_peer("src", src.descriptor())
    yield dst, src, dst_buf
    dst.close()
    src.close()


def test_data_wrapper_delegates(datas: Datas) -> None:
    dst, src, dst_buf = datas
    assert (dst.num_blocks, dst.block_len) == (4, BLOCK)
    assert dst.capabilities == src.capabilities
    assert dst.descriptor() == dst.inner.descriptor()
    dst.progress()
    tid = dst.read_blocks("src", [2], [1])
    assert dst.poll("src") == ([tid], [])
    assert dst_buf[2 * BLOCK] == BLOCK


def test_fail_submit_posts_nothing(faults: FaultInjector, datas: Datas) -> None:
    dst, _src, dst_buf = datas
    faults.arm(Fault.FAIL_SUBMIT, peer="src", count=1)
    with pytest.raises(TransferSubmitError, match="injected"):
        dst.read_blocks("src", [1], [1])
    assert dst.poll(None) == ((), ())
    assert not dst_buf.any()
    dst.read_blocks("src", [1], [1])  # count used up


def test_fail_completion(faults: FaultInjector, datas: Datas) -> None:
    dst, *_ = datas
    faults.arm(Fault.FAIL_COMPLETION, peer="src", count=1)
    first = dst.read_blocks("src", [0], [0])
    second = dst.read_blocks("src", [1], [1])
    result = dst.poll("src")
    assert (list(result.done), list(result.failed)) == ([second], [first])


def test_data_partition(faults: FaultInjector, datas: Datas) -> None:
    dst, *_ = datas
    in_flight = dst.read_blocks("src", [0], [0])
    faults.partition("dst", "src")
    with pytest.raises(TransferSubmitError, match="partitioned"):
        dst.read_blocks("src", [1], [1])
    assert dst.poll("src") == ([], [in_flight])
    faults.heal("dst", "src")
    tid = dst.read_blocks("src", [1], [1])
    assert dst.poll(None) == ([tid], [])


def test_cancel_remove_peer_readd_and_close_are_final(faults: FaultInjector) -> None:
    src_buf, dst_buf = np.arange(4 * BLOCK, dtype=np.uint8), np.zeros(4 * BLOCK, np.uint8)
    opts = {"completion_polls": 2}
    dst = faults.data(MemoryDataTransport.create(DataSettings(dst_buf.data, BLOCK, opts)))
    src = MemoryDataTransport.create(DataSettings(src_buf.data, BLOCK))
    dst.add_peer("src", src.descriptor())
    faults.arm(Fault.FAIL_COMPLETION)  # would turn any late report into a failure: none comes
    t1 = dst.read_blocks("src", [0], [0])
    assert dst.cancel([t1]) is None
    t2 = dst.read_blocks("src", [1], [1])
    assert dst.remove_peer("src") == []
    dst.add_peer("src", src.descriptor())
    t3 = dst.read_blocks("src", [2], [2])
    dst.add_peer("src", src.descriptor())  # re-adding ends t3
    t4 = dst.read_blocks("src", [3], [3])
    assert dst.close() == []
    assert dst.close() == []
    assert dst.poll(None) == ((), ())
    assert not dst_buf.any(), f"an ended read ({t1}, {t2}, {t3} or {t4}) copied"
    src.close()
