"""The ``ucx`` transport between two processes (real ucxx over loopback): byte-exact reads in
both directions, cancelled reads that stay cancelled when a paused producer resumes, peers
that die or fall silent, and close ordering. The peer is a
:func:`ucx_programs.data_node` child that keeps calling ``progress()`` like a serving
process; every wait is bounded."""

from __future__ import annotations

import gc
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import ucx_programs
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from ucx_helpers import FAST, Node, T

KiB = 1024
MiB = 1024 * KiB
CANARY = 0xA5
LANES = [
    pytest.param(True, None, id="eh-on"),
    pytest.param(True, "tcp", id="eh-on-tls-tcp"),
    pytest.param(False, None, id="eh-off"),
    pytest.param(False, "tcp", id="eh-off-tls-tcp"),
]
"""(endpoint error handling, UCX_TLS of both sides' contexts): eh-on rides TCP on one host
anyway; eh-off takes CMA unless TLS says tcp."""


class Remote:
    """A :func:`ucx_programs.data_node` child: its transport, called over the pipe."""

    def __init__(self, child: Child, num_blocks: int, block_len: int) -> None:
        self.child = child
        self.num_blocks, self.block_len = num_blocks, block_len
        self.descriptor: bytes = child.recv(T, "the child's descriptor")
        self.done: set[int] = set()
        self.failed: set[int] = set()

    def call(self, name: str, *args: Any) -> Any:
        status, value = self.child.request((name, *args), T, f"a reply to {name}")
        if status != "ok":
            raise AssertionError(f"child {name}: {value}")
        return value

    def poll(self) -> None:
        done, failed = self.call("poll", "local")
        self.done.update(done)
        self.failed.update(failed)

    def blocks(self) -> np.ndarray:
        return np.frombuffer(self.call("region"), np.uint8).reshape(self.num_blocks, self.block_len)


Spawn = Callable[..., tuple[Node, Remote]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """``spawn(num_blocks, block_len, **options)``: our Node and a linked child (both sides
    get the same options); the child is resumed and stopped, our transport closed, at the end."""
    made: list[tuple[Node, Child]] = []

    def make(num_blocks: int, block_len: int, **options: Any) -> tuple[Node, Remote]:
        opts = {**FAST, **options}
        child = Child(
            ucx_programs.data_node, num_blocks, block_len, 4, opts, name="p2pkv-ucx-peer"
        ).start()
        local = Node(num_blocks=num_blocks, block_len=block_len, seed=3, **opts)
        made.append((local, child))
        remote = Remote(child, num_blocks, block_len)
        local.t.add_peer("child", remote.descriptor)
        remote.call("add_peer", "local", local.t.descriptor())
        return local, remote

    yield make
    for local, child in made:
        child.resume()
        child.stop()
        local.t.close()


def _options(error_handling: bool, tls: str | None) -> dict[str, Any]:
    return {
        "endpoint_error_handling": error_handling,
        **({"ucx_config": {"TLS": tls}} if tls else {}),
    }


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
@pytest.mark.parametrize("direction", ["we-read", "child-reads"])
def test_256_scattered_blocks_land_byte_exact(
    spawn: Spawn, direction: str, error_handling: bool
) -> None:
    n, b = 512, 64 * KiB
    local, remote = spawn(n, b, endpoint_error_handling=error_handling)
    rng = np.random.default_rng(7)
    src, dst = rng.permutation(n)[:256].tolist(), rng.permutation(n)[:256].tolist()
    if direction == "we-read":
        before, sent = local.blocks.copy(), remote.blocks()
        tid = local.t.read_blocks("child", dst, src)
        wait_until(
            lambda: tid in local.done,
            timeout=T,
            what="256 blocks from the child",
            pumps=[local.poll],
        )
        after = local.blocks
    else:
        before, sent = remote.blocks(), local.blocks
        tid = remote.call("read", "local", dst, src)
        wait_until(
            lambda: tid in remote.done,
            timeout=T,
            what="256 blocks into the child",
            pumps=[local.t.progress, remote.poll],
        )
        after = remote.blocks()
    assert not local.failed and not remote.failed
    assert (after[dst] == sent[src]).all(), "a block did not land byte-exact"
    others = sorted(set(range(n)) - set(dst))
    assert (after[others] == before[others]).all(), "a block not read changed"
    assert local.t.close() == [], "nothing of ours is left in flight"


ATTEMPTS = 10
"""Reads the cancel test posts, at most, to catch one mid-transfer."""


@pytest.mark.parametrize("error_handling, tls", LANES)
def test_a_read_cancelled_mid_transfer_stays_cancelled_when_its_producer_resumes(
    spawn: Spawn, error_handling: bool, tls: str | None
) -> None:
    """The producer is SIGSTOPped with runs of the read on the way (matched receives that UCX
    cannot stop, over TCP; or some landed and the rest to come, over CMA, whose receives
    complete inside our own progress); we cancel, fill the slots with a canary, resume it and
    keep polling for two seconds: whatever UCX still delivers must not reach the slots."""
    local, remote = spawn(
        128, 1 * MiB, coalesce=False, staging_bytes=4 * MiB, **_options(error_handling, tls)
    )
    slots = list(range(16, 112))  # 96 runs: 24 times what staging takes at once (a long read)
    src = np.random.default_rng(1).permutation(128)[:96].tolist()
    receiving = local.t.state.receiving
    over_tcp = error_handling or tls == "tcp"  # else CMA: nothing stays matched-unfinished
    for _attempt in range(ATTEMPTS):  # on a loaded host the read may finish before the pause
        tid = local.t.read_blocks("child", slots, src)
        read = local.t.read_handle(tid)

        def on_its_way(read: Any = read) -> int:
            return sum(1 for r in receiving if r.read is read and not r.request.completed)

        def started(read: Any = read, on_its_way: Any = on_its_way) -> bool:
            return bool(read.ended or (on_its_way() if over_tcp else read.landed))

        wait_until(
            started, timeout=T, what="runs of the read to be on their way", pumps=[local.t.progress]
        )
        remote.child.pause()
        if not read.ended:
            break
        remote.child.resume()

        def ended(tid: int = tid) -> bool:
            return tid in local.done | local.failed

        wait_until(ended, timeout=T, what="the read that finished too early", pumps=[local.poll])
    if read.ended:  # the host, not the transport: nothing could be cancelled mid-transfer
        pytest.skip(f"the read ended before the pause in {ATTEMPTS} tries: a loaded host")
    in_flight = on_its_way()
    assert in_flight or not over_tcp, "the case UCX cannot cancel was not reached"
    local.t.cancel([tid])
    local.blocks[slots] = CANARY
    remote.child.resume()
    until = time.monotonic() + 2.0
    while time.monotonic() < until:  # bounded: two seconds of the producer running again
        local.poll()
    assert tid not in local.done | local.failed, "a cancelled read was reported"
    assert (local.blocks[slots] == CANARY).all(), (
        f"bytes of the cancelled read reached its slots ({in_flight} matched runs were "
        f"still being received at the cancel)"
    )
    wait_until(
        lambda: not local.t.state.receiving,
        timeout=T,
        what="the cancelled read's runs to end in staging",
        pumps=[local.poll],
    )
    again = local.t.read_blocks("child", slots, src)
    wait_until(
        lambda: again in local.done,
        timeout=T,
        what="a new read of the same slots",
        pumps=[local.poll],
    )
    assert (local.blocks[slots] == remote.blocks()[src]).all()


@pytest.mark.parametrize("error_handling, tls", LANES[:2])
def test_a_read_cancelled_before_its_producer_served_it_never_lands(
    spawn: Spawn, error_handling: bool, tls: str | None
) -> None:
    """Read and cancel while the producer is stopped: nothing of the read has matched yet.
    Resumed, it finds READ and CANCEL (it may still serve the READ if they arrive in two
    batches: then its runs are drained); the canary stays."""
    local, remote = spawn(64, 256 * KiB, **_options(error_handling, tls))
    slots, src = list(range(32)), list(range(32, 64))
    remote.child.pause()
    tid = local.t.read_blocks("child", slots, src)
    for _ in range(50):
        local.poll()
    local.t.cancel([tid])
    local.blocks[slots] = CANARY
    remote.child.resume()
    until = time.monotonic() + 2.0
    while time.monotonic() < until:
        local.poll()
    assert tid not in local.done | local.failed
    assert (local.blocks[slots] == CANARY).all(), "a read cancelled before it matched landed"
    again = local.t.read_blocks("child", slots, src)
    wait_until(lambda: again in local.done, timeout=T, what="the next read", pumps=[local.poll])
    assert (local.blocks[slots] == remote.blocks()[src]).all()


def _serve_to_paused_child(spawn: Spawn, **options: Any) -> tuple[Node, Remote]:
    """The child reads 8 MiB from us and is stopped as soon as we posted the sends serving it
    (they cannot finish without our next progress, and then the child takes no payload)."""
    local, remote = spawn(64, 256 * KiB, **options)
    remote.call("read", "local", list(range(32)), list(range(32)))
    wait_until(
        lambda: local.t.state.serves,
        timeout=T,
        what="us to serve the child's read",
        pumps=[local.t.progress],
    )
    remote.child.pause()
    return local, remote


def test_a_killed_peer_fails_our_read_and_ends_our_sends(spawn: Spawn) -> None:
    """Endpoint error handling (the default): SIGKILL fails our read from the child with an
    error, without ``remove_peer``, and ends the sends serving its read of us."""
    local, remote = _serve_to_paused_child(spawn)
    tid = local.t.read_blocks("child", [40, 41], [1, 2])
    remote.child.kill()
    wait_until(
        lambda: tid in local.failed,
        timeout=T,
        what="our read to fail after the kill",
        pumps=[local.poll],
    )
    assert not local.done
    assert local.t.remove_peer("child") == []
    assert local.t.close() == []


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
def test_remove_peer_bounds_a_silent_peer(spawn: Spawn, error_handling: bool) -> None:
    """A SIGSTOPped peer (no UCX error in either mode): ``remove_peer`` ends our read from it
    at once (never reported) and hands back the sends serving its read that cannot finish."""
    local, _ = _serve_to_paused_child(spawn, endpoint_error_handling=error_handling)
    tid = local.t.read_blocks("child", [40, 41], [1, 2])
    for _ in range(20):
        local.poll("child")
    kept = local.t.remove_peer("child")
    assert kept and tid not in kept, "the serving sends are handed back, never our read"
    for _ in range(5):
        local.poll("child")
    assert tid not in local.done | local.failed and not set(kept) & (local.done | local.failed)


def test_a_dead_peer_without_error_handling_fails_at_the_deadline(spawn: Spawn) -> None:
    """Without endpoint error handling UCX never ends a transfer with a dead peer: the
    transfer deadline fails our read, and close reports the send it gave up on."""
    local, remote = _serve_to_paused_child(
        spawn, endpoint_error_handling=False, transfer_timeout=1.5
    )
    tid = local.t.read_blocks("child", [40], [40])
    remote.child.kill()
    wait_until(
        lambda: tid in local.failed,
        timeout=T,
        what="the deadline to fail our read",
        pumps=[local.poll],
    )
    kept = local.t.close()
    assert kept and tid not in kept, "the orphaned send must be reported by close"


@pytest.mark.parametrize("error_handling", [True, False], ids=["eh-on", "eh-off"])
def test_close_keeps_the_region_while_a_send_is_in_flight(
    spawn: Spawn, error_handling: bool
) -> None:
    local, remote = _serve_to_paused_child(spawn, endpoint_error_handling=error_handling)
    region = weakref.ref(local.array)
    kept = local.t.close()
    assert kept, "a send serving a paused peer cannot drain"
    assert local.t.close() == [], "a second close returns []"
    del local.array, local.blocks
    gc.collect()
    assert region() is not None, "the region was released under an unfinished send"
    remote.child.kill()


def test_close_after_the_sends_drained_keeps_nothing(spawn: Spawn) -> None:
    """The stopped child resumes and takes its payload. ``close`` drains for ``DRAIN_GRACE``
    at most, which a resumed process on a loaded machine may need longer for, so the test
    waits for the sends to drain itself; then ``close`` keeps nothing, the region included."""
    local, remote = _serve_to_paused_child(spawn)
    remote.child.resume()
    wait_until(
        lambda: not local.t.state.serves,
        timeout=T,
        what="the sends serving the resumed child to drain",
        pumps=[local.t.progress],
    )
    region = weakref.ref(local.array)
    assert local.t.close() == [], "nothing was left to drain"
    del local.array, local.blocks
    gc.collect()
    assert region() is None, "close returned [] but kept the region"
