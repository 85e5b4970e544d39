"""Random, malformed and oversized messages from raw pyzmq sockets never crash the transport
and never reach a connection they do not belong to."""

from __future__ import annotations

import secrets
from collections.abc import Iterator
from typing import Any

import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq.connection import ZmqConnection
from p2pkv_zmq.identity import parse_link_id
from zmq_fixtures import MakeTransport

T = 5.0
CAP = 4096


class Harness:
    """The transport under test, a raw PULL standing in for a peer's listener (so the
    transport's dial-back connects), and a raw PUSH speaking the link protocol as that peer
    (its two-part messages ``[link, frame]`` are the frames a well-behaved connection must
    receive)."""

    def __init__(self, transport: Any) -> None:
        self.t = transport
        self.ctx = zmq.Context()
        self.home = self.ctx.socket(zmq.PULL)
        self.home.linger = 0
        self.home.bind("tcp://127.0.0.1:*")
        endpoint = self.home.last_endpoint
        assert isinstance(endpoint, bytes)
        port = endpoint.decode().rsplit(":", 1)[1]
        self.link = f"127.0.0.1:{port}#{secrets.token_hex(8)}".encode()
        self.good = self._push()
        self.good.send_multipart([self.link, b"", b"open", b""])
        self.good.send_multipart([self.link, b"start"])
        accepted: list[Any] = []
        wait_until(
            lambda: accepted.extend(self.t.poll(0.001)) or accepted,
            timeout=T,
            what="the raw peer to be accepted",
        )
        self.conn: ZmqConnection = accepted[0]
        assert list(self.conn.recv()) == [b"start"]
        self.others: list[ZmqConnection] = []
        self.seq = 0

    def _push(self) -> zmq.Socket[bytes]:
        sock = self.ctx.socket(zmq.PUSH)
        sock.linger = 0
        sock.sndhwm = 100_000
        sock.connect(f"tcp://{self.t.local_address}")
        return sock

    def sync(self) -> list[bytes]:
        """Send a sentinel on the good connection; return what the connection got before it."""
        self.seq += 1
        sentinel = b"sentinel-%d" % self.seq
        self.good.send_multipart([self.link, sentinel])
        got: list[bytes] = []

        def arrived() -> bool:
            for conn in self.t.poll(0.001):
                assert isinstance(conn, ZmqConnection)
                assert parse_link_id(conn.remote_link or b"") is not None
                self.others.append(conn)
            got.extend(self.conn.recv())
            return sentinel in got

        wait_until(arrived, timeout=T, what="the sentinel after hostile input")
        assert self.conn.alive
        return got[: got.index(sentinel)]

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture
def harness(make_transport: MakeTransport) -> Iterator[Harness]:
    h = Harness(make_transport(max_frame_bytes=CAP))
    yield h
    h.close()


rids = st.one_of(
    st.binary(min_size=1, max_size=80),
    st.builds(
        lambda host, port, inc: f"{host}:{port}#{inc}".encode(),
        st.sampled_from(["127.0.0.1", "[::1]", "LOCALHOST", "x"]),
        st.integers(0, 70000),
        st.text("0123456789abcdefXYZ#", min_size=0, max_size=18),
    ),
)
parts = st.binary(max_size=200)
# One harness serves every example on purpose: a long-lived transport must survive them all.
shared_harness = settings(
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow]
)
_OWN_CLOSE = [b"", b"gone", b""]
"""The peer closing its own link: a legitimate message, not garbage."""
link_messages = st.one_of(
    st.lists(parts, min_size=1, max_size=6),
    st.builds(lambda ref: [b"", b"open", ref], st.binary(max_size=20)),
    st.builds(lambda extra: [b"", b"open", b"", *extra], st.lists(parts, max_size=2)),
    st.builds(
        lambda verb, inc: [b"", verb, inc],
        st.sampled_from([b"gone", b"paired"]),
        st.binary(min_size=1, max_size=20),
    ),
    st.just([b"", b"gone"]),
).filter(lambda m: m != _OWN_CLOSE)


@shared_harness
@given(messages=st.lists(link_messages, min_size=1, max_size=5))
def test_garbage_on_a_connected_peer_never_reaches_the_connection(
    harness: Harness,
    messages: list[list[bytes]],
) -> None:
    for message in messages:
        harness.good.send_multipart([harness.link, *message])
    delivered = harness.sync()
    assert delivered == [m[0] for m in messages if len(m) == 1], (
        "only two-part messages (link id, frame) are payload; everything else is link "
        "protocol or garbage"
    )


@shared_harness
@given(rid=rids, messages=st.lists(link_messages, min_size=1, max_size=5))
def test_strangers_sending_anything_never_crash_the_transport(
    harness: Harness,
    rid: bytes,
    messages: list[list[bytes]],
) -> None:
    stranger = harness._push()
    try:
        for message in messages:
            stranger.send_multipart([rid, *message])
        stranger.send_multipart(messages[0])  # and without a link id
        assert harness.sync() == []
    finally:
        stranger.close()


@pytest.mark.parametrize("size", [CAP + 1, 10 * CAP, 100 * CAP])
def test_oversized_frames_are_refused_and_never_delivered(harness: Harness, size: int) -> None:
    monitor = harness.good.get_monitor_socket(zmq.EVENT_DISCONNECTED)
    try:
        harness.good.send_multipart([harness.link, b"z" * size])
        harness.good.send_multipart([harness.link, b"after"])  # may die with the TCP link
        assert monitor.poll(int(T * 1000)), "the oversized sender must be disconnected"
    finally:
        harness.good.disable_monitor()
        monitor.close(0)
    delivered = harness.sync()  # the raw peer reconnects by itself; the transport still serves
    assert delivered in ([], [b"after"])
    harness.good.send_multipart([harness.link, b"x" * CAP])  # exactly at the cap is fine
    assert harness.sync() == [b"x" * CAP]
