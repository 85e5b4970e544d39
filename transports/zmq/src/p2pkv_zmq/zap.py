"""The ZAP handler of one transport: admits CURVE clients whose public key is allowed.

libzmq asks the handler bound at ``inproc://zeromq.zap.01`` of the socket's context about
every connection to a CURVE listener (RFC 27); the context is the transport's own, so the
handler sees only our listener. It must be bound before the listener, or libzmq admits every
client. Requests are answered from the hub's ``poll`` (driver thread), so a handshake waits for
the next poll.
"""

from __future__ import annotations

from collections.abc import Callable, Container

import zmq
from zmq.utils import z85

__all__ = ["ZAP_ENDPOINT", "ZapHandler"]

ZAP_ENDPOINT = "inproc://zeromq.zap.01"
_VERSION = b"1.0"
_KEY_BYTES = 32


class ZapHandler:
    """Owns the ZAP REP socket. ``on_refused(peer_ip, client)`` is called for each refusal
    (``client`` is the Z85 public key, or the mechanism name when it is not CURVE), and
    ``on_admitted(client)``, if given, for each client admitted (its Z85 public key)."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        allowed: Container[bytes],
        on_refused: Callable[[str, str], None],
        on_admitted: Callable[[bytes], None] | None = None,
    ) -> None:
        self._allowed = allowed
        self._on_refused = on_refused
        self._on_admitted = on_admitted
        self.socket: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.socket.linger = 0
        try:
            self.socket.bind(ZAP_ENDPOINT)
        except zmq.ZMQError:
            self.socket.close(0)
            raise

    def serve(self) -> None:
        """Answer every pending request; never blocks."""
        while True:
            try:
                request = self.socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.socket.send_multipart(self._answer(request))

    def _answer(self, request: list[bytes]) -> list[bytes]:
        request_id = request[1] if len(request) > 1 else b""
        if len(request) < 6 or request[0] != _VERSION:
            return [_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        address, mechanism, credentials = request[3], request[5], request[6:]
        key = credentials[0] if mechanism == b"CURVE" and credentials else b""
        if len(key) == _KEY_BYTES and key in self._allowed:
            if self._on_admitted is not None:
                self._on_admitted(z85.encode(key))
            return [_VERSION, request_id, b"200", b"OK", z85.encode(key), b""]
        if len(key) == _KEY_BYTES:
            who = z85.encode(key).decode()
        else:
            who = mechanism.decode("ascii", "replace")
        self._on_refused(address.decode("ascii", "replace"), who)
        return [_VERSION, request_id, b"400", b"client key not allowed", b"", b""]
