"""The data suite's harness: the transport under test, its peers and the reads it must
bring byte-exact (see :class:`p2pkv.testing.suites.DataTransportSuite`).
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable, Sequence

from p2pkv.testing.peers import DataPeer, pattern
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.waiting import quietly, wait_until


def _keep_pumping(
    pumps: Sequence[Callable[[], object]], seconds: float, until: Callable[[], bool]
) -> bool:
    """Call ``pumps`` for ``seconds`` (bounded; no sleep) or until ``until()`` holds first.
    Returns whether it held."""
    end = time.monotonic() + seconds
    wait_until(
        lambda: until() or time.monotonic() > end,
        timeout=seconds + 60.0,
        what=f"{seconds}s of pumping",
        pumps=pumps,
    )
    return until()


class _DataPair:
    """The transport under test (``local``, a peer object: usually in this process, in a child
    where a crash must not take the test run down) with its poll log, and its peers registered
    both ways (each with a poll log of its own: a peer serving our reads must never report
    anything from its ``poll``).

    Every read goes through :meth:`submit`, which records the source blocks it must bring;
    the moment any poll reports it done, our blocks must hold them (``done`` means every byte
    is in place, not one call later)."""

    def __init__(self, local: DataPeer, timeout: float, window: float = 0.5) -> None:
        self.local = local
        self.log = PollLog(local.poll, local.cancel, "transport under test", self._check_done)
        self.timeout = timeout
        self.window = window
        self.peers: dict[str, DataPeer] = {}
        self.peer_logs: dict[str, PollLog] = {}
        self.dead: set[str] = set()
        """Peers whose transport was closed or whose process was killed: never pumped again."""
        self._sources: dict[DataPeer, bytes] = {}
        self._reads: dict[int, tuple[str, list[int], list[bytes]]] = {}
        self._canaries = itertools.count(1_000_000)

    def connect(self, peer_id: str, peer: DataPeer, seed: int | None = None) -> DataPeer:
        """Register ``peer`` both ways (its region filled from ``seed`` first, if given) and
        note its region: sources never change, and a held (SIGSTOPped) peer cannot be asked."""
        if seed is not None:
            peer.fill(seed)
        self._sources[peer] = peer.region_bytes()
        self.local.add_peer(peer_id, peer.descriptor)
        peer.add_peer("local", self.local.descriptor)
        self.peers[peer_id] = peer
        self.peer_logs[peer_id] = PollLog(peer.poll, peer.cancel, f"peer {peer_id}")
        return peer

    def pumps(self) -> list[Callable[[], object]]:
        """Progress and poll every live peer (a two-sided peer serves our reads from these)."""
        out: list[Callable[[], object]] = []
        for pid, peer in self.peers.items():
            if pid not in self.dead:
                out += [peer.pump, functools.partial(self.peer_logs[pid].poll, "local")]
        return out

    def source(self, peer_id: str) -> bytes:
        """The peer's region, as first seen (sources never change; a dead peer's is kept)."""
        peer = self.peers[peer_id]
        if peer not in self._sources:
            self._sources[peer] = peer.region_bytes()
        return self._sources[peer]

    def rewritten(self, peer_id: str) -> None:
        """The peer's region was changed on purpose (a read of its own landed in it): note
        its region afresh (only while it runs)."""
        peer = self.peers[peer_id]
        self._sources[peer] = peer.region_bytes()

    def kill(self, peer_id: str, end: Callable[[], object]) -> None:
        """Make the peer dead with ``end`` (close it, SIGKILL its process); never pumped again."""
        self.source(peer_id)
        self.dead.add(peer_id)
        end()

    def close_peer(self, peer_id: str) -> None:
        """Close the peer's transport (dead from now on), then overwrite its whole region as
        its caller would reuse it at once: no read of it may bring bytes any more (a read
        reported done with these bytes fails ``_check_done``)."""
        peer = self.peers[peer_id]
        self.kill(peer_id, functools.partial(quietly, peer.close))
        n, b = peer.num_blocks, peer.block_len
        peer.set_blocks(range(n), pattern(next(self._canaries), n * b).tobytes())

    def submit(self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]) -> int:
        tid = self.local.read_blocks(peer_id, local_idxs, remote_idxs)
        self.log.submitted(tid, peer_id)
        src, b = self.source(peer_id), self.local.block_len
        self._reads[tid] = (
            peer_id,
            [int(i) for i in local_idxs],
            [_block(src, int(r), b) for r in remote_idxs],
        )
        return tid

    def _check_done(self, tid: int) -> None:
        peer_id, local_idxs, payload = self._reads[tid]
        ours = self.local.region_bytes()
        closed = (
            (
                f" (peer {peer_id} was closed or killed meanwhile: after its close its "
                f"region is its caller's again, so a read of it that had not completed "
                f"must fail)"
            )
            if peer_id in self.dead
            else ""
        )
        for li, block in zip(local_idxs, payload, strict=True):
            assert _block(ours, li, self.local.block_len) == block, (
                f"poll reported read {tid} done, but our block {li} does not hold peer "
                f"{peer_id}'s block: done means every byte is in our blocks when poll "
                f"reports it{closed}"
            )

    def wait_terminal(self, peer_id: str | None, ids: set[int], what: str) -> None:
        wait_until(
            lambda: self.log.terminal(ids),
            timeout=self.timeout,
            what=what,
            pumps=[*self.pumps(), lambda: self.log.poll(peer_id)],
        )

    def read(self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]) -> int:
        """Read and wait until done (the poll log checks the bytes). Returns the id."""
        tid = self.submit(peer_id, local_idxs, remote_idxs)
        self.wait_terminal(peer_id, {tid}, f"read {tid} to reach a terminal state")
        assert tid in self.log.done, f"read {tid} from peer {peer_id} (running) failed"
        return tid

    def canary(self, idxs: Sequence[int]) -> bytes:
        """Overwrite our blocks ``idxs`` with fresh bytes (an engine reusing the slots)."""
        data = pattern(next(self._canaries), len(idxs) * self.local.block_len).tobytes()
        self.local.set_blocks(idxs, data)
        return data

    def watch_canary(
        self,
        idxs: Sequence[int],
        canary: bytes,
        after: str,
        peer_ids: Sequence[str | None] = (None,),
    ) -> None:
        """Keep both sides progressing (and our poll going) for ``window`` seconds: no byte of
        ``canary`` in our blocks ``idxs`` may change (the late-landing rule), and no ended read
        may be reported (``PollLog``)."""
        b = self.local.block_len

        def changed() -> bool:
            now = self.local.region_bytes()
            return b"".join(_block(now, i, b) for i in idxs) != canary

        polls = [functools.partial(self.log.poll, p) for p in peer_ids]
        landed = _keep_pumping([*self.pumps(), self.local.pump, *polls], self.window, changed)
        assert not landed, (
            f"bytes landed in our blocks {list(idxs)} after {after} returned: a read that was "
            f"ended must never write into our region again"
        )


def _block(region: bytes, idx: int, block_len: int) -> bytes:
    return region[idx * block_len : (idx + 1) * block_len]
