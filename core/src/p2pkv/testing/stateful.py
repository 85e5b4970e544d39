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

:class:`DataTransportMachine` -- rules: write (valid, and out of range), poll (one peer or all),
progress, pump the peers, cancel ``WAIT`` and ``IMMEDIATE``, kill (close) a peer, remove and
re-add a peer. Model: the expected bytes of every peer slot (known, in flight, or unknown after
a failed or stopped transfer) and every transfer's state (pending, done, failed, cancelled).
Invariants: no byte outside the slots named by a write ever changes, our own region never
changes, a done transfer's slots hold exactly its source bytes, every id is reported at most
once and never after it was cancelled, and at teardown every transfer has reached exactly one
terminal state.

:class:`ControlTransportMachine` -- rules: dial, send (either way), pump, close a connection
from either end, kill (close) a peer transport, redial. Model: for every connection, the frames
sent each way. Invariants: each end receives exactly a prefix of what the other end sent, in
order, with nothing from another connection; every inbound connection is accepted once; a
closed end refuses sends; at teardown every frame sent on a live connection has arrived and
every closed connection is seen dead by the other end.

Capabilities gate rules (``wait_cancel``); machines use same-process peers only.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from p2pkv.contracts import CancelMode, Capabilities, ControlTransport, DataTransport
from p2pkv.errors import ConnectionClosed, TransferSubmitError, TransportUnavailable
from p2pkv.testing.peers import LocalControlPeer, LocalDataPeer
from p2pkv.testing.polllog import PollLog
from p2pkv.testing.strategies import binary_frames
from p2pkv.testing.waiting import pumping_in_background, quietly, wait_until

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
class _Transfer:
    tid: int
    peer: str
    remote: list[int]
    payload: list[bytes]
    expect_id: int | None
    state: str = "pending"  # pending | done | failed | cancelled | undrained
    verified: bool = False


class DataTransportMachine(RuleBasedStateMachine):
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
        self.local_bytes = self.local.region_bytes()
        self.peers = {
            f"p{i}": LocalDataPeer(cls, n, b, self.options) for i in range(self.peer_count)
        }
        self.log = PollLog(self.local.poll, self.local.cancel, "transport under test")
        self.peer_logs: dict[str, PollLog] = {}
        self.model: dict[str, bytearray] = {}
        self.unknown: dict[str, set[int]] = {}
        self.busy: dict[str, set[int]] = {}
        for i, (pid, peer) in enumerate(self.peers.items()):
            peer.fill(10 + i)
            self.local.add_peer(pid, peer.descriptor)
            peer.add_peer("local", self.local.descriptor)
            self.peer_logs[pid] = PollLog(peer.poll, peer.cancel, f"peer {pid}")
            self.model[pid] = bytearray(peer.region_bytes())
            self.unknown[pid] = set()
            self.busy[pid] = set()
        self.transfers: dict[int, _Transfer] = {}
        self.dead: set[str] = set()
        self.removed: set[str] = set()

    # -- helpers --------------------------------------------------------------------------

    def _block(self, region: bytes | bytearray, idx: int) -> bytes:
        return bytes(region[idx * self.block_len:(idx + 1) * self.block_len])

    def _pending(self, peer: str | None = None) -> list[_Transfer]:
        return [t for t in self.transfers.values()
                if t.state == "pending" and (peer is None or t.peer == peer)]

    def _release(self, t: _Transfer, known: bool) -> None:
        """The transfer is over: its slots hold its payload (known) or anything (unknown)."""
        for idx, block in zip(t.remote, t.payload, strict=True):
            self.busy[t.peer].discard(idx)
            if known:
                b = self.block_len
                self.model[t.peer][idx * b:(idx + 1) * b] = block
                self.unknown[t.peer].discard(idx)
            else:
                self.unknown[t.peer].add(idx)

    def _settle(self) -> None:
        """Verify and release done transfers whose (two-sided) receive is done as well."""
        for t in self.transfers.values():
            if t.state != "done" or t.verified:
                continue
            if t.peer in self.dead:
                t.verified = True
                self._release(t, known=False)
                continue
            plog = self.peer_logs[t.peer]
            if t.expect_id is not None:
                if t.expect_id in plog.failed:
                    t.verified = True
                    self._release(t, known=False)
                    continue
                if t.expect_id not in plog.done:
                    continue
            region = self.peers[t.peer].region_bytes()
            for idx, block in zip(t.remote, t.payload, strict=True):
                assert self._block(region, idx) == block, (
                    f"transfer {t.tid} reported done but peer {t.peer} block {idx} lacks its bytes"
                )
            t.verified = True
            self._release(t, known=True)

    def _record(self, done: list[int], failed: list[int]) -> None:
        for tid in done:
            self.transfers[tid].state = "done"
        for tid in failed:
            t = self.transfers[tid]
            t.state = "failed"
            t.verified = True
            self._release(t, known=False)
        self._settle()

    def _live(self, pid: str) -> bool:
        return pid not in self.dead and pid not in self.removed

    # -- rules ----------------------------------------------------------------------------

    @rule(data=st.data())
    def write(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.peers)), label="peer")
        free = sorted(set(range(self.num_blocks)) - self.busy[pid])
        if not free:
            return
        remote = data.draw(st.lists(st.sampled_from(free), min_size=1, max_size=3, unique=True),
                           label="remote")
        local = data.draw(st.lists(st.integers(0, self.num_blocks - 1), min_size=len(remote),
                                   max_size=len(remote)), label="local")
        eid = None
        if self.caps.two_sided and self._live(pid):
            eid = self.peers[pid].expect_blocks("local", remote)
            assert eid is not None, "a two_sided transport must return an id from expect_blocks"
            self.peer_logs[pid].submitted(eid, "local")
        try:
            tid = self.log.submitted(self.local.write_blocks(pid, local, remote), pid)
        except TransferSubmitError:
            assert not self._live(pid), f"a valid write to live peer {pid} was refused"
            if eid is not None:
                self.peer_logs[pid].cancel([eid], CancelMode.WAIT)
            return
        payload = [self._block(self.local_bytes, i) for i in local]
        self.transfers[tid] = _Transfer(tid, pid, remote, payload, eid)
        self.busy[pid].update(remote)

    @rule(data=st.data(), side=st.sampled_from(["local", "remote"]),
          bad=st.sampled_from(["too-big", "negative"]))
    def write_out_of_range(self, data: st.DataObject, side: str, bad: str) -> None:
        pid = data.draw(st.sampled_from(sorted(self.peers)), label="peer")
        wrong = self.num_blocks if bad == "too-big" else -1
        local, remote = ([wrong], [0]) if side == "local" else ([0], [wrong])
        try:
            tid = self.local.write_blocks(pid, local, remote)
        except TransferSubmitError:
            return
        raise AssertionError(f"write_blocks accepted {side} index {wrong} (id {tid})")

    @rule(data=st.data())
    def poll(self, data: st.DataObject) -> None:
        scope = data.draw(st.sampled_from([*sorted(self.peers), None]), label="scope")
        result = self.log.poll(scope)
        self._record(list(result.done), list(result.failed))

    @rule()
    def progress(self) -> None:
        self.local.pump()

    @rule()
    def pump_peers(self) -> None:
        for pid, peer in self.peers.items():
            if pid not in self.dead:
                peer.pump()
                self.peer_logs[pid].poll("local")
        self._settle()

    @precondition(lambda self: self.caps.wait_cancel)
    @rule(data=st.data())
    def cancel_wait(self, data: st.DataObject) -> None:
        indexes = data.draw(st.lists(st.integers(0, 63), min_size=1, max_size=8),
                            label="cancel")
        pending = self._pending()
        if not pending:
            return
        chosen = list({id(t): t for t in (pending[i % len(pending)] for i in indexes)}.values())
        kept = set(self.log.cancel([t.tid for t in chosen], CancelMode.WAIT))
        for t in chosen:
            if t.tid in kept:
                continue
            t.state = "cancelled"
            self._release(t, known=False)
            if t.expect_id is not None and t.peer not in self.dead:
                self.peer_logs[t.peer].cancel([t.expect_id], CancelMode.WAIT)

    @rule(data=st.data())
    def cancel_immediate(self, data: st.DataObject) -> None:
        """IMMEDIATE is only for dead transfers: those whose bytes are already in place."""
        t = _pick(data, self._landed(), "landed")
        if t is None:
            return
        assert self.log.cancel([t.tid], CancelMode.IMMEDIATE) == []
        t.state = "cancelled"
        self._release(t, known=True)

    def _landed(self) -> list[_Transfer]:
        landed = []
        for t in self._pending():
            if t.peer in self.dead or self.caps.two_sided:
                continue  # a two-sided send may still be running after the bytes arrive
            region = self.peers[t.peer].region_bytes()
            if all(self._block(region, i) == blk for i, blk in zip(t.remote, t.payload,
                                                                    strict=True)):
                landed.append(t)
        return landed

    @precondition(lambda self: len(self.dead) < len(self.peers) - 1)
    @rule(data=st.data())
    def kill_peer(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(set(self.peers) - self.dead)), label="victim")
        self.peers[pid].close()
        self.dead.add(pid)
        self._settle()

    @precondition(lambda self: bool(set(self.peers) - self.removed))
    @rule(data=st.data())
    def remove_peer(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(set(self.peers) - self.removed)), label="peer")
        with pumping_in_background([p.pump for q, p in self.peers.items() if q not in self.dead]):
            left = self.log.undrained(self.local.remove_peer(pid), "remove_peer", pid)
        for t in self._pending(pid):
            if t.tid not in left:  # drained internally: never reported now
                t.state = "cancelled"
                self.log.forgotten.add(t.tid)
                self._release(t, known=False)
        self.removed.add(pid)

    @precondition(lambda self: bool(self.removed - self.dead))
    @rule(data=st.data())
    def readd_peer(self, data: st.DataObject) -> None:
        pid = data.draw(st.sampled_from(sorted(self.removed - self.dead)), label="peer")
        self.local.add_peer(pid, self.peers[pid].descriptor)
        self.removed.discard(pid)

    # -- invariants -----------------------------------------------------------------------

    @invariant()
    def our_region_is_never_written(self) -> None:
        assert self.local.region_bytes() == self.local_bytes, "the source region changed"

    @invariant()
    def nothing_lands_outside_the_named_slots(self) -> None:
        for pid, peer in self.peers.items():
            if pid in self.dead:
                continue
            region = peer.region_bytes()
            for idx in range(self.num_blocks):
                if idx in self.busy[pid] or idx in self.unknown[pid]:
                    continue
                assert self._block(region, idx) == self._block(self.model[pid], idx), (
                    f"peer {pid} block {idx} changed although no transfer targeted it"
                )

    def teardown(self) -> None:
        try:
            self._drain()
        finally:
            for pid, peer in self.peers.items():
                if pid not in self.dead:
                    quietly(peer.close)
            quietly(self.local.close)

    def _drain(self) -> None:
        for pid in sorted(self.dead - self.removed):
            self.remove_peer_now(pid)
        live = [p.pump for q, p in self.peers.items() if q not in self.dead]
        wait_until(
            lambda: not self._pending(),
            timeout=self.timeout,
            what="every transfer to a live peer to reach a terminal state",
            pumps=[*live, lambda: self._record(*map(list, self.log.poll(None)))],
        )
        with pumping_in_background(live):
            left = set(self.local.close())
        assert not left, f"close() left transfers undrained on a quiescent transport: {left}"
        assert list(self.local.close()) == [], "a second close() must return [] and not raise"
        for t in self.transfers.values():
            assert t.state in ("done", "failed", "cancelled", "undrained"), (t.tid, t.state)

    def remove_peer_now(self, pid: str) -> None:
        pending = {t.tid for t in self._pending(pid)}
        left = set(self.local.remove_peer(pid))
        assert left <= pending
        for t in self._pending(pid):
            t.state = "undrained" if t.tid in left else "cancelled"
            if t.tid not in left:
                self.log.forgotten.add(t.tid)
        self.removed.add(pid)


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


class ControlTransportMachine(RuleBasedStateMachine):
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
        self.nodes = [LocalControlPeer(cls, self.options, self.max_frame_bytes, self.host)
                      for _ in range(self.node_count)]
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

    def _usable(self) -> list[_End]:
        return [e for e in self.ends.values() if e.node not in self.gone and not e.over]

    def _check_alive(self, end: _End) -> None:
        if not end.over and end.node not in self.gone:
            end.died = not self.nodes[end.node].alive(end.handle)

    def _send(self, end: _End, payload: bytes) -> None:
        frame = (_HEADER.pack(end.node, end.handle, len(end.sent)) + payload)
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
            assert seq == len(end.got), (
                f"end {me}: frame {seq} of {sender_id} arrived, expected {len(end.got)} "
                f"(lost, duplicated or reordered)"
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

    @rule(a=st.integers(0, 5), b=st.integers(0, 5), silent=st.booleans())
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

    @rule(data=st.data(), payload=binary_frames(512))
    def send(self, data: st.DataObject, payload: bytes) -> None:
        end = _pick(data, self._usable(), "end")
        if end is not None:
            self._send(end, payload)
            self._await_far(end)

    @rule(rounds=st.integers(1, 3))
    def pump(self, rounds: int) -> None:
        for _ in range(rounds):
            self._pump()

    @rule(data=st.data())
    def close_connection(self, data: st.DataObject) -> None:
        end = _pick(data, self._usable(), "end")
        if end is None:
            return
        node = self.nodes[end.node]
        node.close_conn(end.handle)
        node.close_conn(end.handle)  # idempotent
        end.closed = True
        assert not node.alive(end.handle), "a closed connection still reports alive"
        self._send(end, b"after close")  # must raise ConnectionClosed
        if self.settle:
            self._await_deaths()

    @precondition(lambda self: len(self.gone) < self.node_count - 2)
    @rule(victim=st.integers(1, 5))
    def kill_node(self, victim: int) -> None:
        victim = 1 + victim % (self.node_count - 1)
        if victim not in self.gone:
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
        try:
            self._settle()
        finally:
            for i, node in enumerate(self.nodes):
                if i not in self.gone:
                    quietly(node.close)

    def _settle(self) -> None:
        def delivered() -> bool:
            for end in self.ends.values():
                if self._doomed(end) or not end.sent:
                    continue
                far = self._far(end)
                if far is None or len(far.got) < len(end.sent):
                    return False
            return True

        wait_until(delivered, timeout=self.timeout, pumps=[self._pump],
                   what="every frame sent on an open connection to arrive")

        self._await_deaths()

    # Rules wait for what real transports do at their own pace (an accept, a death) before
    # the next rule is drawn: which ends exist and are usable must not depend on timing, or
    # hypothesis sees the same choices enable different rules (FlakyStrategyDefinition).

    def _await_far(self, end: _End) -> None:
        """Wait (bounded) until the far end of ``end`` received its first frame."""
        if self.settle and end.peer is None and end.sent and not self._doomed(end):
            wait_until(lambda: end.peer is not None or self._doomed(end),
                       timeout=self.timeout, pumps=[self._pump],
                       what="the first frame of a new connection to be accepted")

    def _await_deaths(self) -> None:
        """Wait (bounded) until the far end of every closed connection sees it dead."""
        def deaths_seen() -> bool:
            for end in self.ends.values():
                far = self._far(end)
                if end.node in self.gone or far is None or end.closed:
                    continue
                if (far.over or far.node in self.gone) and self.nodes[end.node].alive(
                    end.handle
                ):
                    return False
            return True

        wait_until(deaths_seen, timeout=self.liveness_timeout, pumps=[self._pump],
                   what="the far end of every closed connection to see it dead")
