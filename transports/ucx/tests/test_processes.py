"""The ``ucx`` transport between two processes (real ucxx over loopback): byte-exact moves,
peers that die or fall silent, and close ordering. The peer lives in a
:class:`~p2pkv.testing.peers.PeerHost` child that keeps progressing between calls; every wait
is bounded."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from p2pkv.testing.peers import ChildDataPeer, PeerHost
from p2pkv.testing.waiting import wait_until
from p2pkv_ucx import UcxDataTransport
from ucx_helpers import FAST, Node, T

KiB = 1024


class Remote:
    """A child-process transport and what its ``poll('local')`` reported."""

    def __init__(self, peer: ChildDataPeer) -> None:
        self.peer = peer
        self.done: set[int] = set()
        self.failed: set[int] = set()

    def poll(self) -> None:
        result = self.peer.poll("local")
        self.done.update(result.done)
        self.failed.update(result.failed)

    def blocks(self) -> np.ndarray:
        return np.frombuffer(self.peer.region_bytes(), np.uint8).reshape(
            self.peer.num_blocks, self.peer.block_len)


@pytest.fixture
def host() -> Iterator[PeerHost]:
    with PeerHost(name="p2pkv-ucx-peer") as h:
        yield h


def _connect(host: PeerHost, num_blocks: int, block_len: int, **options: object
             ) -> tuple[Node, Remote]:
    opts = {**FAST, **options}
    local = Node(num_blocks=num_blocks, block_len=block_len, seed=3, **opts)
    remote = Remote(host.data_peer(UcxDataTransport, num_blocks, block_len, opts))
    remote.peer.fill(4)
    local.t.add_peer("child", remote.peer.descriptor)
    remote.peer.add_peer("local", local.t.descriptor())
    return local, remote


def _sees_round(local: Node, slots: list[int]) -> None:
    """Wait until our transport holds the child's EXPECT for ``slots`` (a fetch would follow)."""
    gens = local.t._peers["child"].slot_gen  # type: ignore[attr-defined]
    wait_until(lambda: gens[slots].all(), timeout=T, what="the child's EXPECT",
               pumps=[local.t.progress])


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
@pytest.mark.parametrize("direction", ["we-write", "child-writes"])
def test_256_scattered_blocks_land_byte_exact(
    host: PeerHost, direction: str, error_handling: bool
) -> None:
    n, b = 512, 64 * KiB
    local, remote = _connect(host, n, b, endpoint_error_handling=error_handling)
    rng = np.random.default_rng(7)
    src, dst = rng.permutation(n)[:256].tolist(), rng.permutation(n)[:256].tolist()
    try:
        if direction == "we-write":
            before = remote.blocks()
            eid = remote.peer.expect_blocks("local", dst)
            tid = local.t.write_blocks("child", src, dst)
            wait_until(lambda: tid in local.done and eid in remote.done, timeout=T,
                       what="256 blocks into the child", pumps=[local.poll, remote.poll])
            sent, after = local.blocks, remote.blocks()
        else:
            before = local.blocks.copy()
            sent = remote.blocks()
            eid = local.t.expect_blocks("child", dst)
            tid = remote.peer.write_blocks("local", src, dst)
            wait_until(lambda: eid in local.done and tid in remote.done, timeout=T,
                       what="256 blocks from the child", pumps=[local.poll, remote.poll])
            after = local.blocks
        assert not local.failed and not remote.failed
        assert (after[dst] == sent[src]).all(), "a block did not land byte-exact"
        others = sorted(set(range(n)) - set(dst))
        assert (after[others] == before[others]).all(), "a block not written changed"
    finally:
        assert local.t.close() == []


def test_a_killed_peer_fails_our_transfers_both_ways(host: PeerHost) -> None:
    """Endpoint error handling (the default): SIGKILL ends our sends and receives with an
    error, without ``remove_peer``."""
    local, remote = _connect(host, 64, 1024 * KiB)
    theirs, ours = list(range(48)), list(range(48, 64))
    eid = local.t.expect_blocks("child", theirs)
    remote.peer.expect_blocks("local", ours)
    _sees_round(local, ours)
    remote.peer.write_blocks("local", theirs, theirs)  # 48 MiB towards us, we do not pump
    host.pause()  # frozen mid-way: neither direction can finish
    tid = local.t.write_blocks("child", list(range(16)), ours)
    host.kill()
    wait_until(lambda: {eid, tid} <= local.failed, timeout=T,
               what="both transfers to fail after the kill", pumps=[local.poll])
    assert not local.done
    assert local.t.remove_peer("child") == []
    assert local.t.close() == []


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
def test_remove_peer_bounds_a_silent_peer(host: PeerHost, error_handling: bool) -> None:
    """A SIGSTOPped peer (no UCX error in either mode): ``remove_peer`` stops our pending
    expectation at once and hands back the send UCX cannot finish; the next poll fails it."""
    local, remote = _connect(host, 64, 256 * KiB, endpoint_error_handling=error_handling)
    ours = list(range(32))
    eid = local.t.expect_blocks("child", [40, 41])  # the child never writes it
    remote.peer.expect_blocks("local", ours)
    _sees_round(local, ours)
    host.pause()
    tid = local.t.write_blocks("child", ours, ours)
    for _ in range(20):
        local.poll("child")
    assert tid not in local.done | local.failed
    assert local.t.remove_peer("child") == [tid]
    local.poll("child")
    assert tid in local.failed and eid not in local.done | local.failed
    host.kill()


def test_a_dead_peer_without_error_handling_fails_at_the_deadline(host: PeerHost) -> None:
    """Without endpoint error handling UCX never ends a send to a dead peer: the transfer
    deadline does, with nobody calling ``remove_peer``."""
    local, remote = _connect(host, 64, 256 * KiB, endpoint_error_handling=False,
                             transfer_timeout=1.5)
    ours = list(range(32))
    eid = local.t.expect_blocks("child", [40])
    remote.peer.expect_blocks("local", ours)
    _sees_round(local, ours)
    host.pause()
    tid = local.t.write_blocks("child", ours, ours)
    host.kill()
    wait_until(lambda: {eid, tid} <= local.failed, timeout=T,
               what="the deadline to fail both", pumps=[local.poll])
    assert local.t.close() == [tid], "the orphaned send must be reported by close"


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
def test_close_keeps_the_region_while_a_send_is_in_flight(
    host: PeerHost, error_handling: bool
) -> None:
    local, remote = _connect(host, 64, 256 * KiB, endpoint_error_handling=error_handling)
    ours = list(range(32))
    remote.peer.expect_blocks("local", ours)
    _sees_round(local, ours)
    host.pause()
    tid = local.t.write_blocks("child", ours, ours)
    region = weakref.ref(local.array)
    assert local.t.close() == [tid]
    assert local.t.close() == [tid], "a second close repeats the undrained ids"
    del local.array, local.blocks
    gc.collect()
    assert region() is not None, "the region was released under an unfinished send"
    host.kill()


def test_close_waits_for_transfers_that_drain(host: PeerHost) -> None:
    local, remote = _connect(host, 64, 256 * KiB, drain_timeout=5.0)
    ours = list(range(32))
    remote.peer.expect_blocks("local", ours)
    _sees_round(local, ours)
    local.t.write_blocks("child", ours, ours)
    region = weakref.ref(local.array)
    assert local.t.close() == [], "a healthy peer drains within the drain timeout"
    del local.array, local.blocks
    gc.collect()
    assert region() is None, "close returned [] but kept the region"
