"""The isolation suite's harness: the transport under test with peers that can be frozen, reads
posted through the tier's read gate, and rounds of work (see
:class:`p2pkv.testing.suites.isolation.DataIsolationSuite`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import ParamSpec, TypeVar

from p2pkv.contracts import DataTransport
from p2pkv.errors import TransferBusy
from p2pkv.reference.delegating import DelegatingDataTransport
from p2pkv.session.reads import HeldRead, ReadGate
from p2pkv.testing.peers import DataPeer
from p2pkv.testing.suites.data_pair import _DataPair
from p2pkv.testing.waiting import wait_until

P = ParamSpec("P")
R = TypeVar("R")


@dataclass
class _Posted:
    """What the gate did with one read: its id once posted, or why it was refused."""

    rid: int | None = None
    refused: Exception | None = None


class _Poster:
    """The gate's owner of every read of the suite: records what became of each."""

    def read_posted(self, held: HeldRead, rid: int) -> None:
        assert isinstance(held.owner_data, _Posted)
        held.owner_data.rid = rid

    def read_refused(self, held: HeldRead, exc: Exception) -> None:
        assert isinstance(held.owner_data, _Posted)
        held.owner_data.refused = exc


class _Submitting(DelegatingDataTransport):
    """The transport under test as the gate sees it: reads go through the pair, which notes
    the bytes each must bring (``_DataPair.submit``)."""

    def __init__(self, pair: _DataPair, inner: DataTransport) -> None:
        super().__init__(inner)
        self._pair = pair

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        return self._pair.submit(peer_id, local_idxs, remote_idxs)


class _Holder:
    def __init__(self, data: DataTransport) -> None:
        self.data = data


class Frozen:
    """Peers of a pair that are frozen now: never pumped nor polled (a child one's process is
    SIGSTOPped: no call may go to it until it is thawed)."""

    def __init__(self) -> None:
        self.peers: dict[str, DataPeer] = {}

    def freeze(self, peer_id: str, peer: DataPeer) -> None:
        peer.pause()
        self.peers[peer_id] = peer

    def thaw(self) -> None:
        for peer in self.peers.values():
            peer.resume()
        self.peers.clear()


class IsolationPair:
    """The transport under test (``pair.local``, in this process) and its peers, reads posted
    through a :class:`~p2pkv.session.reads.ReadGate` (as the tier posts them: a transport's
    declared shared resource is shared among peers), and :meth:`round`, one unit of work."""

    def __init__(self, pair: _DataPair, transport: DataTransport) -> None:
        self.pair = pair
        self.frozen = Frozen()
        self.gate = ReadGate(_Holder(_Submitting(pair, transport)))
        self._poster = _Poster()
        self._reported: set[int] = set()
        self._held: list[HeldRead] = []

    def post(self, peer_id: str, local: Sequence[int], remote: Sequence[int]) -> _Posted:
        """A read of ours from ``peer_id``, through the gate (posted now or held)."""
        posted = _Posted()
        held = HeldRead(self._poster, posted, peer_id, list(local), remote)
        self._held.append(held)
        self.gate.post(held)
        return posted

    def serve(self, peer_id: str, reads: Iterable[tuple[Sequence[int], Sequence[int]]]) -> set[int]:
        """Reads of ``peer_id``'s from us (each our blocks ``remote`` into its ``local``), in
        order, as many as its own bounded resources take now (``TransferBusy`` ends the
        batch; at least one must go), logged by its poll log; returns their ids."""
        peer, log = self.pair.peers[peer_id], self.pair.peer_logs[peer_id]
        ids: set[int] = set()
        for local, remote in reads:
            try:
                ids.add(log.submitted(peer.read_blocks("local", local, remote), "local"))
            except TransferBusy:
                break
        assert ids, f"peer {peer_id!r} could not post a single read of our region"
        return ids

    def warm(self, peer_id: str) -> None:
        """One read each way with ``peer_id`` (connections wired up, as a serving peer's
        are): the peer's first block into our last, our first into its last."""
        pair, n = self.pair, self.pair.local.num_blocks
        pair.read(peer_id, [n - 1], [0])
        log = pair.peer_logs[peer_id]
        ids = self.serve(peer_id, [([n - 1], [0])])
        wait_until(
            lambda: log.terminal(ids),
            timeout=pair.timeout,
            what=f"peer {peer_id!r} reading our region",
            pumps=[*pair.pumps(), pair.local.pump],
        )
        assert ids <= log.done, f"peer {peer_id!r} failed to read our region"
        pair.rewritten(peer_id)

    def freeze(self, *peer_ids: str) -> None:
        for peer_id in peer_ids:
            self.frozen.freeze(peer_id, self.pair.peers[peer_id])

    def round(self) -> None:
        """One round of work, as a tier's tick: every peer not frozen progresses and polls;
        our transport progresses and polls every peer's reads; reads that ended free their
        share of the gate, which then posts what waits."""
        pair = self.pair
        for peer_id, peer in pair.peers.items():
            if peer_id not in self.frozen.peers and peer_id not in pair.dead:
                peer.pump()
                pair.peer_logs[peer_id].poll("local")
        pair.local.pump()
        for peer_id in pair.peers:
            pair.log.poll(peer_id)
        ended = (pair.log.done | pair.log.failed) - self._reported
        for rid in ended:
            self.gate.ended(rid)
        self._reported |= ended
        self.gate.pump()

    def rounds_until(self, done: Callable[[], bool], limit: int) -> int | None:
        """Rounds until ``done()`` holds (the count), or None after ``limit`` rounds."""
        for count in range(1, limit + 1):
            self.round()
            if done():
                return count
        return None

    def ended(self, posted: Iterable[_Posted]) -> bool:
        """Whether every read of ``posted`` was refused or reached a terminal state."""
        log = self.pair.log
        return all(
            p.refused is not None or (p.rid is not None and log.terminal({p.rid})) for p in posted
        )

    def cancel_pending(self, peer_id: str) -> None:
        """Cancel our reads from ``peer_id`` that are still in flight, and give up the ones
        the gate holds."""
        for held in self._held:
            if held.peer == peer_id:
                held.live = False
        pending = sorted(self.pair.log.pending_of(peer_id))
        self.pair.log.cancel(pending)
        for rid in pending:
            self.gate.ended(rid)
        self._reported.update(pending)


def timed(call: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> tuple[R, float]:
    """What ``call`` returned and the seconds it took (wall time: a bound on a single call,
    checked with a margin)."""
    started = time.perf_counter()
    result = call(*args, **kwargs)
    return result, time.perf_counter() - started
