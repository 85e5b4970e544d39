"""The session test rig: one :class:`~p2pkv.session.session.Session` and everything around it.

The test plays the peer: it feeds encoded frames into a fake connection and decodes what the
session sent. The data transport is a scripted fake whose reads stay in flight until the test
finishes them. The producer directory and the ledger are the real ones. The clock is a fake
advanced by the test, and timers fire through ``Deadlines.fire_due``, as the tier does: data
first, then timers.

Importable by name (pytest's ``pythonpath``, root pyproject.toml); the fixtures ``rig``,
``consumer`` and ``producer`` are in ``core/tests/conftest.py``. Type-checked by mypy.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, ClassVar

import msgpack
from p2pkv.config import Limits, Timeouts
from p2pkv.contracts import (
    EMPTY_POLL,
    Capabilities,
    ControlConnection,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import ConnectionClosed, FrameTooLarge, PeerRejected, TransferSubmitError
from p2pkv.observers import Observers
from p2pkv.protocol import (
    WIRE_MAJOR,
    WIRE_MINOR,
    Hello,
    HelloAck,
    Message,
    RoundFailed,
    decode,
    encode,
    message_type,
)
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.env import LocalIdentity, SessionEnv
from p2pkv.session.ledger import JobLedger
from p2pkv.session.producers import ProducerDirectory
from p2pkv.session.session import Doom, Session, State
from p2pkv.types import Job, Outcome, RequestContext

PEER = "peer:1"
LIMITS = Limits()
OUR_BLOCKS = 64
PEER_BLOCKS = 32
"""``num_blocks`` of the peer's hello (``Rig.hello``); the fake data plane checks reads
against it like a real transport checks them against the peer's descriptor."""

Event = tuple[Any, ...]


class FakeConn(ControlConnection):
    def __init__(self, events: list[Event]) -> None:
        self.inbox: list[bytes] = []
        self.sent: list[bytes] = []
        self.is_alive = True
        self.fail_send = False
        self.max_frame = 1 << 20
        self.too_large: type[Exception] = FrameTooLarge
        self.events = events

    @property
    def peer_address(self) -> str:
        return PEER

    @property
    def alive(self) -> bool:
        return self.is_alive

    def send(self, frame: bytes) -> None:
        if not self.is_alive or self.fail_send:
            raise ConnectionClosed("closed")
        if len(frame) > self.max_frame:
            raise self.too_large(f"frame of {len(frame)} bytes exceeds {self.max_frame}")
        self.sent.append(frame)
        self.events.append(("send", message_type(decode(frame, LIMITS))))

    def recv(self) -> Sequence[bytes]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        self.is_alive = False


class FakeData(DataTransport):
    """Scripted data plane: reads stay in flight until the test finishes them.

    It checks ``read_blocks`` arguments as the contract says a transport does (raising
    ``TransferSubmitError``), records in ``violations`` anything a correct session never does
    (two reads in flight into one of our slots), and never reports a cancelled read.
    """

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, events: list[Event], peer_blocks: int = PEER_BLOCKS) -> None:
        self.ids = itertools.count(1)
        self.peers: dict[str, bytes] = {}
        self.reads: dict[int, tuple[list[int], list[int]]] = {}
        """In flight: id -> (local, remote)."""
        self.posted: list[tuple[str, list[int], list[int]]] = []
        """Every read ever posted: (peer, local, remote)."""
        self.finished: list[tuple[int, bool]] = []
        self.cancelled: list[list[int]] = []
        self.violations: list[str] = []
        self.fail_submit = False
        self.reject_peer = ""
        self.peer_blocks = peer_blocks
        self.events = events

    @classmethod
    def create(cls, settings: DataSettings) -> FakeData:
        raise NotImplementedError

    @property
    def num_blocks(self) -> int:
        return OUR_BLOCKS

    @property
    def block_len(self) -> int:
        return 16

    def descriptor(self) -> bytes:
        return b"ours"

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        if self.reject_peer:
            raise PeerRejected(self.reject_peer)
        self.peers[peer_id] = descriptor

    def remove_peer(self, peer_id: str) -> list[int]:
        self.peers.pop(peer_id, None)
        return []

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        local, remote = list(local_idxs), list(remote_idxs)
        if self.fail_submit:
            raise TransferSubmitError("refused")
        if peer_id not in self.peers:
            raise TransferSubmitError(f"unknown peer {peer_id}")
        if not local or len(local) != len(remote):
            raise TransferSubmitError("bad lengths")
        if len(set(local)) != len(local) or not all(0 <= i < OUR_BLOCKS for i in local):
            raise TransferSubmitError(f"bad local indexes {local}")
        if not all(0 <= i < self.peer_blocks for i in remote):
            raise TransferSubmitError(f"bad remote indexes {remote}")
        busy = {i for loc, _ in self.reads.values() for i in loc}
        if busy.intersection(local):
            self.violations.append(f"slots {sorted(busy & set(local))} read twice at once")
        rid = next(self.ids)
        self.reads[rid] = (local, remote)
        self.posted.append((peer_id, local, remote))
        self.events.append(("read", rid))
        return rid

    def finish(self, rid: int, ok: bool = True) -> None:
        """The read ``rid`` completes; reported by the next ``poll``."""
        assert rid in self.reads, f"read {rid} is not in flight (cancelled or never posted)"
        self.finished.append((rid, ok))

    def poll(self, peer_id: str | None = None) -> PollResult:
        if not self.finished:
            return EMPTY_POLL
        done = [t for t, ok in self.finished if ok]
        failed = [t for t, ok in self.finished if not ok]
        self.finished = []
        for t in done + failed:
            del self.reads[t]
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        ids = list(transfer_ids)
        self.cancelled.append(ids)
        self.events.append(("cancel", sorted(ids)))
        for t in ids:
            self.reads.pop(t, None)
        self.finished = [(t, ok) for t, ok in self.finished if t not in ids]

    def close(self) -> list[int]:
        self.cancel(list(self.reads))
        return []


class LoggingLedger(JobLedger):
    """The real ledger, logging each result into the rig's event list (order assertions)."""

    def __init__(self, events: list[Event], *args: Any) -> None:
        super().__init__(*args)
        self.events = events

    def close(self, job_id: int, outcome: Outcome, detail: str = "") -> bool:
        produced = super().close(job_id, outcome, detail)
        if produced:
            self.events.append(("result", job_id, outcome))
        return produced


class Rig:
    """One session under test plus everything around it."""

    def __init__(
        self, *, timeouts: Timeouts | None = None, peer_blocks: int = PEER_BLOCKS, **local: Any
    ) -> None:
        self.now = 100.0
        self.events: list[Event] = []
        self.conn = FakeConn(self.events)
        self.data = FakeData(self.events, peer_blocks)
        self.deadlines = Deadlines()
        self.ledger = LoggingLedger(self.events, self.clock, Observers())
        self.timeouts = timeouts or Timeouts()
        self.dir = ProducerDirectory(
            self.ledger, self.deadlines, self.clock, self.timeouts, Observers()
        )
        ident: dict[str, Any] = {
            "address": "me:1",
            "epoch": 7,
            "descriptor": b"ours",
            "num_blocks": OUR_BLOCKS,
            "block_len": 16,
            "fingerprint": "",
            "hash_seed": "",
        }
        ident.update(local)
        self.env = SessionEnv(
            data=self.data,
            ledger=self.ledger,
            deadlines=self.deadlines,
            clock=self.clock,
            observers=Observers(),
            timeouts=self.timeouts,
            limits=LIMITS,
            local=LocalIdentity(**ident),
            producers=self.dir,
        )
        self.session = Session(self.env, PEER, self.conn)
        self.session.start()
        self.results: dict[int, Outcome] = {}
        self.details: dict[int, str] = {}

    def clock(self) -> float:
        return self.now

    def feed(self, *msgs: Message) -> list[bytes] | None:
        self.conn.inbox.extend(encode(m) for m in msgs)
        rest = self.session.receive()
        self.take()
        return rest

    def feed_raw(self, **body: Any) -> None:
        """A frame the codec would never encode (to reach the decoder's checks)."""
        self.conn.inbox.append(msgpack.packb(body, use_bin_type=True))
        self.session.receive()

    def sent(self) -> list[Message]:
        out = [decode(f, LIMITS) for f in self.conn.sent]
        self.conn.sent.clear()
        return out  # type: ignore[return-value]

    def hello(self, **over: Any) -> Hello:
        fields: dict[str, Any] = {
            "wire": (WIRE_MAJOR, WIRE_MINOR),
            "epoch": 99,
            "address": PEER,
            "descriptor": b"theirs",
            "num_blocks": PEER_BLOCKS,
            "block_len": 16,
            "fingerprint": "",
            "hash_seed": "",
        }
        fields.update(over)
        return Hello(**fields)

    def handshake(self) -> None:
        self.feed(self.hello(), HelloAck(7))
        assert self.session.state is State.READY
        self.sent()

    def tick(self, advance: float = 0.0) -> None:
        """One tier tick: data completions first, then due timers, then collect results."""
        self.now += advance
        done, failed = self.data.poll(PEER)
        for ok, ids in ((True, done), (False, failed)):
            for tid in ids:
                owner = self.env.owners.pop(tid, None)
                if owner is not None:
                    owner.on_data(tid, ok)
        self.deadlines.fire_due(self.now)
        self.take()

    def reap(self) -> None:
        """Close the session if it became unusable, as the tier does at its safe points."""
        s = self.session
        if s.doomed is not None:
            s.close(s.doomed.outcome, s.doomed.reason, bye=s.doomed.bye)
        elif not s.conn.alive:
            s.close(Outcome.PEER_DEAD, f"connection to {PEER} lost")
        self.take()

    def take(self) -> None:
        for r in self.ledger.take():
            assert r.job_id not in self.results, f"duplicate result {r}"
            self.results[r.job_id] = r.outcome
            self.details[r.job_id] = r.detail

    def load(self, job_id: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        self.ledger.open(job_id, True, kv, PEER)
        self.session.consumer.submit(Job(job_id, keys, slots, True, RequestContext("c")), kv)
        self.take()

    def store(self, job_id: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        """As the tier does it: to the bound session, else parked."""
        self.ledger.open(job_id, False, kv)
        job = Job(job_id, keys, slots, False, RequestContext("p"))
        if self.dir.bound(kv) is self.session.producer:
            self.session.producer.add_store(kv, job)
        else:
            self.dir.park(kv, job)
        self.take()

    def finish_read(self, rid: int, ok: bool = True, advance: float = 0.0) -> None:
        self.data.finish(rid, ok)
        self.tick(advance)

    def doom(self) -> Doom | None:
        """Why the session must close, if it must."""
        return self.session.doomed

    def doomed(self) -> Doom:
        """Why the session must close (the test expects it to)."""
        doom = self.session.doomed
        assert doom is not None, "the session is not doomed"
        return doom

    def since(self, mark: int) -> list[Event]:
        return self.events[mark:]


def reads_posted(rig: Rig) -> list[tuple[list[int], list[int]]]:
    """Every read the rig's session posted, as (our slots, the peer's slots)."""
    return [(loc, rem) for _, loc, rem in rig.data.posted]


def cancelled_at(events: list[Event], rid: int) -> int:
    """Index of the ``cancel`` event that ended read ``rid``."""
    return next(i for i, e in enumerate(events) if e[0] == "cancel" and rid in e[1])


def failed_ids(rig: Rig) -> set[str]:
    """The consumer ids marked failed (the tests use no others)."""
    ids = {kv for kv in ("r", "q", "idle") if kv in rig.env.failed_loads}
    assert len(ids) == len(rig.env.failed_loads)
    return ids


def round_failed(kv: str, no: int, reason: str) -> RoundFailed:
    """A ``round_failed`` as a producer sends it: its outcome also heads the reason."""
    return RoundFailed(kv, no, reason, reason.partition(":")[0])


def as_round_failed(msg: Message) -> RoundFailed:
    """``msg``, which must be a ``round_failed``."""
    assert isinstance(msg, RoundFailed), msg
    return msg
