"""Lanes and the staging pool over real NIXL, in separate processes over loopback.

``auto`` reads directly only from a same-host peer both of whose UCX sides have ``cma`` (our
own process then executes the read); a peer whose UCX runs ``UCX_TLS=tcp`` (like a peer on
another host without RDMA) is read through the staging pool. Over ``tcp`` NIXL cannot stop a
posted READ: a producer SIGSTOPped with our read in flight delivers every byte once it
resumes, whatever we released. The staging pool is what keeps those bytes out of our slots.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import numpy as np
import pytest
from nixl_fixtures import MakeLocal, MakeRecorder, WaitFor
from p2pkv.errors import ConfigError, TransferBusy, TransferSubmitError
from p2pkv.testing.peers import ChildDataPeer, PeerHost
from p2pkv.testing.waiting import wait_until
from p2pkv_nixl import NixlDataTransport

MiB = 1 << 20
CANARY = 0xCC


def _source(peer: ChildDataPeer, block_len: int) -> np.ndarray:
    return np.frombuffer(peer.region_bytes(), dtype=np.uint8).reshape(-1, block_len)


def test_auto_reads_a_same_host_cma_peer_directly_and_a_tcp_peer_through_staging(
    make_local: MakeLocal, host: PeerHost, tcp_host: PeerHost
) -> None:
    consumer = make_local(num_blocks=8, block_len=4096)
    t = consumer.transport
    near = host.data_peer(NixlDataTransport, 8, 4096, {})
    tcp = tcp_host.data_peer(NixlDataTransport, 8, 4096, {})
    t.add_peer("near", near.descriptor)
    assert t.lane("near") == "direct"
    assert t.staging_usage()["capacity"] == 0  # no pool until a staged peer needs one
    t.add_peer("tcp", tcp.descriptor)
    assert t.lane("tcp") == "staged"
    assert t.staging_usage() == {"capacity": 8, "free": 8, "quarantined": 0}  # capped at ours
    with pytest.raises(KeyError, match="nobody"):
        t.lane("nobody")
    near.close()
    tcp.close()


@pytest.mark.parametrize(
    ("staging", "near", "tcp"),
    [("always", "staged", "staged"), ("never", "direct", "direct")],
)
def test_the_staging_option_overrides_the_lane(
    make_local: MakeLocal,
    host: PeerHost,
    tcp_host: PeerHost,
    caplog: pytest.LogCaptureFixture,
    staging: str,
    near: str,
    tcp: str,
) -> None:
    with caplog.at_level(logging.WARNING, logger="p2pkv.nixl.transport"):
        t = make_local(num_blocks=8, block_len=4096, staging=staging).transport
    warned = [r for r in caplog.records if "staging='never'" in r.getMessage()]
    assert bool(warned) == (staging == "never")
    peers = {
        "near": host.data_peer(NixlDataTransport, 8, 4096, {}),
        "tcp": tcp_host.data_peer(NixlDataTransport, 8, 4096, {}),
    }
    for name, peer in peers.items():
        t.add_peer(name, peer.descriptor)
    assert (t.lane("near"), t.lane("tcp")) == (near, tcp)
    for peer in peers.values():
        peer.close()


def test_staged_reads_over_tcp_land_byte_exact(
    make_local: MakeLocal, tcp_host: PeerHost, wait_for: WaitFor
) -> None:
    consumer = make_local(num_blocks=96, block_len=64 * 1024, seed=3, staging_blocks=64)
    t = consumer.transport
    before = consumer.blocks.copy()
    producer = tcp_host.data_peer(NixlDataTransport, 80, 64 * 1024, {})
    producer.fill(17)
    source = _source(producer, 64 * 1024)
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())  # a staged read is served by the producer's WRITE
    assert t.lane("p") == "staged"
    slots = np.random.default_rng(5).choice(96, size=64, replace=False)
    remote = np.random.default_rng(6).permutation(80)[:64]

    first = t.read_blocks("p", slots[:40].tolist(), remote[:40].tolist())
    # The rest of the pool, indexed by numpy arrays (accepted, though typed Sequence[int]).
    second = t.read_blocks("p", slots[40:], remote[40:])  # type: ignore[arg-type]
    done, failed = wait_for(t, "p", {first, second})

    assert done == {first, second} and not failed
    np.testing.assert_array_equal(consumer.blocks[slots], source[remote])
    untouched = np.setdiff1d(np.arange(96), slots)
    np.testing.assert_array_equal(consumer.blocks[untouched], before[untouched])
    assert t.staging_usage() == {"capacity": 64, "free": 64, "quarantined": 0}
    producer.close()


def test_a_full_staging_pool_says_busy_and_an_oversized_read_is_refused(
    make_local: MakeLocal, host: PeerHost, record: MakeRecorder, wait_for: WaitFor
) -> None:
    t = make_local(num_blocks=16, block_len=4096, staging="always", staging_blocks=4).transport
    producer = host.data_peer(NixlDataTransport, 16, 4096, {})
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())
    recorder = record(t)
    with pytest.raises(TransferSubmitError, match=r"exceeds the staging pool.*'staging_blocks'"):
        t.read_blocks("p", list(range(5)), list(range(5)))
    taken = t.read_blocks("p", [0, 1, 2], [0, 1, 2])  # not polled: its blocks stay taken
    assert t.read_capacity("p") == 4
    with pytest.raises(TransferBusy, match=r"1 free blocks of 4.*'staging_blocks'"):
        t.read_blocks("p", [3, 4], [3, 4])  # back-pressure: the tier retries it later
    assert recorder.names().count("send_notif") == 1  # one request; none for the refusals
    assert "make_prepped_xfer" not in recorder.names()  # staged: the producer WRITEs
    assert wait_for(t, "p", {taken})[0] == {taken}  # (also serves the producer's warm-up)
    assert t.staging_usage()["free"] == 4
    again = t.read_blocks("p", [3, 4], [3, 4])  # the same read fits once room is free
    assert wait_for(t, "p", {again})[0] == {again}
    producer.close()


def test_staging_options_are_validated() -> None:
    from p2pkv.contracts import DataSettings

    bad: list[tuple[dict[str, Any], str]] = [
        ({"staging": "sometimes"}, "'staging'"),
        ({"staging_blocks": 0}, "'staging_blocks'"),
        ({"staging_blocks": 2.5}, "'staging_blocks'"),
    ]
    for options, key in bad:
        with pytest.raises(ConfigError, match=key):
            NixlDataTransport.create(DataSettings(memoryview(bytearray(8192)), 4096, options))


def _poll_quietly(transport: NixlDataTransport, peer_id: str, seconds: float) -> None:
    """Poll ``peer_id`` throughout a bounded window of ``seconds``, yielding the CPU a
    millisecond between polls; fails if anything is reported."""
    pause = threading.Event()  # never set: a bounded yield, not a wait for anything
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        result = transport.poll(peer_id)
        assert not result.done and not result.failed, f"an ended read was reported: {result}"
        pause.wait(0.001)


def test_a_cancelled_staged_read_never_lands_when_the_stopped_producer_resumes(
    make_local: MakeLocal, tcp_host: PeerHost, wait_for: WaitFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """UCX_TLS=tcp on both sides. A 64 MiB read is posted, the producer is SIGSTOPped right
    after, the read cancelled and our slots filled with a canary. Once the producer resumes,
    the read's bytes keep arriving (NIXL cannot stop it) but only into the quarantined pool
    blocks: the canary survives, nothing is reported, and the blocks come back to the pool
    once NIXL reports the read ended."""
    monkeypatch.setenv("UCX_TLS", "tcp")  # before our agent exists
    blocks, block_len = 64, MiB
    consumer = make_local(num_blocks=blocks, block_len=block_len, staging_blocks=blocks)
    t = consumer.transport
    producer = tcp_host.data_peer(NixlDataTransport, blocks, block_len, {})
    producer.fill(23)
    source = _source(producer, block_len)
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())
    assert t.lane("p") == "staged"
    warm = t.read_blocks("p", [0], [1])  # the connection is wired up and works
    assert wait_for(t, "p", {warm})[0] == {warm}
    np.testing.assert_array_equal(consumer.blocks[0], source[1])

    every = list(range(blocks))
    big = t.read_blocks("p", every, every)
    tcp_host.pause()
    try:
        assert not t.poll("p").done, "the 64 MiB read finished before the producer stopped"
        assert t.cancel([big]) is None
        assert t.staging_usage()["quarantined"] == blocks
        consumer.blocks[:] = CANARY
    finally:
        tcp_host.resume()
    _poll_quietly(t, "p", 2.0)
    assert (consumer.blocks == CANARY).all(), "a cancelled staged read landed in the slots"

    wait_until(
        lambda: t.staging_usage()["quarantined"] == 0,
        timeout=30.0,
        what="the quarantined read to end",
        pumps=[t.progress],
    )
    assert t.state.pool is not None
    np.testing.assert_array_equal(t.state.pool.blocks, source)  # it did land: in the pool only
    assert (consumer.blocks == CANARY).all()
    again = t.read_blocks("p", every[::-1], every)  # the pool is whole again
    assert wait_for(t, "p", {again})[0] == {again}
    np.testing.assert_array_equal(consumer.blocks[::-1], source)
    producer.close()


def test_control_without_staging_a_cancelled_tcp_read_does_land(
    make_local: MakeLocal, tcp_host: PeerHost, wait_for: WaitFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Why staging exists (and a check that the test above can fail): the same cancelled read
    with ``staging: never`` lands in the slots once the producer resumes, although its handle
    was released. Should UCX ever stop such a read, this fails and says so."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    blocks, block_len = 64, MiB
    consumer = make_local(num_blocks=blocks, block_len=block_len, staging="never")
    t = consumer.transport
    producer = tcp_host.data_peer(NixlDataTransport, blocks, block_len, {})
    producer.fill(29)
    t.add_peer("p", producer.descriptor)
    warm = t.read_blocks("p", [0], [0])
    assert wait_for(t, "p", {warm})[0] == {warm}

    every = list(range(blocks))
    big = t.read_blocks("p", every, every)
    tcp_host.pause()
    try:
        assert not t.poll("p").done, "the 64 MiB read finished before the producer stopped"
        t.cancel([big])
        consumer.blocks[:] = CANARY
    finally:
        tcp_host.resume()
    wait_until(
        lambda: not (consumer.blocks == CANARY).all(),
        timeout=15.0,
        what="the released read's bytes to land anyway",
        pumps=[t.progress],
    )
    producer.close()


def test_a_producer_refuses_the_staged_requests_of_a_peer_it_removed(
    make_local: MakeLocal, tcp_host: PeerHost, wait_for: WaitFor, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The producer dropped us (its session ended: we were paused, or cut off) and our
    requests arrive afterwards: they are answered "failed" at once, so a live read fails and
    a cancelled one's quarantined blocks come back to the pool, instead of staying
    quarantined for the transport's lifetime. Re-adding us serves again."""
    monkeypatch.setenv("UCX_TLS", "tcp")
    consumer = make_local(num_blocks=16, block_len=4096, staging_blocks=8)
    t = consumer.transport
    producer = tcp_host.data_peer(NixlDataTransport, 16, 4096, {})
    t.add_peer("p", producer.descriptor)
    producer.add_peer("c", t.descriptor())
    warm = t.read_blocks("p", [0], [1])
    assert wait_for(t, "p", {warm})[0] == {warm}
    producer.remove_peer("c")

    live = t.read_blocks("p", [1, 2], [1, 2])
    assert wait_for(t, "p", {live}) == (set(), {live})  # refused, not left hanging
    cancelled = t.read_blocks("p", [3, 4, 5], [3, 4, 5])
    assert t.cancel([cancelled]) is None
    wait_until(
        lambda: t.staging_usage()["quarantined"] == 0,
        timeout=30.0,
        what="the refused request's quarantine to end",
        pumps=[t.progress],
    )
    assert t.staging_usage() == {"capacity": 8, "free": 8, "quarantined": 0}

    producer.add_peer("c", t.descriptor())  # a new session: served again
    again = t.read_blocks("p", [6, 7], [6, 7])
    assert wait_for(t, "p", {again})[0] == {again}
    producer.close()
