"""A hostile peer made of raw pyzmq sockets (no p2pkv transport): it speaks just enough of
the zmq link protocol (``p2pkv_zmq.hub``: a PUSH whose every message starts with its link id
``<host:port>#<16 hex>``, first ``[link, "", "open", ref]``, then ``[link, frame]`` per frame)
to reach a tier's session layer, and everything else a broken or malicious program could send
(each socket also announces its link id as its ZMTP routing id, which the PULL listener
ignores).

Frames come from the conformance kit's strategies (``p2pkv.testing.strategies``): hostile
frames, and valid messages sent where they are not allowed (before the handshake), plus
plain random bytes.
"""

from __future__ import annotations

import random
import secrets
from collections import deque
from collections.abc import Sequence
from multiprocessing.connection import Connection

import zmq
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st

__all__ = ["HostileClient", "draw", "intruder_main"]

_WINDOW = 64  # hostile sockets open at once (older ones are closed, lingering to flush)
_LINGER_MS = 500
_MAX_SOCKETS = 8192


def draw(strategy: st.SearchStrategy[bytes], n: int, seed: int) -> list[bytes]:
    """``n`` examples of ``strategy`` (reproducible for ``seed``)."""
    out: list[bytes] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=n,
        database=None,
        deadline=None,
        phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    @given(strategy)
    def collect(frame: bytes) -> None:
        out.append(frame)

    collect()
    return out


class HostileClient:
    """Sends hostile traffic at ``target`` (``host:port``); counts every frame it sent.

    Each hostile link presents a fresh address on ``claim_host`` (where the tier dials back;
    nothing listens there), so every session is new to the tier.
    """

    def __init__(self, target: str, claim_host: str = "127.0.0.1", seed: int = 0) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context(io_threads=1)
        self.ctx.max_sockets = _MAX_SOCKETS  # closed sockets linger while they flush
        self.url = f"tcp://{target}"
        self.claim_host = claim_host
        self.rng = random.Random(seed)
        self.frames_sent = 0
        self.sessions = 0
        self._open: deque[tuple[zmq.Socket[bytes], bytes | None]] = deque()

    def _socket(self, link: bytes | None) -> zmq.Socket[bytes]:
        sock: zmq.Socket[bytes] = self.ctx.socket(zmq.PUSH)
        sock.linger = _LINGER_MS
        sock.sndhwm = 0  # never drop: every frame counted goes out
        if link is not None:
            sock.routing_id = link
        sock.connect(self.url)
        self._open.append((sock, link))
        while len(self._open) > _WINDOW:
            self._open.popleft()[0].close()
        return sock

    def _claim(self) -> str:
        return f"{self.claim_host}:{self.rng.randint(20000, 60000)}"

    def _rid(self) -> bytes:
        return f"{self._claim()}#{secrets.token_hex(8)}".encode()

    def _link(self, link: bytes, frames: Sequence[bytes], *, open_first: bool) -> None:
        sock = self._socket(link)
        if open_first:
            sock.send_multipart([link, b"", b"open", b""])
        for frame in frames:
            sock.send_multipart([link, frame])
        self.frames_sent += len(frames)

    def session(self, frames: Sequence[bytes]) -> None:
        """Open a link like a p2pkv peer, then send ``frames`` as session frames."""
        self._link(self._rid(), frames, open_first=True)
        self.sessions += 1

    def impersonate(self, address: str, frames: Sequence[bytes]) -> None:
        """Open a link presenting ``address`` (a live peer's), then send ``frames``."""
        self._link(f"{address}#{secrets.token_hex(8)}".encode(), frames, open_first=True)

    def unopened(self, frames: Sequence[bytes]) -> None:
        """Session frames from a well-formed identity that never opened a link."""
        self._link(self._rid(), frames, open_first=False)

    def garbage(self, count: int, routing_id: bytes | None = None) -> None:
        """Messages of 1..5 random parts after a random (often malformed, never reused) link id
        or ``routing_id`` (also announced as the socket's ZMTP routing id), or with no link id
        at all, including fake opens, pairings and "gone" for connections that never
        existed."""
        rid = routing_id or self.rng.choice(
            [
                None,
                secrets.token_bytes(self.rng.randint(1, 255)),
                self._rid(),
                f"{self._claim()}#{secrets.token_hex(3)}".encode(),
                b"not-an-address#" + secrets.token_hex(8).encode(),
            ]
        )
        sock = self._socket(rid)
        prefix = [] if rid is None else [rid]
        for _ in range(count):
            shape = self.rng.randrange(5)
            if shape == 0:
                parts = [b"", b"open", secrets.token_bytes(self.rng.randint(0, 40))]
            elif shape == 1:
                parts = [b"", secrets.token_bytes(self.rng.randint(0, 8))]
            elif shape == 2:
                parts = [b"", self.rng.choice([b"gone", b"paired"]), secrets.token_hex(8).encode()]
            else:
                parts = [
                    secrets.token_bytes(self.rng.randint(0, 300))
                    for _ in range(self.rng.randint(1, 5))
                ]
            sock.send_multipart(prefix + parts)
            self.frames_sent += len(parts)

    def late(self, frame: bytes) -> None:
        """Send ``frame`` on the hostile socket opened before the newest (still open, in the
        window), under its link id: with a reused id, on the connection a ROUTER listener
        would have let the newest one take it over from. Nothing before the second socket."""
        if len(self._open) >= 2:
            sock, link = self._open[-2]
            sock.send_multipart(([] if link is None else [link]) + [frame])
            self.frames_sent += 1

    def oversized(self, nbytes: int) -> None:
        """One session frame larger than the tier accepts (its TCP connection gets dropped)."""
        self.session([b"\x00" * nbytes])

    def close(self) -> None:
        for sock, _ in self._open:
            sock.close(linger=_LINGER_MS)
        self._open.clear()
        self.ctx.term()


def intruder_main(
    conn: Connection,
    netns: str | None,
    target: str,
    claim: str,
    curve: tuple[bytes, bytes, bytes] | None,
    frames: list[bytes],
    timeout: float,
) -> None:
    """Child entry (``p2pkv.testing.child.Child``): from ``netns``, dial ``target`` like a p2pkv
    peer (open, then ``frames``), with CURVE keys ``(server_public, public, secret)`` or none.
    Reports ``("refused", event_names)`` once the security handshake failed, or
    ``("connected", [])`` if it succeeded; nothing waits longer than ``timeout``."""
    if netns is not None:
        from chaos_node import enter_netns

        enter_netns(netns)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock: zmq.Socket[bytes] = ctx.socket(zmq.PUSH)
    sock.linger = 0
    link = f"{claim}#{secrets.token_hex(8)}".encode()
    if curve is not None:
        sock.curve_serverkey, sock.curve_publickey, sock.curve_secretkey = curve
    failed = (
        zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
        | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        | zmq.EVENT_HANDSHAKE_FAILED_AUTH
    )
    monitor = sock.get_monitor_socket(failed | zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sock.connect(f"tcp://{target}")
    sock.send_multipart([link, b"", b"open", b""])
    for frame in frames:
        sock.send_multipart([link, frame])
    seen: list[str] = []
    outcome = "timeout"
    if monitor.poll(int(timeout * 1000)):
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(monitor.recv_multipart())
        seen.append(str(zmq.Event(event["event"]).name))
        outcome = "connected" if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED else "refused"
    conn.send((outcome, seen))
    sock.disable_monitor()
    monitor.close(0)
    sock.close(0)
    ctx.term()
