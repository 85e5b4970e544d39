"""Hypothesis state machines for the transport contracts (and, in :mod:`.tier_machine`, the tier).

Each machine drives the transport under test and a few peers of the same class in this process
through random interleavings, applying every step to a plain-Python model too, and checks after
every step that the two agree. Subclass, set ``transport`` (and ``options``), and run it::

    from hypothesis.stateful import run_state_machine_as_test
    from p2pkv.testing.stateful import DataTransportMachine


    class MyDataMachine(DataTransportMachine):
        transport = MyDataTransport


    def test_my_data_transport_state_machine():
        run_state_machine_as_test(MyDataMachine)

:class:`DataTransportMachine` -- the transport under test reads from a few peers. Rules: read
(valid; slots drawn by index into the free ones, so no timing reaches hypothesis), bad reads
(out of range, negative, a local slot twice, lengths differ, empty), poll (one peer or all),
progress, pump the peers (progress and poll: the serving side), cancel, kill (close) a peer,
remove a peer, re-add a removed one. Model: our region, exact outside the slots of pending
reads; like an engine, the machine overwrites a read's slots with a fresh canary the moment
the read is reported, cancelled or its peer removed, and a closed peer's whole region the
moment it closed (its caller's again). Invariants: the peers' (source) regions never change
while they are open; outside pending reads our region is exactly the model (no stray write,
and no late landing after ``cancel``, ``remove_peer`` or a report); a done read's slots hold
exactly its source blocks; every id is reported at most once and never after it was ended;
``remove_peer`` and ``close`` return no read id; the reads of a closed peer all end within
``timeout`` of its close (the rule waits for it: a transport must notice a closed peer), and
a read posted to a closed peer is refused or ends failed; at teardown every read has reached
exactly one terminal state or was ended.

A failed step is the reported error: teardown then only closes (:mod:`p2pkv.testing.machine`).
Rules are logged before they run while a step log is open (:mod:`p2pkv.testing.steps`), and
:func:`p2pkv.testing.isolated.run_machine_in_child` runs a machine in a child process, for a
transport that may crash it.

:class:`ControlTransportMachine` -- rules: dial, send a burst or a stream of small frames
(either way), pump, close a connection from either end, kill (close) a peer transport, redial.
Model: for every connection, the frames sent each way. Invariants: each end receives exactly a
prefix of what the other end sent, in order, with nothing from another connection; every
inbound connection is accepted once; a closed end refuses sends; at teardown every frame sent
on a live connection has arrived and every closed connection is seen dead by the other end.
A close or kill may first wait for its connections' frames (drawn): a frame lost before a
close would otherwise pass as lost by the close. A lost frame fails naming it.

Machines use same-process peers only. They run with the kit's recommended hypothesis
settings unless you load a profile of your own (:mod:`p2pkv.testing.profiles`).
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import invariant, precondition

from p2pkv.contracts import Capabilities, ControlTransport, DataTransport
from p2pkv.errors import ConnectionClosed, TransferSubmitError, TransportUnavailable
from p2pkv.testing.machine import KitMachine
from p2pkv.testing.peers import LocalControlPeer, LocalDataPeer, pattern
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.steps import step
from p2pkv.testing.strategies import binary_frames
from p2pkv.testing.waiting import WaitTimeout, pumping_in_background, quietly, wait_until

__all__ = ["ControlTransportMachine", "DataTransportMachine"]


def _available(cls: type[Any] | None, machine: str) -> type[Any]:
    if cls is None:
        raise TypeError(f"{machine}: set `transport = YourTransport` on the subclass")
    missing: TransportUnavailable | None = cls.availability()
    if missing is not None:
        import pytest

        pytest.skip(str(missing))
    return cls


_T = TypeVar("_T")


def _pick(data: st.DataObject, items: Sequence[_T], label: str) -> _T | None:
    """One of ``items``, drawn the same way however many there are (None if none). With a
    real transport how many transfers are pending or connections usable depends on timing,
    and hypothesis needs every run of the same choices to draw the same shapes: so no
    precondition or ``sampled_from`` over such lists."""
    index = data.draw(st.integers(0, 63), label=label)
    return items[index % len(items)] if items else None


# -- data ------------------------------------------------------------------------------------


@dataclass
class _Read:
    tid: int
    peer: str
    local: list[int]
    payload: list[bytes]
    """The peer's source blocks (sources never change)."""
    state: str = "pending"  # pending | done | failed | ended


_BAD_READS = (
    "local-too-big",
    "local-negative",
    "remote-too-big",
    "remote-negative",
    "local-duplicate",
    "lengths-differ",
    "empty",
)


class DataTransportMachine(KitMachine):
    """The ``DataTransport`` contract as a state machine (see the module docstring)."""

    transport: ClassVar[type[DataTransport] | None] = None
    options: ClassVar[Mapping[str, Any]] = {}
    num_blocks: ClassVar[int] = 8
    block_len: ClassVar[int] = 64
    peer_count: ClassVar[int] = 2
    timeout: ClassVar[float] = 10.0

    def __init__(self) -> None:
        super().__init__()
        cls = _available(self.transport, type(self).__name__)
        self.caps: Capabilities = cls.capabilities
        n, b = self.num_blocks, self.block_len
        self.local = LocalDataPeer(cls, n, b, self.options)
        self.local.fill(1)
        self.expected = bytearray(self.local.region_bytes())
        """Our region as the model knows it, exact outside the slots of pending reads."""
        self.busy: dict[int, int] = {}
        """Our slot -> the pending read that owns it."""
        self.peers = {
            f"p{i}": LocalDataPeer(cls, n, b, self.options) for i in range(self.peer_count)
        }
        self.log = PollLog(self.local.poll, self.local.cancel, "transport under test")
        self.peer_logs: dict[str, PollLog] = {}
        self.sources: dict[str, bytes] = {}
        for i, (pid, peer) in enumerate(self.peers.items()):
            peer.fill(10 + i)
            self.local.add_peer(pid, peer.descriptor)
            peer.add_peer("local", self.local.descriptor)
            self.peer_logs[pid] = PollLog(peer.poll, peer.cancel, f"peer {pid}")
            self.sources[pid] = peer.region_bytes()
        self.reads: dict[int, _Read] = {}
        self.dead: set[str] = set()
        self.removed: set[str] = set()
        self.canaries = itertools.count(1 << 20)

    # -- helpers --------------------------------------------------------------------------

    def _block(self, region: bytes | bytearray, idx: int) -> bytes:
        return bytes(region[idx * self.block_len : (idx + 1) * self.block_len])

    def _pending(self, peer: str | None = None) -> list[_Read]:
        return [
            t
            for t in self.reads.values()
            if t.state == "pending" and (peer is None or t.peer == peer)
        ]

    def _end(self, t: _Read, state: str) -> None:
        """The read is over: its slots are ours again, and like an engine we reuse them at
        once (a canary no late byte of any read may change)."""
        t.state = state
        for idx in t.local:
            del self.busy[idx]
        canary = pattern(next(self.canaries), len(t.local) * self.block_len).tobytes()
        self.local.set_blocks(t.local, canary)
        self._expect(t.local, canary)

    def _refused(self, local: list[int]) -> None:
        """A refused read's slots may hold whatever landed before the refusal (a backend
        that copies as it posts, from a peer that died under the call): the model takes
        them as they are now, and from now on nothing may change them (the late-landing
        rule, as after a cancel)."""
        region = self.local.region_bytes()
        self._expect(local, b"".join(self._block(region, idx) for idx in local))

    def _expect(self, idxs: Sequence[int], data: bytes) -> None:
        """The model's blocks ``idxs`` are now ``data`` (``len(idxs)`` blocks, in order)."""
        b = self.block_len
        for k, idx in enumerate(idxs):
            self.expected[idx * b : (idx + 1) * b] = data[k * b : (k + 1) * b]

    def _record(self, done: Sequence[int], failed: Sequence[int]) -> None:
        region = self.local.region_bytes()
        for tid in done:
            t = self.reads[tid]
            closed = (
                (
                    f" ({t.peer} closed meanwhile: after a peer's close its region is its "
                    f"caller's again, reads of it must fail)"
                )
                if t.peer in self.dead
                else ""
            )
            for idx, block in zip(t.local, t.payload, strict=True):
                assert self._block(region, idx) == block, (
                    f"read {tid} reported done but our block {idx} lacks peer {t.peer}'s "
                    f"bytes{closed}"
                )
            self._end(t, "done")
        for tid in failed:
            self._end(self.reads[tid], "failed")

    def _live(self, pid: str) -> bool:
        return pid not in self.dead and pid not in self.removed

    def _live_pumps(self) -> list[Any]:
        return [p.pump for q, p in self.peers.items() if q not in self.dead]

    # -- rules ----------------------------------------------------------------------------

    @step(data=st.data(), k=st.integers(1, 3))
    def read(self, data: st.DataObject, k: int) -> None:
        """Read ``k`` blocks into free slots. Which slots are free depends on when earlier
        reads finished (timing), so the draws never do: slots are drawn as indexes into
        the free list, whatever its length."""
        pid = data.draw(st.sampled_from(sorted(self.peers)), label="peer")
        picks = data.draw(st.lists(st.integers(0, 63), min_size=k, max_size=k), label="slots")
        remote = data.draw(
            st.lists(st.integers(0, self.num_blocks - 1), min_size=k, max_size=k), label="remote"
        )
        free = [s for s in range(self.num_blocks) if s not in self.busy]
        if not free:
            return
        local = list(dict.fromkeys(free[p % len(free)] for p in picks))
        remote = remote[: len(local)]
        try:
            tid = self.log.submitted(self.local.read_blocks(pid, local, remote), pid)
        except TransferSubmitError:
            assert not self._live(pid), f"a valid read from live peer {pid} was refused"
            self._refused(local)
            return
        payload = [self._block(self.sources[pid], i) for i in remote]
        self.reads[tid] = _Read(tid, pid, local, payload)
        self.busy.update(dict.fromkeys(local, tid))
        if pid in self.dead:
            self._await_dead_peer_reads(pid)
            assert self.reads[tid].state == "failed", (
                f"read {tid} of peer {pid}, posted after {pid} closed, was reported done: "
                f"after its close a peer's region is its caller's again, reads of it must fail"
            )

    @step(data=st.data(), bad=st.sampled_from(_BAD_READS))
    def read_refused(self, data: st.DataObject, bad: str) -> None:
        """Bad indexes are refused before anything is posted (the invariants check nothing
        of ours changed)."""
        pid = data.draw(st.sampled_from(sorted(self.peers)), label="peer")
        n = self.num_blocks
        local, remote = {
            "local-too-big": ([n], [0]),
            "local-negative": ([-1], [0]),
            "remote-too-big": ([0], [n]),
            "remote-negative": ([0], [-1]),
            "local-duplicate": ([1, 1], [2, 3]),
            "lengths-differ": ([0, 1], [0]),
            "empty": ([], []),
        }[bad]
        try:
            tid = self.local.read_blocks(pid, local, remote)
        except TransferSubmitError:
            return
        raise AssertionError(
            f"read_blocks accepted a bad read ({bad}: {local} <- {remote}, id {tid})"
        )

    @step(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        scope = data.draw(st.sampled_from([*sorted(self.peers), None]), label="scope")
        result = self.log.poll(scope)
        self._record(result.done, result.failed)

    @step()
    def progress(self) -> None:
        self.local.pump()

    @step()
    def pump_peers(self) -> None:
        """Peers progress and poll (a two-sided peer serves our reads there; it must never
        report anything: it posted nothing)."""
        for pid, peer in self.peers.items():
            if pid not in self.dead:
                peer.pump()
                self.peer_logs[pid].poll("local")

    @step(data=st.data())
    def cancel(self, data: st.DataObject) -> None:
        indexes = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=8), label="cancel")
        pending = self._pending()
        if not pending:
            return
        chosen = list({t.tid: t for t in (pending[i % len(pending)] for i in indexes)}.values())
        self.log.cancel([t.tid for t in chosen])
        for t in chosen:
            self._end(t, "ended")

    @precondition(lambda self: len(self.dead) < len(self.peers) - 1)
    @step(data=st.data())
    def kill_peer(self, data: st.DataObject) -> None:
        """Close a peer and, as its caller would, reuse its region at once (a canary):
        its reads must end within ``timeout``, none of them done with the canary's bytes."""
        pid = data.draw(st.sampled_from(sorted(set(self.peers) - self.dead)), label="victim")
        peer = self.peers[pid]
        peer.close()
        self.dead.add(pid)
        n = self.num_blocks
        peer.set_blocks(range(n), pattern(next(self.canaries), n * self.block_len).tobytes())
        self._await_dead_peer_reads(pid)

    def _await_dead_peer_reads(self, pid: str) -> None:
        """Wait (bounded) until every read of the closed peer ``pid`` has ended: the
        transport must notice a closed peer by itself. Which of them end done or failed is
        timing, but no draw depends on it: either way their slots are free again."""
        wait_until(
            lambda: not self._pending(pid),
            timeout=self.timeout,
            what=f"every read of peer {pid}, which closed, to end (failed, or done with bytes "
            f"read before the close): a transport must notice a closed peer",
            pumps=[*self._live_pumps(), lambda: self._record(*self.log.poll(pid))],
        )

    @precondition(lambda self: bool(set(self.peers) - self.removed))
    @step(data=st.data())
    def remove_peer(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(set(self.peers) - self.removed)), label="peer")
        with pumping_in_background(self._live_pumps()):
            self.log.undrained(self.local.remove_peer(pid), "remove_peer", pid)
        self._ended_peer(pid)
        self.removed.add(pid)

    def _ended_peer(self, pid: str) -> None:
        self.log.ended_peer(pid)
        for t in self._pending(pid):
            self._end(t, "ended")

    @precondition(lambda self: bool(self.removed - self.dead))
    @step(data=st.data())
    def readd_peer(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.removed - self.dead)), label="peer")
        self.local.add_peer(pid, self.peers[pid].descriptor)
        self.removed.discard(pid)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def sources_never_change(self) -> None:
        for pid, peer in self.peers.items():
            if pid not in self.dead:
                assert peer.region_bytes() == self.sources[pid], f"peer {pid}'s region changed"

    @invariant()
    def nothing_lands_outside_pending_reads(self) -> None:
        """Outside the slots of pending reads our region is exactly the model: nothing lands
        in slots no read named, nor after a read was reported, cancelled or its peer removed
        (the late-landing rule)."""
        region = self.local.region_bytes()
        for idx in range(self.num_blocks):
            if idx in self.busy:
                continue
            last = [(t.tid, t.state, t.local) for t in self.reads.values() if idx in t.local]
            assert self._block(region, idx) == self._block(self.expected, idx), (
                f"our block {idx} changed although no pending read owns it (a stray or late "
                f"write; its last reads (id, state, slots): {last[-3:]})"
            )

    def teardown(self) -> None:
        """Drain and check that every read ended, then close; after a failed step only
        close (quietly, no waiting: the failure stays the reported error)."""
        try:
            if not self.teardown_after_failure():
                self._drain()
        finally:
            for pid, peer in self.peers.items():
                if pid not in self.dead:
                    quietly(peer.close)
            quietly(self.local.close)

    def _drain(self) -> None:
        for pid in sorted(self.dead - self.removed):
            self.log.undrained(self.local.remove_peer(pid), "remove_peer", pid)
            self._ended_peer(pid)
            self.removed.add(pid)
        wait_until(
            lambda: not self._pending(),
            timeout=self.timeout,
            what="every read from a live peer to reach a terminal state",
            pumps=[*self._live_pumps(), lambda: self._record(*self.log.poll(None))],
        )
        with pumping_in_background(self._live_pumps()):
            left = set(self.local.close())
        assert not left, f"close() left internal transfers undrained when quiescent: {left}"
        assert list(self.local.close()) == [], "a second close() must return [] and not raise"
        for t in self.reads.values():
            assert t.state in ("done", "failed", "ended"), (t.tid, t.state)


# -- control ---------------------------------------------------------------------------------

_HEADER = struct.Struct(">HIQ")  # sender node, sender connection handle, sequence number

EndId = tuple[int, int]
"""(node, connection handle) names one end of a connection."""


@dataclass
class _End:
    """One connection end as the model sees it."""

    node: int
    handle: int
    target: int | None
    """The node dialed (None for an end we only know as accepted)."""
    sent: list[bytes] = field(default_factory=list)
    got: list[bytes] = field(default_factory=list)
    peer: EndId | None = None
    """The far end, learnt from the first frame either way."""
    closed: bool = False
    """Closed by the machine."""
    died: bool = False
    """Seen dead without the machine closing it (the transport may retire a connection)."""
    accepted: bool = False

    @property
    def over(self) -> bool:
        return self.closed or self.died


class ControlTransportMachine(KitMachine):
    """The ``ControlTransport`` contract as a state machine (see the module docstring).

    Node 0 is the transport under test; nodes 1.. are peers of the same class. Every frame
    starts with (sender node, sender connection, sequence number), so misdelivery, loss,
    duplication and reordering are all visible. A transport may hand out one connection both
    ways (``connect`` returning a connection the peer dialed): the model follows ends, not
    dials. A connection may also die on its own (the contract: frames arrive in order, each
    once, *or the connection dies*); then its frames may be lost, but its far end must see it
    dead too.
    """

    transport: ClassVar[type[ControlTransport] | None] = None
    options: ClassVar[Mapping[str, Any]] = {}
    node_count: ClassVar[int] = 3
    max_frame_bytes: ClassVar[int] = 4096
    timeout: ClassVar[float] = 10.0
    liveness_timeout: ClassVar[float] = 10.0
    host: ClassVar[str] = "127.0.0.1"
    settle_each_rule: ClassVar[bool | None] = None
    """Wait after each rule for the accepts and deaths it causes (see ``_await_far``). None:
    when the transport claims ``cross_process`` (its I/O runs on its own threads, at its own
    pace); an in-process transport delivers on ``poll`` alone, and interleaves more without."""

    def __init__(self) -> None:
        super().__init__()
        cls = _available(self.transport, type(self).__name__)
        self.nodes = [
            LocalControlPeer(cls, self.options, self.max_frame_bytes, self.host)
            for _ in range(self.node_count)
        ]
        settle = self.settle_each_rule
        self.settle = cls.capabilities.cross_process if settle is None else settle
        self.ends: dict[EndId, _End] = {}
        self.gone: set[int] = set()

    # -- helpers --------------------------------------------------------------------------

    def _far(self, end: _End) -> _End | None:
        return None if end.peer is None else self.ends.get(end.peer)

    def _doomed(self, end: _End) -> bool:
        """Frames sent on ``end`` may be lost: it or its far end is over or went away."""
        if end.over or end.node in self.gone:
            return True
        far = self._far(end)
        if far is not None:
            return far.over or far.node in self.gone
        return end.target is None or end.target in self.gone

    def _touches(self, end: _End, node: int) -> bool:
        """Whether ``end`` is on ``node`` or leads to it."""
        return node in (end.node, end.target) or (end.peer is not None and end.peer[0] == node)

    def _usable(self) -> list[_End]:
        return [e for e in self.ends.values() if e.node not in self.gone and not e.over]

    def _check_alive(self, end: _End) -> None:
        if not end.over and end.node not in self.gone:
            end.died = not self.nodes[end.node].alive(end.handle)

    def _send(self, end: _End, payload: bytes) -> None:
        frame = _HEADER.pack(end.node, end.handle, len(end.sent)) + payload
        frame = frame[: self.max_frame_bytes]
        node = self.nodes[end.node]
        doomed = self._doomed(end)
        try:
            node.send(end.handle, frame)
        except ConnectionClosed:
            if not doomed:
                assert not node.alive(end.handle), "send raised ConnectionClosed on a live one"
                end.died = True
            return
        assert not end.closed, "send on a connection we closed did not raise"
        end.sent.append(frame)

    def _receive(self, end: _End, frames: list[bytes]) -> None:
        for frame in frames:
            sender_id: EndId = _HEADER.unpack_from(frame)[:2]
            seq = _HEADER.unpack_from(frame)[2]
            sender = self.ends.get(sender_id)
            assert sender is not None, f"a frame from unknown end {sender_id} arrived"
            me = (end.node, end.handle)
            if end.peer is None:
                end.peer = sender_id
            assert end.peer == sender_id, (
                f"end {me} talks to {end.peer} but received a frame from {sender_id}"
            )
            if sender.peer is None:
                sender.peer = me
            assert sender.peer == me, f"frames of end {sender_id} arrived at two ends"
            due = len(end.got)
            assert seq <= due, (
                f"end {me}: frame {seq} of {sender_id} arrived where frame "
                f"{due} was due: frames {due}..{seq - 1} were lost"
            )
            assert seq == due, (
                f"end {me}: frame {seq} of {sender_id} arrived again after "
                f"frame {due - 1} (duplicated or reordered)"
            )
            assert frame == sender.sent[seq], f"frame {seq} of {sender_id} was corrupted"
            end.got.append(frame)

    def _pump(self) -> None:
        for i, node in enumerate(self.nodes):
            if i in self.gone:
                continue
            node.pump()
            for handle in node.accepted():
                end = self.ends.setdefault((i, handle), _End(i, handle, None))
                assert not end.accepted, f"node {i} accepted connection {handle} twice"
                end.accepted = True
                frames = node.frames(handle)
                if not frames:  # allowed only for one that died before its first frame
                    assert not node.alive(handle), (
                        "poll returned a live inbound connection with no frame buffered"
                    )
                self._receive(end, frames)
        for end in list(self.ends.values()):
            if end.node not in self.gone:
                self._receive(end, self.nodes[end.node].frames(end.handle))
                self._check_alive(end)

    # -- rules ----------------------------------------------------------------------------

    @step(a=st.integers(0, 5), b=st.integers(0, 5), silent=st.booleans())
    def dial(self, a: int, b: int, silent: bool) -> None:
        """Connect (and say hello unless ``silent``: then nothing may be accepted yet)."""
        a, b = a % self.node_count, b % self.node_count
        if a == b or a in self.gone or b in self.gone:
            return
        node = self.nodes[a]
        handle = node.connect(self.nodes[b].address)
        end = self.ends.get((a, handle))
        if end is not None:  # the live connection (its death may not be known yet)
            assert not end.over, "connect returned a connection that is closed or dead"
            return
        for other in self.ends.values():
            if other.node == a and other.target == b and not other.over:
                assert not node.alive(other.handle), (
                    "connect opened a second connection while the one it dialed is live"
                )
        end = self.ends[(a, handle)] = _End(a, handle, b)
        if not silent:
            self._send(end, b"dial")
            self._await_far(end)

    @step(data=st.data(), payloads=st.lists(binary_frames(512), min_size=1, max_size=8))
    def send(self, data: st.DataObject, payloads: list[bytes]) -> None:
        """Send a burst on one end: a frame lost inside it shows as a gap at the far end."""
        end = _pick(data, self._usable(), "end")
        if end is not None:
            for payload in payloads:
                self._send(end, payload)
                if end.over:
                    break
            self._await_far(end)

    @step(data=st.data(), count=st.integers(16, 64))
    def stream(self, data: st.DataObject, count: int) -> None:
        """Send a run of small frames on one end: a rare drop shows as a gap among them."""
        end = _pick(data, self._usable(), "end")
        if end is not None:
            for seq in range(count):
                self._send(end, b"stream %d" % seq)
                if end.over:
                    break
            self._await_far(end)

    @step(rounds=st.integers(1, 3))
    def pump(self, rounds: int) -> None:
        for _ in range(rounds):
            self._pump()

    @step(data=st.data(), drain=st.booleans())
    def close_connection(self, data: st.DataObject, drain: bool) -> None:
        """Close one end; with ``drain``, first wait for every frame sent on it either way
        (a frame lost before a close is otherwise allowed: the close may lose it)."""
        end = _pick(data, self._usable(), "end")
        if end is None:
            return
        if drain:
            self._await_delivery([end, *filter(None, [self._far(end)])])
        node = self.nodes[end.node]
        node.close_conn(end.handle)
        node.close_conn(end.handle)  # idempotent
        end.closed = True
        assert not node.alive(end.handle), "a closed connection still reports alive"
        self._send(end, b"after close")  # must raise ConnectionClosed
        if self.settle:
            self._await_deaths()

    @precondition(lambda self: len(self.gone) < self.node_count - 2)
    @step(victim=st.integers(1, 5), drain=st.booleans())
    def kill_node(self, victim: int, drain: bool) -> None:
        """Close a peer transport; with ``drain``, first wait for every frame sent to or
        from it (as ``close_connection``)."""
        victim = 1 + victim % (self.node_count - 1)
        if victim not in self.gone:
            if drain:
                self._await_delivery([e for e in self.ends.values() if self._touches(e, victim)])
            self.nodes[victim].close()
            self.nodes[victim].close()  # idempotent
            self.gone.add(victim)
            if self.settle:
                self._await_deaths()

    # -- invariants and teardown ----------------------------------------------------------

    @invariant()
    def closed_ends_stay_dead(self) -> None:
        for end in self.ends.values():
            if end.closed and end.node not in self.gone:
                assert not self.nodes[end.node].alive(end.handle), "a closed connection revived"

    def teardown(self) -> None:
        """Wait for every frame and death to arrive, then close; after a failed step only
        close (quietly, no waiting: the failure stays the reported error)."""
        try:
            if not self.teardown_after_failure():
                try:
                    self._settle()
                except AssertionError as exc:
                    self.log_failure(exc)
                    raise
        finally:
            for i, node in enumerate(self.nodes):
                if i not in self.gone:
                    quietly(node.close)

    def _settle(self) -> None:
        self._await_delivery(list(self.ends.values()))
        self._await_deaths()

    def _undelivered(self, ends: Sequence[_End]) -> list[tuple[_End, int]]:
        """Each end of ``ends`` on an open connection whose far end has not received all
        it sent, with how many frames arrived."""
        short = []
        for end in ends:
            if self._doomed(end) or not end.sent:
                continue
            far = self._far(end)
            got = 0 if far is None else len(far.got)
            if got < len(end.sent):
                short.append((end, got))
        return short

    def _await_delivery(self, ends: Sequence[_End]) -> None:
        """Wait (bounded) until every frame sent on ``ends`` arrived; else fail naming the
        frames that never did."""
        try:
            wait_until(
                lambda: not self._undelivered(ends),
                timeout=self.timeout,
                pumps=[self._pump],
                what="every frame sent on an open connection to arrive",
            )
        except WaitTimeout:
            raise AssertionError(self._missing(ends)) from None

    def _missing(self, ends: Sequence[_End]) -> str:
        """What never arrived on the open connections of ``ends``, end by end."""
        lines = [
            f"end ({end.node}, {end.handle}) -> {end.peer}: {got} of {len(end.sent)} "
            f"frames arrived, frames {got}..{len(end.sent) - 1} never did"
            for end, got in self._undelivered(ends)
        ]
        return (
            f"within {self.timeout}s, frames sent on open connections were lost "
            f"(dropped?):\n" + "\n".join(lines)
        )

    # Rules wait for what real transports do at their own pace (an accept, a death) before
    # the next rule is drawn: which ends exist and are usable must not depend on timing, or
    # hypothesis sees the same choices enable different rules (FlakyStrategyDefinition).

    def _await_far(self, end: _End) -> None:
        """Wait (bounded) until the far end of ``end`` received its first frame."""
        if self.settle and end.peer is None and end.sent and not self._doomed(end):
            wait_until(
                lambda: end.peer is not None or self._doomed(end),
                timeout=self.timeout,
                pumps=[self._pump],
                what="the first frame of a new connection to be accepted",
            )

    def _await_deaths(self) -> None:
        """Wait (bounded) until the far end of every closed connection sees it dead."""

        def deaths_seen() -> bool:
            for end in self.ends.values():
                far = self._far(end)
                if end.node in self.gone or far is None or end.closed:
                    continue
                if (far.over or far.node in self.gone) and self.nodes[end.node].alive(end.handle):
                    return False
            return True

        wait_until(
            deaths_seen,
            timeout=self.liveness_timeout,
            pumps=[self._pump],
            what="the far end of every closed connection to see it dead",
        )
