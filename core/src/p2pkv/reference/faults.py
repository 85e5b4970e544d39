"""``FaultInjector``: deterministic faults around any control or data transport.

Wrap transport instances (memory, zmq, nixl, ucx...) and arm rules::

    faults = FaultInjector(seed=7)
    ctl = faults.control(MemoryControlTransport.create(settings))
    data = faults.data(inner_data, local=ctl.local_address)
    faults.arm(Fault.DROP, peer=other_address, count=1)  # drop the next frame to it
    faults.arm(Fault.FAIL_COMPLETION, probability=0.1)  # fail 10% of completions
    faults.partition(ctl.local_address, other_address)  # until faults.heal(...)

Frame faults act on frames *sent* through a wrapped connection (wrap both sides to hit both
directions); ``peer`` is the destination's address. Per frame, the first armed rule that
fires decides: ``DROP`` loses it, ``DELAY`` holds it for ``polls`` polls of the wrapped
transport (later frames overtake it), ``DUPLICATE`` sends it twice, ``REORDER`` holds it until
the next frame on that connection went out (or the next poll), ``KILL`` closes the connection
(the peer sees it die) and raises ``ConnectionClosed``. Held frames of a dead connection are
lost; an error from the inner ``send`` on release drops the frame.

Data faults act on the reads a wrapped data transport posts: ``FAIL_SUBMIT`` makes
``read_blocks`` raise ``TransferSubmitError`` (nothing is posted); ``FAIL_COMPLETION`` reports a
done read as failed (its bytes may have landed in our blocks, which the caller then treats as
garbage; nothing lands after the failure is reported). ``peer`` is the data ``peer_id``.
``cancel``, ``remove_peer`` and ``close`` pass straight through (they are final in the inner
transport, and the wrapper forgets the ids with it).

``kill(conn)`` kills one wrapped connection now. ``partition(a, b)`` cuts two addresses apart:
wrapped connections between them are killed, new ones die at once, inbound ones are closed
unseen, reads between data wrappers whose ``local`` is ``a``/``b`` (and the peer id the other)
fail at submit, and their in-flight reads are reported failed when they complete.

Rules fire with ``probability`` (drawn from ``random.Random(seed)``, so a run is reproducible)
and at most ``count`` times (None = unlimited). Same threading rules as the wrapped transports.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import ClassVar

from p2pkv.contracts import (
    ControlConnection,
    ControlTransport,
    DataTransport,
    PollResult,
)
from p2pkv.errors import ConnectionClosed, TransferSubmitError
from p2pkv.reference.delegating import DelegatingControlTransport, DelegatingDataTransport


class Fault(str, enum.Enum):
    DROP = "drop"
    DELAY = "delay"
    DUPLICATE = "duplicate"
    REORDER = "reorder"
    KILL = "kill"
    FAIL_SUBMIT = "fail_submit"
    FAIL_COMPLETION = "fail_completion"


_FRAME_FAULTS = frozenset({Fault.DROP, Fault.DELAY, Fault.DUPLICATE, Fault.REORDER, Fault.KILL})


@dataclass
class FaultRule:
    """One armed fault. ``fired`` counts how often it applied."""

    fault: Fault
    peer: str | None = None
    probability: float = 1.0
    count: int | None = None
    polls: int = 1
    fired: int = field(default=0, init=False)


class FaultInjector:
    """Holds the rules, the partitions and the seeded random source of a test run."""

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)
        self._rules: list[FaultRule] = []
        self._partitions: set[frozenset[str]] = set()
        self._controls: list[FaultyControlTransport] = []

    # -- wrapping -----------------------------------------------------------------------------

    def control(self, transport: ControlTransport) -> FaultyControlTransport:
        wrapped = FaultyControlTransport(transport, self)
        self._controls.append(wrapped)
        return wrapped

    def data(self, transport: DataTransport, local: str = "") -> FaultyDataTransport:
        """Wrap a data transport; ``local`` is its identity for :meth:`partition`."""
        return FaultyDataTransport(transport, self, local)

    # -- rules --------------------------------------------------------------------------------

    def arm(
        self,
        fault: Fault,
        *,
        peer: str | None = None,
        probability: float = 1.0,
        count: int | None = None,
        polls: int = 1,
    ) -> FaultRule:
        """Add a rule; ``polls`` is the hold time of ``DELAY``. Returns it (see ``fired``)."""
        if not 0.0 <= probability <= 1.0:
            raise ValueError(f"probability must be within 0..1, got {probability}")
        if count is not None and count < 1:
            raise ValueError(f"count must be >= 1 or None, got {count}")
        if polls < 1:
            raise ValueError(f"polls must be >= 1, got {polls}")
        rule = FaultRule(Fault(fault), peer, probability, count, polls)
        self._rules.append(rule)
        return rule

    def disarm(self, rule: FaultRule | None = None) -> None:
        """Remove one rule, or every rule when ``rule`` is None."""
        if rule is None:
            self._rules.clear()
        elif rule in self._rules:
            self._rules.remove(rule)

    def fire(self, kinds: frozenset[Fault], peer: str) -> FaultRule | None:
        """The first rule of ``kinds`` for ``peer`` that fires now (its count is used up)."""
        for rule in self._rules:
            if rule.fault not in kinds or rule.peer not in (None, peer):
                continue
            if rule.probability < 1.0 and self._rng.random() >= rule.probability:
                continue
            rule.fired += 1
            if rule.count is not None and rule.fired >= rule.count:
                self._rules.remove(rule)
            return rule
        return None

    # -- connections and partitions -----------------------------------------------------------

    def kill(self, conn: ControlConnection) -> None:
        """Kill a wrapped connection now: closed here, the peer sees it die."""
        if not isinstance(conn, FaultyConnection):
            raise TypeError("kill() takes a connection returned by a wrapped control transport")
        conn.kill()

    def partition(self, a: str, b: str) -> None:
        self._partitions.add(frozenset((a, b)))
        for transport in self._controls:
            transport.enforce_partitions()

    def heal(self, a: str, b: str) -> None:
        self._partitions.discard(frozenset((a, b)))

    def partitioned(self, a: str, b: str) -> bool:
        return frozenset((a, b)) in self._partitions


class FaultyConnection(ControlConnection):
    """A wrapped connection; frame faults apply to ``send``."""

    def __init__(self, inner: ControlConnection, owner: FaultyControlTransport) -> None:
        self.inner = inner
        self._owner = owner
        self._killed = False
        self._delayed: list[tuple[int, bytes]] = []
        self._reordered: bytes | None = None

    @property
    def peer_address(self) -> str:
        return self.inner.peer_address

    @property
    def alive(self) -> bool:
        return not self._killed and self.inner.alive

    def send(self, frame: bytes) -> None:
        if self._killed:
            raise ConnectionClosed(f"connection to {self.peer_address} was killed by a fault")
        rule = self._owner.faults.fire(_FRAME_FAULTS, self.peer_address)
        fault = rule.fault if rule is not None else None
        if fault is Fault.KILL:
            self.kill()
            raise ConnectionClosed(f"connection to {self.peer_address} killed by a fault")
        if fault is Fault.DROP:
            return
        if fault is Fault.DELAY:
            assert rule is not None
            self._delayed.append((self._owner.polls + rule.polls, bytes(frame)))
            return
        if fault is Fault.REORDER and self._reordered is None:
            self._reordered = bytes(frame)
            return
        self.inner.send(frame)
        if fault is Fault.DUPLICATE:
            self.inner.send(frame)
        self._release_reordered()

    def recv(self) -> Sequence[bytes]:
        return self.inner.recv()

    def close(self) -> None:
        self._delayed.clear()
        self._reordered = None
        self.inner.close()

    def kill(self) -> None:
        self._killed = True
        self.close()

    def release(self, polls: int) -> None:
        """Send held frames that are due (called from the owner's poll)."""
        self._release_reordered()
        due = [frame for at, frame in self._delayed if at <= polls]
        self._delayed = [(at, frame) for at, frame in self._delayed if at > polls]
        for frame in due:
            self._send_held(frame)

    def _release_reordered(self) -> None:
        if self._reordered is not None:
            frame, self._reordered = self._reordered, None
            self._send_held(frame)

    def _send_held(self, frame: bytes) -> None:
        if self.alive:
            try:
                self.inner.send(frame)
            except Exception:  # held frames are best effort: a refused one is a lost one
                return


class FaultyControlTransport(DelegatingControlTransport):
    """A control transport wrapped by a :class:`FaultInjector`; build with ``control()``."""

    name: ClassVar[str] = "faulty"

    def __init__(self, inner: ControlTransport, faults: FaultInjector) -> None:
        super().__init__(inner)
        self.faults = faults
        self.polls = 0
        self._wrapped: dict[ControlConnection, FaultyConnection] = {}
        self._tracking = False
        """The tier reads ``take_active``: dead connections are forgotten only there."""

    def connect(self, address: str) -> ControlConnection:
        conn = self._wrap(self.inner.connect(address))
        if self.faults.partitioned(self.local_address, address):
            conn.kill()
        return conn

    def poll(self, timeout: float = 0.0) -> Sequence[ControlConnection]:
        self.polls += 1
        for conn in list(self._wrapped.values()):
            conn.release(self.polls)
        accepted = []
        for inner in self.inner.poll(timeout):
            if self.faults.partitioned(self.local_address, inner.peer_address):
                inner.close()
            else:
                accepted.append(self._wrap(inner))
        if not self._tracking:  # else take_active forgets them, once it has listed them
            self._forget_dead()
        return accepted

    def take_active(self) -> Collection[ControlConnection] | None:
        """The inner transport's active connections, as the wrapped ones the tier knows (a
        fault's kill closes the inner connection, so the inner transport lists it too)."""
        active = self.inner.take_active()
        if active is None:
            return None
        self._tracking = True
        wrapped = self._wrapped
        out = [conn for inner in active if (conn := wrapped.get(inner)) is not None]
        self._forget_dead()
        return out

    def _forget_dead(self) -> None:
        self._wrapped = {k: c for k, c in self._wrapped.items() if c.alive}

    def enforce_partitions(self) -> None:
        for conn in self._wrapped.values():
            if self.faults.partitioned(self.local_address, conn.peer_address):
                conn.kill()

    def _wrap(self, inner: ControlConnection) -> FaultyConnection:
        conn = self._wrapped.get(inner)
        if conn is None:
            conn = self._wrapped[inner] = FaultyConnection(inner, self)
        return conn


_FAIL_SUBMIT = frozenset({Fault.FAIL_SUBMIT})
_FAIL_COMPLETION = frozenset({Fault.FAIL_COMPLETION})


class FaultyDataTransport(DelegatingDataTransport):
    """A data transport wrapped by a :class:`FaultInjector`; build with ``data()``."""

    name: ClassVar[str] = "faulty"

    def __init__(self, inner: DataTransport, faults: FaultInjector, local: str) -> None:
        super().__init__(inner)
        self.faults = faults
        self.local = local
        self._peer_of: dict[int, str] = {}

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        """Re-adding ends the peer's reads (in the inner transport): forget them here too."""
        super().add_peer(peer_id, descriptor)
        self._peer_of = {t: p for t, p in self._peer_of.items() if p != peer_id}

    def remove_peer(self, peer_id: str) -> list[int]:
        """The inner transport ends the peer's reads finally; the wrapper forgets them too."""
        left = super().remove_peer(peer_id)
        self._peer_of = {t: p for t, p in self._peer_of.items() if p != peer_id}
        return left

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """A partitioned peer or a firing ``FAIL_SUBMIT`` refuses the read (nothing posted)."""
        if self.faults.partitioned(self.local, peer_id):
            raise TransferSubmitError(f"peer {peer_id!r} is partitioned away (injected)")
        if self.faults.fire(_FAIL_SUBMIT, peer_id) is not None:
            raise TransferSubmitError(f"injected submit failure to peer {peer_id!r}")
        tid = super().read_blocks(peer_id, local_idxs, remote_idxs)
        self._peer_of[tid] = peer_id
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        """The inner poll, with done reads of a partitioned peer or hit by a firing
        ``FAIL_COMPLETION`` reported as failed."""
        result = super().poll(peer_id)
        if not result.done and not result.failed:
            return result
        done: list[int] = []
        failed = list(result.failed)
        for tid in result.done:
            peer = self._peer_of.get(tid, peer_id or "")
            cut = self.faults.partitioned(self.local, peer)
            if cut or self.faults.fire(_FAIL_COMPLETION, peer) is not None:
                failed.append(tid)
            else:
                done.append(tid)
        for tid in (*result.done, *result.failed):
            self._peer_of.pop(tid, None)
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        super().cancel(transfer_ids)
        for tid in transfer_ids:
            self._peer_of.pop(tid, None)

    def close(self) -> list[int]:
        left = super().close()
        self._peer_of.clear()
        return left
