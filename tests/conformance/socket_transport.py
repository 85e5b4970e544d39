"""A minimal two-sided, cross-process data transport over TCP, for the kit's own tests.

Nothing published claims ``cross_process`` and ``two_sided`` without heavy libraries, so this
one exists to run the suites' child-process modes (a peer in another process, SIGSTOPped or
SIGKILLed) and the two-sided path (a read completes only while the *source* side progresses).
It is not a transport for use.

Each transport listens on ``127.0.0.1:0``; ``descriptor()`` is JSON ``{"socket": "host:port",
"num_blocks": n, "block_len": b}``. A read sends a request (id, remote indexes) on our
connection to the peer; the peer's ``progress``/``poll`` serves it by sending the blocks back;
our ``progress``/``poll`` copies a complete answer into our blocks **only if the read is still
ours** (the socket buffer is the staging area), so ``cancel``, ``remove_peer``, re-adding and
``close`` are final by forgetting the id. A dead connection fails its pending reads.
"""

from __future__ import annotations

import itertools
import json
import operator
import socket
import struct
from collections.abc import Sequence
from typing import Any, ClassVar

import numpy as np
from p2pkv.contracts import Capabilities, DataSettings, DataTransport, PollResult
from p2pkv.errors import ConfigError, PeerRejected, TransferSubmitError

__all__ = ["SocketDataTransport"]

_REQUEST = struct.Struct(">QI")  # read id, block count; then count x u32 remote indexes
_ANSWER = struct.Struct(">QBI")  # read id, ok, block count; then count x block_len bytes
_INDEX = struct.Struct(">I")


class _Link:
    """One non-blocking TCP connection with its receive and send buffers."""

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock = sock
        self.rx = bytearray()
        self.tx = bytearray()
        self.dead = False

    def pump(self) -> None:
        """Send what is queued and receive what arrived; a reset or EOF makes it dead."""
        try:
            while self.tx:
                sent = self.sock.send(self.tx)
                del self.tx[:sent]
        except (BlockingIOError, InterruptedError):
            pass
        except OSError:
            self.dead = True
        self._receive()

    def _receive(self) -> None:
        while not self.dead:
            try:
                chunk = self.sock.recv(1 << 20)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                chunk = b""
            if not chunk:
                self.dead = True
                return
            self.rx += chunk

    def close(self) -> None:
        self.dead = True
        self.sock.close()


class SocketDataTransport(DataTransport):
    """Two-sided reads over TCP (see the module docstring). No options."""

    name: ClassVar[str] = "kit-socket"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True, cross_host=False, two_sided=True
    )

    def __init__(self, settings: DataSettings) -> None:
        if settings.options:
            raise ConfigError(f"kit-socket data takes no options, got {sorted(settings.options)}")
        region, block_len = settings.region, settings.block_len
        if block_len <= 0 or region.nbytes == 0 or region.nbytes % block_len:
            raise ConfigError(
                f"region of {region.nbytes} bytes is not a positive multiple of {block_len}"
            )
        self._blocks: Any = np.frombuffer(region, dtype=np.uint8).reshape(-1, block_len)
        self._num_blocks, self._block_len = (int(n) for n in self._blocks.shape)
        self._listener = socket.create_server(("127.0.0.1", 0))
        self._listener.setblocking(False)
        host, port = self._listener.getsockname()[:2]
        self._address = f"{host}:{port}"
        self._peers: dict[str, tuple[str, int]] = {}
        self._descriptors: dict[str, bytes] = {}
        """The descriptor each peer of ``_peers`` was added with."""
        self._links: dict[str, _Link] = {}
        """Our connection to each peer: our requests out, its answers in."""
        self._served: list[_Link] = []
        """Connections peers opened to us: their requests in, our answers out."""
        self._pending: dict[int, tuple[str, list[int]]] = {}
        self._outcome: dict[int, bool] = {}
        self._ids = itertools.count(1)

    @classmethod
    def create(cls, settings: DataSettings) -> SocketDataTransport:
        return cls(settings)

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def descriptor(self) -> bytes:
        desc = {
            "socket": self._address,
            "num_blocks": self._num_blocks,
            "block_len": self._block_len,
        }
        return json.dumps(desc).encode()

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        if self._blocks is None:
            raise PeerRejected(f"peer {peer_id!r}: the socket data transport is closed")
        if peer_id in self._peers and self._descriptors.get(peer_id) == descriptor:
            return  # the same registration: its reads go on
        try:
            desc: Any = json.loads(descriptor)
            address, num_blocks, block_len = desc["socket"], desc["num_blocks"], desc["block_len"]
            int(str(address).rsplit(":", 1)[1])
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise PeerRejected(f"peer {peer_id!r}: malformed descriptor ({exc})") from None
        if block_len != self._block_len:
            raise PeerRejected(f"peer {peer_id!r}: block_len {block_len} != ours {self._block_len}")
        self.remove_peer(peer_id)  # re-adding replaces: the old registration's reads end
        self._peers[peer_id] = (address, int(num_blocks))
        self._descriptors[peer_id] = bytes(descriptor)

    def remove_peer(self, peer_id: str) -> list[int]:
        self._peers.pop(peer_id, None)
        self.cancel([t for t, (p, _) in self._pending.items() if p == peer_id])
        link = self._links.pop(peer_id, None)
        if link is not None:
            link.close()  # answers still on the way are dropped with it
        return []

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        if self._blocks is None:
            raise TransferSubmitError("kit-socket data transport is closed")
        if peer_id not in self._peers:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        local = _check(local_idxs, self._num_blocks, "local")
        remote = _check(remote_idxs, self._peers[peer_id][1], "remote")
        if not local or len(local) != len(remote) or len(set(local)) != len(local):
            raise TransferSubmitError(f"bad read: local {local}, remote {remote}")
        link = self._link(peer_id)
        tid = next(self._ids)
        link.tx += _REQUEST.pack(tid, len(remote)) + b"".join(_INDEX.pack(i) for i in remote)
        self._pending[tid] = (peer_id, local)
        if link.dead:
            self._outcome[tid] = False
        return tid

    def _link(self, peer_id: str) -> _Link:
        link = self._links.get(peer_id)
        if link is None:
            host, port = self._peers[peer_id][0].rsplit(":", 1)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.connect((host, int(port)))  # loopback: immediate or refused
            except OSError as exc:
                sock.close()
                raise TransferSubmitError(f"peer {peer_id!r} unreachable: {exc}") from None
            link = self._links[peer_id] = _Link(sock)
        return link

    def progress(self) -> None:
        if self._blocks is None:
            return
        self._accept()
        for link in self._served:
            link.pump()
            self._serve(link)
        self._served = [link for link in self._served if not link.dead]
        for peer_id, link in self._links.items():
            link.pump()
            self._take_answers(link)
            if link.dead:
                for tid, (p, _) in self._pending.items():
                    if p == peer_id:
                        self._outcome.setdefault(tid, False)

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            self._served.append(_Link(sock))

    def _serve(self, link: _Link) -> None:
        """Answer every complete request in ``link.rx`` with the blocks of our region."""
        while len(link.rx) >= _REQUEST.size:
            tid, count = _REQUEST.unpack_from(link.rx)
            end = _REQUEST.size + count * _INDEX.size
            if len(link.rx) < end:
                return
            idxs = [i for (i,) in _INDEX.iter_unpack(bytes(link.rx[_REQUEST.size : end]))]
            del link.rx[:end]
            ok = all(i < self._num_blocks for i in idxs)
            payload = self._blocks[idxs].tobytes() if ok else b""
            link.tx += _ANSWER.pack(tid, ok, len(idxs) if ok else 0) + payload
        link.pump()

    def _take_answers(self, link: _Link) -> None:
        """Copy every complete answer into our blocks, if its read is still ours."""
        while len(link.rx) >= _ANSWER.size:
            tid, ok, count = _ANSWER.unpack_from(link.rx)
            end = _ANSWER.size + count * self._block_len
            if len(link.rx) < end:
                return
            body = bytes(link.rx[_ANSWER.size : end])
            del link.rx[:end]
            self._land(tid, bool(ok), body)

    def _land(self, tid: int, ok: bool, body: bytes) -> None:
        read = self._pending.get(tid)
        if read is None or tid in self._outcome:
            return  # ended (cancelled, peer removed): its bytes never land
        local = read[1]
        if ok and len(body) == len(local) * self._block_len:
            self._blocks[local] = np.frombuffer(body, np.uint8).reshape(len(local), -1)
        self._outcome[tid] = ok

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.progress()
        done: list[int] = []
        failed: list[int] = []
        for tid, outcome in list(self._outcome.items()):
            if peer_id is None or self._pending[tid][0] == peer_id:
                (done if outcome else failed).append(tid)
                del self._outcome[tid], self._pending[tid]
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        for tid in transfer_ids:
            self._pending.pop(tid, None)
            self._outcome.pop(tid, None)

    def close(self) -> list[int]:
        self._pending.clear()
        self._outcome.clear()
        self._peers.clear()
        for link in [*self._links.values(), *self._served]:
            link.close()
        self._links.clear()
        self._served.clear()
        self._listener.close()
        self._blocks = None
        return []


def _check(idxs: Sequence[Any], num_blocks: int, what: str) -> list[int]:
    out = []
    for i in idxs:
        try:
            ok = not isinstance(i, bool) and 0 <= operator.index(i) < num_blocks
        except TypeError:
            ok = False
        if not ok:
            raise TransferSubmitError(f"{what} block index {i!r} is outside 0..{num_blocks - 1}")
        out.append(operator.index(i))
    return out
