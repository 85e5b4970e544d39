"""What a hub costs at fleet scale, as work done, never time: a sweep with 1,000 quiet
connections examines what it examines with 10; pending dials cost no socket per repeated
request; ``progress`` tells a dial that reached a listener from one that did not; a dial
that never connected closes without lingering; and ``take_active`` names exactly the
connections with news.

The quiet connections are real dials to one raw pyzmq PULL bound on many loopback ports
(each dial completes its ZMTP handshake, then nothing is sent: heartbeats are libzmq's). A
black hole is a TCP listener whose accept queue is full: the kernel drops further SYNs.
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Callable, Iterator
from types import FrameType
from typing import Any

import pytest
import zmq
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq import dialing

T = 30.0  # generous: a thousand handshakes on a busy 2-core machine
SWEEPS = 40
WORK_FACTOR = 1.5
"""What a sweep with 1,000 quiet connections may cost over one with 10: the Python calls it
makes, and the sockets and timers it examines (measured: 21 calls and none examined, at
both sizes; the hub before the split examined every watched socket: 11 and 1,001)."""


@pytest.fixture
def raw_pull() -> Iterator[tuple[zmq.Socket[bytes], Callable[[], str]]]:
    """A raw PULL and ``bind()``: a fresh loopback address it listens on."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.linger = 0

    def bind() -> str:
        port = pull.bind_to_random_port("tcp://127.0.0.1")
        return f"127.0.0.1:{port}"

    try:
        yield pull, bind
    finally:
        ctx.destroy(0)


@pytest.fixture
def black_hole() -> Iterator[str]:
    """A loopback address that drops SYNs: a listener whose accept queue one connection
    fills."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(0)
        address = listener.getsockname()
        with socket.create_connection(address):
            yield f"{address[0]}:{address[1]}"


def _quiet(make_transport: Any, bind: Callable[[], str], count: int) -> Any:
    """A transport with ``count`` dials that completed their handshake and stay quiet."""
    t = make_transport(max_sockets=8 * count + 64)
    conns = [t.connect(bind()) for _ in range(count)]
    wait_until(
        lambda: all(c.progress == "ready" for c in conns),
        timeout=T,
        what=f"{count} handshakes",
        pumps=[lambda: t.poll(0.01)],
    )
    assert all(c.alive for c in conns)
    return t


def _work_per_sweep(t: Any) -> tuple[float, float]:
    """(Python calls, sockets and timers examined) per sweep over ``SWEEPS`` sweeps."""
    poller = t._hub.poller
    calls = 0

    def count(frame: FrameType, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    wait_until(
        lambda: poller.sweeps, timeout=T, what="a first sweep", pumps=[lambda: t.poll(0.02)]
    )  # the dials' fresh monitors visited
    sweeps, work = poller.sweeps, poller.readiness.work
    sys.setprofile(count)
    try:
        while poller.sweeps - sweeps < SWEEPS:
            t.poll(0.02)  # an idle wait: one sweep when it ends
    finally:
        sys.setprofile(None)
    done = poller.sweeps - sweeps
    return calls / done, (poller.readiness.work - work) / done


def test_a_sweep_costs_the_same_with_1000_quiet_connections_as_with_10(
    make_transport: Any, raw_pull: Any
) -> None:
    _, bind = raw_pull
    small = _work_per_sweep(_quiet(make_transport, bind, 10))
    large = _work_per_sweep(_quiet(make_transport, bind, 1000))
    assert large[0] <= small[0] * WORK_FACTOR, f"calls per sweep: {small[0]} -> {large[0]}"
    assert large[1] <= small[1] * WORK_FACTOR + 1, f"examined per sweep: {small} -> {large}"


def test_progress_tells_a_listener_from_a_black_hole_and_a_refusal(
    make_transport: Any, raw_pull: Any, black_hole: str, refused_address: str
) -> None:
    _, bind = raw_pull
    t = make_transport(connect_timeout=60.0, handshake_timeout=60.0)
    with socket.socket() as mute:  # accepts TCP, never speaks ZMTP
        mute.bind(("127.0.0.1", 0))
        mute.listen(8)
        ready, hole, silent = (
            t.connect(bind()),
            t.connect(black_hole),
            t.connect(f"127.0.0.1:{mute.getsockname()[1]}"),
        )
        refused = t.connect(refused_address)
        wait_until(
            lambda: (
                ready.progress == "ready" and silent.progress == "connected" and not refused.alive
            ),
            timeout=T,
            what="the dials' outcomes",
            pumps=[lambda: t.poll(0.01)],
        )
        assert hole.progress == "dialing" and hole.alive
        assert refused.progress == "dialing" and "refused" in (refused.close_reason or "")
        assert silent.alive


def test_requests_to_a_pending_or_failed_dial_open_no_socket(
    make_transport: Any,
    black_hole: str,
    refused_address: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """However often a caller asks for a black-holed or refusing address, the hub holds one
    dial at most: repeated requests open no socket and no descriptor."""
    monkeypatch.setattr(dialing, "DIAL_BACKOFF", 600.0)  # the refusal stays remembered
    t = make_transport(connect_timeout=600.0)
    hole = t.connect(black_hole)
    refused = t.connect(refused_address)
    wait_until(
        lambda: not refused.alive, timeout=T, what="the refusal", pumps=[lambda: t.poll(0.01)]
    )
    live, fds = t.stats()["connections"], _descriptors()
    again = [t.connect(address) for _ in range(200) for address in (black_hole, refused_address)]
    assert all(c is hole for c in again[::2])
    assert not any(c.alive for c in again[1::2])
    assert t.stats()["connections"] == live == 1
    assert _descriptors() <= fds  # libzmq may still be closing the refused dial's


def test_take_active_names_the_connections_with_news_once(make_transport: Any) -> None:
    a, b = make_transport(), make_transport()
    assert a.take_active() == []
    out = a.connect(b.local_address)
    out.send(b"first")
    inbound: list[Any] = []
    wait_until(
        lambda: inbound.extend(b.poll(0.01)) or inbound,
        timeout=T,
        what="b to accept a's dial",
        pumps=[lambda: a.poll(0.0)],
    )
    conn = inbound[0]
    assert b.take_active() == [conn]  # its first frame is news
    assert b.take_active() == []
    for i in range(3):
        out.send(b"%d" % i)
    calls: list[list[Any]] = []
    frames: list[bytes] = [*conn.recv()]

    def listed(until: Callable[[], bool]) -> Callable[[], bool]:
        def step() -> bool:
            b.poll(0.01)
            news = list(b.take_active() or [])
            calls.append(news)
            frames.extend(conn.recv())
            return until()

        return step

    wait_until(
        listed(lambda: len(frames) == 4), timeout=T, what="the frames", pumps=[lambda: a.poll(0.0)]
    )
    assert frames == [b"first", b"0", b"1", b"2"]
    out.close()
    wait_until(
        listed(lambda: not conn.alive and conn in calls[-1]),
        timeout=T,
        what="news of the peer's close",
        pumps=[lambda: a.poll(0.0)],
    )
    assert all(news in ([], [conn]) for news in calls), calls
    assert sum(1 for news in calls if news) >= 2  # the frames, then the death
    assert b.take_active() == []


def test_a_transport_above_descriptor_1024_polls_and_delivers(make_transport: Any) -> None:
    """A process with many sockets (a tier with hundreds of sessions, or many tiers) gets
    listener descriptors above ``select``'s limit: short polls still wait, and deliver."""
    filler = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        a, b = make_transport(), make_transport()
        assert b._hub.poller._listener_fd >= 1024
        a.connect(b.local_address).send(b"high")
        got: list[Any] = []

        def arrived() -> bool:
            for _ in range(20):
                got.extend(b.poll(0.0004))  # under a millisecond: the short wait
            return bool(got)

        wait_until(arrived, timeout=T, what="the frame", pumps=[lambda: a.poll(0.0)])
        assert list(got[0].recv()) == [b"high"]
    finally:
        for fd in filler:
            os.close(fd)


def _descriptors() -> int:
    return len(os.listdir("/proc/self/fd"))


class _ClosedWith:
    """Stands in for a connection's PUSH and records the linger its ``close`` got."""

    def __init__(self, push: Any) -> None:
        self._push = push
        self.linger: int | None = None

    def close(self, linger: int | None = None) -> None:
        self.linger = linger
        self._push.close(linger)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._push, name)


def test_a_dial_that_never_connected_closes_without_lingering(
    make_transport: Any,
    raw_pull: Any,
    black_hole: str,
) -> None:
    """A dial closed before it connected tells its peer nothing (the peer never saw it) and
    closes at once: a flood of such dials, each closed for the next, must not keep its
    sockets lingering (they count in ``max_sockets``). A connected one lingers to deliver
    its last message."""
    _, bind = raw_pull
    t = make_transport(connect_timeout=600.0)
    hole, ready = t.connect(black_hole), t.connect(bind())
    wait_until(
        lambda: ready.progress == "ready",
        timeout=T,
        what="the handshake",
        pumps=[lambda: t.poll(0.01)],
    )
    assert hole.progress == "dialing"
    spies = [_ClosedWith(conn.out) for conn in (hole, ready)]
    hole.out, ready.out = spies
    hole.close()
    ready.close()
    assert spies[0].linger == 0
    assert spies[1].linger is not None and spies[1].linger > 0
