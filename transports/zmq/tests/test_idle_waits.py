"""Long polls: an idle hub waits on every socket at once (not a sweep every 10 ms), and still
wakes for whatever a socket brings: a first frame, a frame, a peer's "gone", a connection
whose peer vanished (its monitor's event); for ``interrupt`` from another thread; and a
tier ticking with a long timeout still keeps its own deadlines.

Each poll here waits up to ``LONG`` seconds and must end at the event, well before; the
test's timeout (``GUARD``) fails a poll that sleeps through it, so nothing asserts time. The
peer acts from another thread ``LATER`` seconds into the wait (each transport has a context
of its own, used by one thread at a time), so the event lands while the poll waits; one
that lands before would make a test weaker, never fail it."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

import pytest
from p2pkv.config import TierConfig
from p2pkv.tier import P2PTier
from zmq_fixtures import MakeTransport

LONG = 120.0
"""A poll's timeout: far beyond ``GUARD``, so only the event can end it in time."""
GUARD = 60.0
"""Seconds each test may take (pytest-timeout), including its fixtures."""
POLLS = 20
"""Long polls a test allows for its event (each ends at some socket's activity)."""
LATER = 0.3
"""Seconds into the long polls at which the peer acts."""

pytestmark = pytest.mark.timeout(GUARD)


def long_polls_until(transport: Any, done: Any, what: str) -> list[Any]:
    """Long polls of ``transport`` until ``done(accepted)`` (called after each poll with the
    connections the polls returned so far); those connections."""
    accepted: list[Any] = []
    for _ in range(POLLS):
        accepted.extend(transport.poll(LONG))
        if done(accepted):
            return accepted
    raise AssertionError(f"{what}: not seen in {POLLS} long polls")


@contextmanager
def later(action: Callable[[], object]) -> Iterator[None]:
    """Run ``action`` in a thread ``LATER`` seconds from now; joined on exit."""
    thread = threading.Timer(LATER, action)
    thread.start()
    try:
        yield
    finally:
        thread.cancel()
        thread.join(GUARD)


def established(make_transport: MakeTransport) -> tuple[Any, Any, Any, Any]:
    """``a`` dialed ``b``, both waiting in long polls only: a's connection and b's, after
    a frame each way."""
    a, b = make_transport(), make_transport()
    out = a.connect(b.local_address)
    out.send(b"hello")
    accepted = long_polls_until(b, bool, "the inbound connection")
    assert len(accepted) == 1 and list(accepted[0].recv()) == [b"hello"]
    inbound = accepted[0]
    inbound.send(b"back")
    got: list[bytes] = []
    long_polls_until(a, lambda _: got.extend(out.recv()) or got, "a's first frame back")
    assert got == [b"back"]
    return a, b, out, inbound


def test_a_long_poll_returns_a_new_peer_with_its_first_frame(make_transport: MakeTransport) -> None:
    established(make_transport)


def test_a_long_poll_returns_at_each_frame(make_transport: MakeTransport) -> None:
    _, b, out, inbound = established(make_transport)
    got: list[bytes] = []
    for i in range(3):

        def arrived(_: object, n: int = i + 1) -> bool:
            got.extend(inbound.recv())
            return len(got) >= n

        with later(partial(out.send, b"frame-%d" % i)):
            long_polls_until(b, arrived, f"frame {i}")
    assert got == [b"frame-%d" % i for i in range(3)]


def test_a_long_poll_sees_the_peer_close_the_connection(make_transport: MakeTransport) -> None:
    _, b, out, inbound = established(make_transport)
    with later(out.close):
        long_polls_until(b, lambda _: not inbound.alive, "the peer's close")


def test_a_long_poll_sees_the_peer_transport_vanish(make_transport: MakeTransport) -> None:
    a, b, _, inbound = established(make_transport)
    with later(a.close):  # no "gone" on its connections: b's monitors tell
        long_polls_until(b, lambda _: not inbound.alive, "the peer's disconnect")


def test_an_interrupt_from_another_thread_ends_a_long_poll(make_transport: MakeTransport) -> None:
    _, b, _, _ = established(make_transport)
    for _ in range(3):  # each interrupt ends one wait; a poll returns nothing new
        with later(b.interrupt):
            assert b.poll(LONG) == ()


def test_an_interrupt_before_a_poll_ends_that_poll(make_transport: MakeTransport) -> None:
    _, b, _, _ = established(make_transport)
    b.interrupt()
    b.interrupt()  # pending interrupts are one
    assert b.poll(LONG) == ()
    b.close()
    b.interrupt()  # after close: nothing, no error


def test_a_long_tick_keeps_the_tiers_deadlines() -> None:
    """A tier ticking with a timeout far past its next deadline (a handshake that a silent
    listener never answers) still fires that deadline on time: the session closes."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        config = TierConfig.from_dict(
            {
                "control": "zmq",
                "data": "memory",
                "host": "127.0.0.1",
                "port": 0,
                "timeouts": {"handshake": 0.5},
                "control_options": {"connect_timeout": 600, "handshake_timeout": 600},
            }
        )
        tier = P2PTier(config, memoryview(bytearray(4096)), 256)
        try:
            assert tier.connect(f"127.0.0.1:{silent.getsockname()[1]}")
            for _ in range(POLLS):
                tier.tick(LONG)
                if tier.stats()["sessions"] == 0:
                    break
            assert tier.stats()["sessions"] == 0, "the handshake deadline never fired"
        finally:
            tier.shutdown()
