"""Hostile bytes on the listening port, below ZMTP: raw TCP connections that send random
bytes, a single byte, or a frame cut short (in the handshake, or after a complete one) are all
closed by the listener within ``handshake_timeout``, hold nothing afterwards, and never stop a
real peer from connecting and exchanging frames. Warnings about such input are rate-limited."""

from __future__ import annotations

import logging
import random
import selectors
import socket
import struct
import time
from typing import Any

import pytest
import zmq
import zmq_peers
from p2pkv.testing.child import Child
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq import hub
from zmq_fixtures import MakeTransport

T = 10.0  # generous: the child starts on a busy 2-core machine
HANDSHAKE = 0.5  # the listener's handshake_timeout
MARGIN = 3.0  # seconds past HANDSHAKE within which the listener must have closed everything
RSS_SLACK = 4 << 20  # resident bytes the attack may leave behind (allocator noise)


def _greeting() -> bytes:
    """A ZMTP 3.0 greeting offering the NULL mechanism, as a client sends it."""
    return b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + bytes(32)


def _ready() -> bytes:
    """The NULL mechanism's READY command of a PUSH socket (a short command frame)."""
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 4) + b"PUSH"
    return b"\x04" + bytes([len(body)]) + body


def _hostile_payloads(rng: random.Random) -> list[tuple[str, bytes]]:
    random_bytes = [("random bytes", rng.randbytes(rng.randint(2, 256))) for _ in range(40)]
    one_byte = [("one byte", bytes([b])) for b in [0xFF, 0x00, *rng.choices(range(256), k=18)]]
    cut_in_handshake = [("frame cut in the handshake", _greeting() + _ready()[:9])] * 5
    # The handshake completes, then a message frame announces 100 bytes and sends 10.
    cut_after = [
        ("frame cut after the handshake", _greeting() + _ready() + b"\x00\x64" + b"x" * 10)
    ] * 5
    return random_bytes + one_byte + cut_in_handshake + cut_after


def _open_all(address: str, payloads: list[tuple[str, bytes]]) -> list[tuple[str, socket.socket]]:
    host, port = address.rsplit(":", 1)
    opened = []
    for kind, payload in payloads:
        sock = socket.create_connection((host, int(port)), timeout=T)
        sock.sendall(payload)
        sock.setblocking(False)
        opened.append((kind, sock))
    return opened


def _wait_closed_by_peer(socks: list[tuple[str, socket.socket]], deadline: float) -> list[str]:
    """Read every socket until the peer closes it (EOF or reset) or ``deadline`` passes; the
    kinds of those still open then."""
    with selectors.DefaultSelector() as selector:
        for kind, sock in socks:
            selector.register(sock, selectors.EVENT_READ, kind)
        while selector.get_map() and time.monotonic() < deadline:
            for key, _ in selector.select(max(0.0, deadline - time.monotonic())):
                ready = key.fileobj
                assert isinstance(ready, socket.socket)
                try:
                    if ready.recv(65536):
                        continue  # the listener's own greeting: not closed yet
                except BlockingIOError:
                    continue
                except ConnectionResetError:
                    pass
                selector.unregister(ready)
        return [key.data for key in selector.get_map().values()]


def _resources(child: Child) -> tuple[int, int, dict[str, int]]:
    kind, fds, rss, stats = child.request("resources", T, "the listener's resources")
    assert kind == "resources"
    return fds, rss, stats


def _echo(t: Any, conn: Any, word: bytes) -> None:
    conn.send(word)
    got: list[bytes] = []
    wait_until(
        lambda: got.extend(conn.recv()) or b"echo:" + word in got,
        timeout=T,
        what=f"the echo of {word!r}",
        pumps=[lambda: t.poll(0.01)],
    )


def test_hostile_connections_are_closed_within_the_handshake_timeout(
    make_transport: MakeTransport,
) -> None:
    options = {"handshake_timeout": HANDSHAKE}
    with Child(zmq_peers.sitter, 0, None, options, name="hostile-target") as child:
        kind, address = child.recv(T, "its address")
        assert kind == "address"
        fds_before, rss_before, _ = _resources(child)
        payloads = _hostile_payloads(random.Random(18))
        started = time.monotonic()
        hostile = _open_all(address, payloads)
        try:
            during = make_transport()
            conn = during.connect(address)
            _echo(during, conn, b"during the attack")
            still_open = _wait_closed_by_peer(hostile, started + HANDSHAKE + MARGIN)
            assert still_open == [], (
                f"still open {MARGIN} s past the handshake timeout: "
                f"{sorted(set(still_open))} ({len(still_open)} of "
                f"{len(hostile)})"
            )
        finally:
            for _, sock in hostile:
                sock.close()
        _echo(during, conn, b"after the attack")
        after = make_transport()
        _echo(after, after.connect(address), b"a new peer after the attack")
        _, _, stats = _resources(child)
        assert stats["inbound_timeouts"] >= 5, stats  # the frames cut after the handshake
        for t in (during, after):
            t.close()
        wait_until(
            lambda: _resources(child)[0] == fds_before,
            timeout=T,
            what=f"the listener's open descriptors back at {fds_before}",
        )
        _, rss_after, _ = _resources(child)
        assert rss_after - rss_before < RSS_SLACK, (rss_before, rss_after)
        child.send("stop")


def test_a_flood_of_hostile_messages_logs_a_bounded_number_of_warnings(
    make_transport: MakeTransport,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every message below carries a different sender id, so logging once per sender would
    log each of them: the log is capped in all, whatever the keys."""
    caplog.set_level(logging.WARNING, logger="p2pkv.zmq")
    t = make_transport()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    flood = 500
    try:
        raw = ctx.socket(zmq.PUSH)
        raw.linger = 0
        raw.sndhwm = flood + 1
        raw.connect(f"tcp://{t.local_address}")
        for i in range(flood):
            raw.send(b"garbage-%d" % i)
        wait_until(
            lambda: t.stats()["dropped_messages"] >= flood,
            timeout=T,
            what="every hostile message to be dropped",
            pumps=[lambda: t.poll(0.01)],
        )
    finally:
        ctx.destroy(linger=0)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert 1 <= len(warnings) <= hub._LOG_BURST, [r.getMessage() for r in warnings[:3]]
