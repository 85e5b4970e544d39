"""During a flood of dials that reach nothing, a dial checks TCP reach before it builds zmq
sockets (issue 48, item 5; :mod:`p2pkv_zmq.reach`).

The cost is held in counts, never time: zmq dials built (``SocketFactory.dial`` calls) and
reach checks started, per flood name. A refused or black-holed name then builds no zmq
socket, nor does most of a flood's first burst. A healthy peer dialed during the flood is
reached, gets its frames sent before the handshake, and is dialed without a check
afterwards; with CURVE as without. Without a flood, dials are zmq's alone.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import pytest
from p2pkv.contracts import ControlConnection
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq import dialing
from p2pkv_zmq.reach import BURST_DIALS, FLOOD_DIALS, ReachChecks
from p2pkv_zmq.sockets import SocketFactory
from zmq_fixtures import MakeTransport, curve

T = 30.0
FAR = 3600.0
"""``connect_timeout`` and ``handshake_timeout``: no dial here dies of a deadline."""
NAMES = 100
"""Flood names per test."""


class Counts:
    """How many zmq dials and reach checks the hubs of this test started."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.dials = 0
        self.checks = 0
        self.dialed: list[str] = []
        """The address of each zmq dial, in order."""
        dial, start = SocketFactory.dial, ReachChecks.start

        def counted_dial(factory: SocketFactory, *args: Any) -> Any:
            self.dials += 1
            self.dialed.append(args[0])
            return dial(factory, *args)

        def counted_start(checks: ReachChecks, *args: Any) -> Any:
            self.checks += 1
            return start(checks, *args)

        monkeypatch.setattr(SocketFactory, "dial", counted_dial)
        monkeypatch.setattr(ReachChecks, "start", counted_start)


@pytest.fixture
def counts(monkeypatch: pytest.MonkeyPatch) -> Counts:
    return Counts(monkeypatch)


@pytest.fixture
def black_holed() -> Iterator[int]:
    """A port that drops SYNs on every loopback address: a listener whose accept queue one
    connection fills."""
    with socket.socket() as listener:
        listener.bind(("0.0.0.0", 0))
        listener.listen(0)
        port = listener.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)):
            yield port


def flood_host(i: int) -> str:
    """A distinct loopback address for each ``i`` below 65,536."""
    return f"127.9.{i // 256}.{i % 256}"


def refuse(t: Any, port: int, names: int) -> list[str]:
    """Dial ``names`` distinct refusing addresses one after another, each until it is dead;
    their close reasons."""
    reasons = []
    for i in range(names):
        conn = t.connect(f"{flood_host(i)}:{port}")
        wait_until(partial(_dead, conn), timeout=T, what="a refusal", pumps=[lambda: t.poll(0.01)])
        reasons.append(str(conn.close_reason))
    return reasons


def _dead(conn: ControlConnection) -> bool:
    return not conn.alive


def test_a_refused_flood_name_builds_no_zmq_socket_once_the_flood_shows(
    make_transport: MakeTransport, counts: Counts, refusing: int
) -> None:
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    reasons = refuse(t, refusing, NAMES)
    assert all("connection refused" in r for r in reasons), reasons
    assert counts.dials <= FLOOD_DIALS, f"{counts.dials} zmq dials for {NAMES} refused names"
    assert counts.checks == NAMES - counts.dials
    assert t.stats()["connections"] == 0


def test_a_floods_first_burst_builds_few_zmq_sockets(
    make_transport: MakeTransport, counts: Counts, refusing: int
) -> None:
    """A flood of 100 refused names dialed at once, as the tier's first burst of a flood is:
    none has failed yet, so only the unconnected burst shows it. Before the burst rule,
    each name built its PUSH and monitor (100 zmq dials); now the first ``BURST_DIALS``."""
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    conns = [t.connect(f"{flood_host(i)}:{refusing}") for i in range(NAMES)]
    wait_until(
        lambda: not any(c.alive for c in conns),
        timeout=T,
        what="every refusal",
        pumps=[lambda: t.poll(0.01)],
    )
    assert all("connection refused" in str(c.close_reason) for c in conns)
    assert counts.dials == BURST_DIALS, f"{counts.dials} zmq dials for {NAMES} names at once"
    assert counts.checks == NAMES - BURST_DIALS
    assert t.stats()["connections"] == 0


def test_a_dial_without_a_flood_builds_its_zmq_socket_at_once(
    make_transport: MakeTransport, counts: Counts, refusing: int
) -> None:
    """A few refused dials are no flood: every dial is zmq's, with no check."""
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    refuse(t, refusing, FLOOD_DIALS - 1)
    peer = make_transport()
    t.connect(peer.local_address)
    assert (counts.dials, counts.checks) == (FLOOD_DIALS, 0)


def test_during_a_flood_a_healthy_peer_is_reached_with_its_early_frames(
    make_transport: MakeTransport, counts: Counts, refusing: int
) -> None:
    """A healthy peer dialed during a flood is checked, then dialed with zmq. Frames sent
    before its PUSH existed arrive in order; its next dial needs no check."""
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    refuse(t, refusing, 2 * FLOOD_DIALS)
    peer = make_transport()
    checks = counts.checks
    out: Any = t.connect(peer.local_address)
    assert out.alive and out.progress == "dialing"
    frames = [b"first", b"second", b"third"]
    for frame in frames:
        out.send(frame)
    inbound: list[Any] = []
    got: list[bytes] = []

    def arrived() -> bool:
        inbound.extend(peer.poll(0.01))
        for conn in inbound:
            got.extend(conn.recv())
        return len(got) == len(frames)

    wait_until(arrived, timeout=T, what="the early frames", pumps=[lambda: t.poll(0.01)])
    assert got == frames
    assert counts.checks - checks == 1 and counts.dialed.count(peer.local_address) == 1
    out.close()
    again: Any = t.connect(peer.local_address)
    assert again.alive and again.out is not None
    assert counts.checks - checks == 1 and counts.dialed.count(peer.local_address) == 2


def test_a_checked_black_holed_dial_holds_one_descriptor_and_no_zmq_socket(
    make_transport: MakeTransport, counts: Counts, refusing: int, black_holed: int
) -> None:
    """During a flood, black-holed dials that the caller gives up (as the tier evicts them)
    built no zmq socket, and closing them frees every descriptor their checks held."""
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    refuse(t, refusing, 2 * FLOOD_DIALS)
    dials, fds = counts.dials, len(os.listdir("/proc/self/fd"))
    holes: list[Any] = [t.connect(f"127.7.0.{1 + i}:{black_holed}") for i in range(NAMES)]
    for _ in range(5):
        t.poll(0.01)
    assert all(c.alive and c.progress == "dialing" and c.out is None for c in holes)
    assert counts.dials == dials and counts.checks >= NAMES
    assert len(os.listdir("/proc/self/fd")) <= fds + NAMES
    for conn in holes:
        conn.close()
    assert len(os.listdir("/proc/self/fd")) <= fds
    assert t.stats()["connections"] == 0


def test_a_checked_dial_that_is_refused_is_remembered_as_refused(
    make_transport: MakeTransport, counts: Counts, refusing: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refusal a check found backs off like one libzmq reported: the next dial to that
    address is answered from the negative cache, with no check and no socket."""
    monkeypatch.setattr(dialing, "DIAL_BACKOFF", FAR)
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    refuse(t, refusing, 2 * FLOOD_DIALS)
    checks, dials = counts.checks, counts.dials
    again = t.connect(f"{flood_host(2 * FLOOD_DIALS - 1)}:{refusing}")
    assert not again.alive and "remembered from the dial" in str(again.close_reason)
    assert (counts.checks, counts.dials) == (checks, dials)


def test_during_a_flood_a_curve_peer_is_reached_and_counts_no_refused_handshake(
    make_transport: MakeTransport, counts: Counts, refusing: int, keydir: Path
) -> None:
    """The zmq dial after a check has its CURVE keys as ever. The check's own connection,
    reset before any handshake, is no refused handshake at the peer."""
    server = make_transport(options=curve(keydir, "alice"))
    client = make_transport(connect_timeout=FAR, options=curve(keydir, "alice"))
    refuse(client, refusing, 2 * FLOOD_DIALS)
    checks = counts.checks
    out = client.connect(server.local_address)
    out.send(b"secret hello")
    got: list[Any] = []
    wait_until(
        lambda: got.extend(server.poll(0.01)) or got,
        timeout=T,
        what="the authenticated peer",
        pumps=[lambda: client.poll(0.01)],
    )
    assert list(got[0].recv()) == [b"secret hello"]
    assert counts.checks - checks == 1
    assert server.stats()["refused_handshakes"] == 0
