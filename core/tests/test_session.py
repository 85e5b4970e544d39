"""Session unit tests: handshake, dispatch, client and server roles, one message at a time.

The test plays the peer: it feeds encoded frames into a fake connection and decodes what the
session sent. The data transport is a scripted fake whose reads stay in flight until the test
finishes them; the producer directory is the real one; the clock is a fake advanced by the test
and timers fire through ``Deadlines.fire_due`` (as the tier does: data first, then timers).

Wire 2.0: the consumer owns every write into its region. It sends ``fetch`` (keys only), the
producer answers ``ready`` (which of its slots hold which positions, pinned for the lease),
the consumer posts the reads and ends the round with ``release``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Any, ClassVar

import msgpack
import pytest
from p2pkv.config import Limits, Timeouts
from p2pkv.contracts import (
    EMPTY_POLL,
    Capabilities,
    ControlConnection,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import (
    ConnectionClosed,
    FrameTooLarge,
    PeerRejected,
    ProtocolError,
    TransferSubmitError,
)
from p2pkv.observers import Observers
from p2pkv.protocol import (
    WIRE_MAJOR,
    WIRE_MINOR,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Ready,
    Release,
    RoundFailed,
    decode,
    encode,
    message_type,
)
from p2pkv.session import Deadlines, JobLedger, LocalIdentity, Session, SessionEnv, State
from p2pkv.session.consumer_role import LEASE_DRIFT, failure_outcome
from p2pkv.session.producers import ProducerDirectory
from p2pkv.types import Job, LookupResult, Outcome, RequestContext

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

    def read_blocks(self, peer_id: str, local_idxs: Sequence[int],
                    remote_idxs: Sequence[int]) -> int:
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

    def __init__(self, *, timeouts: Timeouts | None = None, peer_blocks: int = PEER_BLOCKS,
                 **local: Any) -> None:
        self.now = 100.0
        self.events: list[Event] = []
        self.conn = FakeConn(self.events)
        self.data = FakeData(self.events, peer_blocks)
        self.deadlines = Deadlines()
        self.ledger = LoggingLedger(self.events, self.clock, Observers())
        self.timeouts = timeouts or Timeouts()
        self.dir = ProducerDirectory(self.ledger, self.deadlines, self.clock, self.timeouts,
                                     Observers())
        ident: dict[str, Any] = {"address": "me:1", "epoch": 7, "descriptor": b"ours",
                                 "num_blocks": OUR_BLOCKS, "block_len": 16, "fingerprint": "",
                                 "hash_seed": ""}
        ident.update(local)
        self.env = SessionEnv(
            data=self.data, ledger=self.ledger, deadlines=self.deadlines, clock=self.clock,
            observers=Observers(), timeouts=self.timeouts, limits=LIMITS,
            local=LocalIdentity(**ident), producers=self.dir,
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
        fields: dict[str, Any] = {"wire": (WIRE_MAJOR, WIRE_MINOR), "epoch": 99, "address": PEER,
                                  "descriptor": b"theirs", "num_blocks": PEER_BLOCKS,
                                  "block_len": 16, "fingerprint": "", "hash_seed": ""}
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

    def doom(self) -> Any:
        return self.session.doomed

    def since(self, mark: int) -> list[Event]:
        return self.events[mark:]


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    assert r.data.violations == []


@pytest.fixture
def consumer(rig: Rig) -> Rig:
    """A ready session about to load."""
    rig.handshake()
    return rig


@pytest.fixture
def producer(rig: Rig) -> Rig:
    """A ready session whose local producer request ``r`` is running."""
    rig.handshake()
    rig.dir.producer_started("r")
    return rig


def _reads(rig: Rig) -> list[tuple[list[int], list[int]]]:
    return [(loc, rem) for _, loc, rem in rig.data.posted]


def _cancelled_at(events: list[Event], rid: int) -> int:
    """Index of the ``cancel`` event that ended read ``rid``."""
    return next(i for i, e in enumerate(events) if e[0] == "cancel" and rid in e[1])


def _failed_ids(rig: Rig) -> set[str]:
    """The consumer ids marked failed (the tests use no others)."""
    ids = {kv for kv in ("r", "q", "idle") if kv in rig.env.failed_loads}
    assert len(ids) == len(rig.env.failed_loads)
    return ids


def round_failed(kv: str, no: int, reason: str) -> RoundFailed:
    """A ``round_failed`` as a producer sends it: its outcome also heads the reason."""
    return RoundFailed(kv, no, reason, reason.partition(":")[0])


def _failed(msg: Message) -> RoundFailed:
    assert isinstance(msg, RoundFailed), msg
    return msg


# -- handshake ---------------------------------------------------------------------------------


def test_start_sends_our_hello(rig: Rig) -> None:
    (hello,) = rig.sent()
    assert hello == Hello((WIRE_MAJOR, WIRE_MINOR), 7, "me:1", b"ours", OUR_BLOCKS, 16, "", "",
                          lease_ms=int(rig.timeouts.lease * 1000))
    assert (WIRE_MAJOR, WIRE_MINOR) == (2, 1)


@pytest.mark.parametrize("after, outcome", [(4.9, Outcome.DONE),
                                            (5.0, Outcome.TRANSFER_FAILED)])
def test_a_shorter_lease_announced_by_the_producer_bounds_our_reads(
        rig: Rig, after: float, outcome: Outcome) -> None:
    """Peers configured with different leases: the consumer trusts the shorter one (5 s here,
    less the drift allowance), never its own longer one."""
    rig.feed(rig.hello(lease_ms=5000), HelloAck(7))
    rig.sent()
    assert rig.session.read_window == pytest.approx(5 * (1 - LEASE_DRIFT))
    rig.load(1, "r", [b"a"], [4])
    rig.sent()
    rig.feed(Ready("r", 0, [0], [1]))
    (rid,) = rig.data.reads
    rig.finish_read(rid, advance=after)
    assert rig.results == {1: outcome}


def test_peer_hello_registers_and_acks_ready_only_after_our_ack(rig: Rig) -> None:
    rig.sent()
    rig.feed(rig.hello())
    assert rig.data.peers == {PEER: b"theirs"}
    assert len(rig.env.data_peers) == 1
    assert rig.sent() == [HelloAck(99)]
    assert rig.session.state is State.HANDSHAKE
    rig.feed(HelloAck(7))
    assert rig.session.ready


def test_rounds_submitted_before_the_handshake_are_sent_once_ready(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [3])
    assert rig.sent() == []
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99), Fetch("r", 0, [b"a"])]


@pytest.mark.parametrize("over, fragment", [
    ({"wire": (1, 0)}, f"wire version 1.0 is incompatible with ours {WIRE_MAJOR}.{WIRE_MINOR}"),
    ({"wire": (1, 7)}, "wire version 1.7 is incompatible"),
    ({"wire": (WIRE_MAJOR + 1, 0)}, "major versions differ"),
    ({"block_len": 32}, "block_len 32"),
    ({"hash_seed": "42"}, "seed"),
    ({"address": "other:2"}, "not the connection's peer address"),
])
def test_incompatible_hello_is_rejected_with_a_bye_that_says_why(rig: Rig, over: dict[str, Any],
                                                                 fragment: str) -> None:
    rig.sent()
    rig.feed(rig.hello(**over))
    doom = rig.doom()
    assert doom.outcome is Outcome.PEER_REJECTED and fragment in doom.reason
    assert doom.bye.startswith("rejected: ") and fragment in doom.bye
    assert rig.data.peers == {}
    assert rig.session.env.counters["handshake_rejections"] == 1
    rig.reap()
    assert rig.sent() == [Bye(doom.bye, "peer_rejected")] and rig.session.state is State.CLOSED


def test_a_newer_minor_version_is_accepted(rig: Rig) -> None:
    rig.feed(rig.hello(wire=(WIRE_MAJOR, WIRE_MINOR + 3)), HelloAck(7))
    assert rig.session.ready and rig.doom() is None


def test_fingerprints_are_compared_only_when_both_sides_have_one() -> None:
    a = Rig(fingerprint="abc")
    a.feed(a.hello(fingerprint=""), HelloAck(7))
    assert a.session.ready
    b = Rig(fingerprint="abc")
    b.feed(b.hello(fingerprint="def"))
    assert b.doom().outcome is Outcome.PEER_REJECTED and "fingerprint" in b.doom().reason


def test_data_transport_refusing_the_descriptor_rejects_the_peer(rig: Rig) -> None:
    rig.data.reject_peer = "descriptor is garbage"
    rig.feed(rig.hello())
    assert rig.doom().outcome is Outcome.PEER_REJECTED
    assert "descriptor is garbage" in rig.doom().reason
    assert len(rig.env.data_peers) == 0


@pytest.mark.parametrize("msg", [
    Fetch("r", 0, [b"a"]), Lookup(0, "r", [b"a"]), Ready("r", 0, [0], [1]),
    Release("r", 0, True), round_failed("r", 0, "demand_unmet: x"), LookupResp(0, [True]),
], ids=lambda m: message_type(m))
def test_messages_before_the_handshake_are_protocol_errors(rig: Rig, msg: Message) -> None:
    rig.feed(rig.hello(), msg)  # peer hello seen, but our hello not acked yet
    doom = rig.doom()
    assert doom.outcome is Outcome.PROTOCOL_ERROR
    assert f"{message_type(msg)}: received before the handshake completed" in doom.reason
    assert doom.bye.startswith("protocol error")


def test_hello_ack_must_echo_our_epoch(rig: Rig) -> None:
    rig.feed(rig.hello(), HelloAck(8))
    assert "hello_ack.epoch: 8 does not echo our epoch 7" in rig.doom().reason


def test_duplicate_hello_of_the_same_incarnation_is_a_protocol_error(rig: Rig) -> None:
    rig.handshake()
    rig.feed(rig.hello())
    assert "hello: duplicate hello" in rig.doom().reason


def test_hello_with_a_new_epoch_hands_the_frames_back_for_a_fresh_session(rig: Rig) -> None:
    rig.handshake()
    rest = rig.feed(rig.hello(epoch=100), Fetch("r", 0, [b"a"]))
    assert rest is not None and len(rest) == 2
    assert decode(rest[0], LIMITS) == rig.hello(epoch=100)
    assert rig.doom() is None


@pytest.mark.parametrize("reason, outcome", [
    ("rejected: block_len", Outcome.PEER_REJECTED),
    ("protocol error: x", Outcome.PROTOCOL_ERROR),
    ("shutdown", Outcome.PEER_DEAD),
])
def test_bye_from_a_wire_2_0_peer_names_its_outcome_in_the_reason(rig: Rig, reason: str,
                                                                  outcome: Outcome) -> None:
    rig.feed_raw(type="bye", reason=reason)
    assert rig.doom().outcome is outcome and rig.doom().bye is None


@pytest.mark.parametrize("bye, outcome, fragment", [
    (Bye("block_len 32 differs", "peer_rejected"), Outcome.PEER_REJECTED,
     "rejected us: block_len 32 differs"),
    (Bye("rejected: seed", "peer_rejected"), Outcome.PEER_REJECTED, "rejected us: seed"),
    (Bye("bad frame", "protocol_error"), Outcome.PROTOCOL_ERROR, "peer said bye: bad frame"),
    (Bye("rejected: but the field says otherwise", "peer_dead"), Outcome.PEER_DEAD, "bye"),
    (Bye("x", "done"), Outcome.PEER_DEAD, "peer said bye: x"),
    (Bye("x", "from_the_future"), Outcome.PEER_DEAD, "peer said bye: x"),
])
def test_bye_outcome_field_decides(rig: Rig, bye: Bye, outcome: Outcome, fragment: str) -> None:
    rig.feed(bye)
    assert rig.doom().outcome is outcome and fragment in rig.doom().reason


def test_our_byes_tell_the_peer_its_outcome(rig: Rig) -> None:
    rig.handshake()
    rig.session.close(Outcome.SHUTDOWN, "shutdown", bye="shutdown")
    assert rig.sent() == [Bye("shutdown", "peer_dead")]


def test_unknown_types_are_errors_unless_the_peer_is_newer() -> None:
    older = Rig()
    older.handshake()
    older.feed_raw(type="gossip")
    assert "frame.type: unknown message type 'gossip'" in older.doom().reason
    newer = Rig()
    newer.feed(newer.hello(wire=(WIRE_MAJOR, WIRE_MINOR + 1)), HelloAck(7))
    newer.feed_raw(type="gossip")
    assert newer.doom() is None and newer.session.ready


@pytest.mark.parametrize("old", ["abort", "abort_ack", "quiesced", "transfer_done"])
def test_push_era_messages_are_unknown_types_now(rig: Rig, old: str) -> None:
    rig.handshake()
    rig.feed_raw(type=old, kv_request_id="r", round=0)
    assert f"unknown message type {old!r}" in rig.doom().reason


def test_handshake_deadline(rig: Rig) -> None:
    rig.tick(9.9)
    assert rig.doom() is None
    rig.tick(0.2)
    assert rig.doom().outcome is Outcome.PEER_DEAD and "handshake" in rig.doom().reason
    assert rig.doom().bye == "handshake timeout"


def test_malformed_frames_doom_only_this_session(rig: Rig) -> None:
    rig.handshake()
    rig.conn.inbox.append(b"\xc1")
    rig.session.receive()
    assert rig.doom().outcome is Outcome.PROTOCOL_ERROR
    assert "not a valid msgpack" in rig.doom().reason
    assert rig.env.counters["protocol_errors"] == 1


@pytest.mark.parametrize("body, fragment", [
    ({"type": "ready", "kv_request_id": "r", "round": 0, "pos": [0], "slots": [1, 2]},
     "ready.slots: 2 slots for 1 positions"),
    ({"type": "ready", "kv_request_id": "r", "round": 0, "pos": [], "slots": []},
     "ready.pos: must not be empty"),
    ({"type": "release", "kv_request_id": "r", "round": 0, "read": 1},
     "release.read: expected a boolean, got int"),
    ({"type": "round_failed", "kv_request_id": "r", "round": 0, "reason": ""},
     "round_failed.reason: must not be empty"),
    ({"type": "fetch", "kv_request_id": "r", "round": 0, "keys": ["a"]},
     "fetch.keys[0]: expected bytes, got str"),
])
def test_malformed_messages_are_protocol_errors_naming_the_field(rig: Rig, body: dict[str, Any],
                                                                 fragment: str) -> None:
    rig.handshake()
    rig.feed_raw(**body)
    doom = rig.doom()
    assert doom.outcome is Outcome.PROTOCOL_ERROR and fragment in doom.reason
    assert doom.reason.startswith("protocol error: ") and doom.bye == doom.reason


def test_consecutive_internal_errors_reach_the_threshold(rig: Rig, monkeypatch: Any) -> None:
    rig.handshake()

    def boom(msg: Release) -> None:
        raise RuntimeError("bug")

    monkeypatch.setitem(rig.session._handlers, Release, boom)
    for _ in range(LIMITS.max_consecutive_internal_errors - 1):
        rig.feed(Release("r", 0, False))
        rig.feed(round_failed("nobody", 0, "x"))  # a successful dispatch resets the counter
    assert rig.doom() is None and rig.session.internal_errors == 0
    rig.feed(*[Release("r", i, False) for i in range(LIMITS.max_consecutive_internal_errors)])
    assert rig.doom().outcome is Outcome.PROTOCOL_ERROR
    assert "consecutive internal errors, last: RuntimeError: bug" in rig.doom().reason


def test_a_failed_send_dooms_the_session(rig: Rig) -> None:
    rig.handshake()
    rig.conn.fail_send = True
    rig.load(1, "r", [b"a"], [0])
    assert rig.doom().outcome is Outcome.PEER_DEAD and "send failed" in rig.doom().reason


# -- consumer: fetch, ready, reads, release ----------------------------------------------------


def test_fetch_has_no_slots_and_ready_posts_reads_into_our_slots(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b", b"c"], [4, 5, 6])
    assert consumer.sent() == [Fetch("r", 0, [b"a", b"b", b"c"])]
    consumer.feed(Ready("r", 0, [2, 0, 1], [9, 1, 31]))
    assert consumer.data.posted == [(PEER, [6, 4, 5], [9, 1, 31])]
    (rid,) = consumer.data.reads
    assert consumer.env.owners == {rid: consumer.session.consumer}
    assert consumer.results == {} and consumer.sent() == []
    consumer.finish_read(rid)
    assert consumer.results == {1: Outcome.DONE} and consumer.details[1] == ""
    assert consumer.sent() == [Release("r", 0, True)]
    assert consumer.env.counters["blocks_read"] == 3
    assert consumer.session.consumer.n_rounds == 0 and consumer.deadlines.next_due() is None
    consumer.session.consumer.finish("r")  # only now the producer is told the request is over
    assert consumer.sent() == [Fetch("r", 1, [])]
    assert consumer.session.consumer.reqs == {}


def test_partial_readies_post_one_read_each_and_the_round_ends_after_the_last(
        consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b", b"c", b"d"], [4, 5, 6, 7])
    consumer.sent()
    consumer.feed(Ready("r", 0, [1], [20]))
    consumer.feed(Ready("r", 0, [3, 0], [21, 22]))
    assert _reads(consumer) == [([5], [20]), ([7, 4], [21, 22])]
    first, second = consumer.data.reads
    consumer.finish_read(second)
    consumer.finish_read(first)
    assert consumer.results == {}  # position 2 was never announced
    consumer.feed(Ready("r", 0, [2], [23]))
    (third,) = consumer.data.reads
    consumer.finish_read(third)
    assert consumer.results == {1: Outcome.DONE}
    assert consumer.sent() == [Release("r", 0, True)]


def test_rounds_of_one_request_complete_independently(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.load(2, "r", [b"c"], [6])
    assert consumer.sent() == [Fetch("r", 0, [b"a", b"b"]), Fetch("r", 1, [b"c"])]
    consumer.feed(round_failed("r", 1, "demand_unmet: 1 block missing"))
    assert consumer.results == {2: Outcome.DEMAND_UNMET}
    assert consumer.details[2] == "producer: demand_unmet: 1 block missing"
    assert consumer.sent() == [Release("r", 1, False)]  # no terminal fetch: round 0 is open
    assert "r" in consumer.env.failed_loads
    consumer.feed(Ready("r", 0, [0, 1], [1, 2]))
    (rid,) = consumer.data.reads
    consumer.finish_read(rid)
    assert consumer.results[1] is Outcome.DONE
    assert consumer.sent() == [Release("r", 0, True), Fetch("r", 2, [])]
    consumer.feed(round_failed("r", 0, "load_timeout: late"))  # late: ignored
    consumer.take()
    assert len(consumer.results) == 2 and consumer.doom() is None


@pytest.mark.parametrize("value, outcome", [
    ("demand_unmet", Outcome.DEMAND_UNMET), ("submit_failed", Outcome.SUBMIT_FAILED),
    ("request_conflict", Outcome.REQUEST_CONFLICT), ("shutdown", Outcome.SHUTDOWN),
    ("peer_dead", Outcome.PEER_DEAD), ("load_timeout", Outcome.LOAD_TIMEOUT),
    ("done", Outcome.TRANSFER_FAILED), ("nothing_to_do", Outcome.TRANSFER_FAILED),
    ("gibberish", Outcome.TRANSFER_FAILED), ("", Outcome.TRANSFER_FAILED),
])
def test_round_failed_outcomes(value: str, outcome: Outcome) -> None:
    assert failure_outcome(value) is outcome


@pytest.mark.parametrize("reason, outcome", [
    ("demand_unmet: 1 demanded block(s) were never stored", Outcome.DEMAND_UNMET),
    ("peer_dead: the producer is shutting down", Outcome.PEER_DEAD),
    ("load_timeout: the consumer did not release it", Outcome.LOAD_TIMEOUT),
    ("something new", Outcome.TRANSFER_FAILED),
])
def test_round_failed_cancels_the_reads_and_releases(consumer: Rig, reason: str,
                                                     outcome: Outcome) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [3]))
    (rid,) = consumer.data.reads
    mark = len(consumer.events)
    consumer.feed(round_failed("r", 0, reason))
    consumer.take()
    assert consumer.results == {1: outcome} and consumer.details[1] == f"producer: {reason}"
    assert consumer.data.cancelled == [[rid]] and consumer.data.reads == {}
    events = consumer.since(mark)
    assert events.index(("cancel", [rid])) < events.index(("result", 1, outcome))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert consumer.env.owners == {}


def test_a_failed_read_fails_the_round_and_cancels_its_other_reads(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b", b"c"], [4, 5, 6])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]), Ready("r", 0, [1, 2], [2, 3]))
    bad, other = consumer.data.reads
    mark = len(consumer.events)
    consumer.finish_read(bad, ok=False)
    assert consumer.results == {1: Outcome.TRANSFER_FAILED}
    assert consumer.details[1] == f"read {bad} failed"
    assert consumer.data.cancelled == [[other]] and consumer.data.reads == {}
    events = consumer.since(mark)
    assert events.index(("cancel", [other])) < events.index(("result", 1,
                                                              Outcome.TRANSFER_FAILED))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert consumer.env.counters["transfers_failed"] == 1
    assert str(consumer.env.failed_loads.get("r")).startswith("transfer_failed: ")


def test_read_blocks_refused_fails_the_round_with_submit_failed(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]))
    (first,) = consumer.data.reads
    consumer.data.fail_submit = True
    consumer.feed(Ready("r", 0, [1], [2]))
    consumer.take()
    assert consumer.results == {1: Outcome.SUBMIT_FAILED}
    assert consumer.details[1] == "read_blocks failed: TransferSubmitError: refused"
    assert consumer.env.counters["submit_failures"] == 1
    assert consumer.data.cancelled == [[first]]
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert consumer.doom() is None


def test_load_timeout_cancels_the_reads_before_reporting(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]))
    (rid,) = consumer.data.reads
    consumer.tick(29.9)
    assert consumer.results == {}
    mark = len(consumer.events)
    consumer.tick(0.2)
    assert consumer.results == {1: Outcome.LOAD_TIMEOUT}
    assert consumer.details[1] == "2 of 2 block(s) not read within 30.0s"
    events = consumer.since(mark)
    assert events[0] == ("cancel", [rid])  # first thing: nothing can land after it
    assert events.index(("cancel", [rid])) < events.index(("result", 1, Outcome.LOAD_TIMEOUT))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert consumer.data.reads == {} and consumer.env.owners == {}


def test_load_timeout_without_any_ready(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [4])
    consumer.sent()
    consumer.tick(30.1)
    assert consumer.results == {1: Outcome.LOAD_TIMEOUT}
    assert consumer.data.cancelled == []  # nothing was in flight
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]


def test_load_timeout_of_a_round_never_sent(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [4])
    rig.deadlines.cancel(rig.session.timer)  # keep the handshake deadline out of it
    rig.tick(30.1)
    assert rig.results == {1: Outcome.LOAD_TIMEOUT}
    assert rig.details[1] == "never sent: handshake not complete"
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99)]  # neither the fetch nor a release


LEASE_LIMIT = Timeouts().lease * (1 - LEASE_DRIFT)


@pytest.mark.parametrize("after, outcome", [
    (LEASE_LIMIT - 0.05, Outcome.DONE),
    (LEASE_LIMIT + 0.05, Outcome.TRANSFER_FAILED),
])
def test_a_read_is_accepted_only_within_the_lease_of_the_fetch(consumer: Rig, after: float,
                                                               outcome: Outcome) -> None:
    """We were paused with a read in flight (no timer ran); on waking the tier polls the data
    plane before it fires timers, so the read's completion is judged on the lease."""
    consumer.load(1, "r", [b"a"], [4])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]))
    (rid,) = consumer.data.reads
    consumer.finish_read(rid, advance=after)
    assert consumer.results == {1: outcome}
    if outcome is Outcome.DONE:
        assert consumer.sent() == [Release("r", 0, True)]
    else:
        assert "past the producer's lease (39.6s usable)" in consumer.details[1]
        assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
        assert consumer.env.counters["blocks_read"] == 0
    consumer.tick()  # the load timer was disarmed with the result
    assert len(consumer.results) == 1


def test_the_lease_counts_from_the_fetch_being_sent_not_from_the_submit(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [4])
    rig.now = 109.0
    rig.feed(rig.hello(), HelloAck(7))  # the fetch goes out now
    rig.sent()
    rig.feed(Ready("r", 0, [0], [1]))
    (rid,) = rig.data.reads
    rig.data.finish(rid)
    rig.now = 100.0 + LEASE_LIMIT + 0.05  # past the lease from the submit, not from the send
    rig.tick()
    assert rig.results == {1: Outcome.DONE}


def test_finish_mid_load_cancels_the_reads_reports_at_once_and_releases(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.sent()
    consumer.feed(Ready("r", 0, [1], [7]))
    (rid,) = consumer.data.reads
    mark = len(consumer.events)
    consumer.session.consumer.finish("r")
    consumer.take()
    assert consumer.results == {1: Outcome.REQUEST_FINISHED}
    events = consumer.since(mark)
    assert events.index(("cancel", [rid])) < events.index(("result", 1,
                                                            Outcome.REQUEST_FINISHED))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]  # then terminal
    assert "r" not in consumer.env.failed_loads and consumer.session.consumer.reqs == {}
    consumer.feed(Ready("r", 0, [0], [8]))  # crossed our release: ignored
    assert consumer.data.reads == {} and consumer.doom() is None


def test_finish_before_the_handshake_reports_at_once_and_sends_nothing(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [0])
    rig.session.consumer.finish("r")
    rig.take()
    assert rig.results == {1: Outcome.REQUEST_FINISHED}
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99)]


def test_a_failed_load_ends_the_request_with_the_producer_and_marks_the_id(
        consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.sent()
    consumer.feed(round_failed("r", 0, "transfer_failed: x"))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert _failed_ids(consumer) == {"r"}
    consumer.load(2, "r", [b"b"], [1])  # the request was ended with its producer
    assert consumer.results[2] is Outcome.REQUEST_CONFLICT
    assert "already ended with its producer" in consumer.details[2]
    assert consumer.sent() == []


def test_a_load_of_keys_already_being_loaded_is_a_request_conflict(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [0, 1])
    consumer.load(2, "r", [b"b", b"c"], [2, 3])
    consumer.take()
    assert consumer.results == {2: Outcome.REQUEST_CONFLICT}
    assert "1 of its blocks are already being loaded for request 'r' by job 1" in \
        consumer.details[2]
    assert consumer.sent() == [Fetch("r", 0, [b"a", b"b"])]  # job 1 goes on
    assert "r" not in consumer.env.failed_loads
    consumer.load(3, "r", [b"c"], [3])
    assert consumer.sent() == [Fetch("r", 1, [b"c"])]


@pytest.mark.parametrize("msg, fragment", [
    (Ready("r", 5, [0], [1]), "ready.round: round 5 of 'r' was never sent"),
    (Ready("r", 1, [0], [1]), "ready.round: round 1 of 'r' was never sent"),
    (round_failed("r", 3, "demand_unmet: x"), "round_failed.round: round 3 of 'r' was never sent"),
])
def test_messages_for_a_round_never_sent_are_protocol_errors(consumer: Rig, msg: Message,
                                                             fragment: str) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.feed(msg)
    assert consumer.doom().outcome is Outcome.PROTOCOL_ERROR and fragment in consumer.doom().reason
    assert consumer.data.posted == []


@pytest.mark.parametrize("readies, fragment", [
    ([Ready("r", 0, [0, 0], [1, 2])], "ready.pos: position 0 is outside the round's 2 key(s) "
                                      "or was already announced"),
    ([Ready("r", 0, [1], [1]), Ready("r", 0, [0, 1], [2, 3])], "ready.pos: position 1"),
    ([Ready("r", 0, [2], [1])], "ready.pos: position 2 is outside the round's 2 key(s)"),
    ([Ready("r", 0, [0], [PEER_BLOCKS])],
     f"ready.slots: slot {PEER_BLOCKS} is outside the producer's region 0..{PEER_BLOCKS - 1}"),
])
def test_bad_readies_are_protocol_errors(consumer: Rig, readies: list[Ready],
                                         fragment: str) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.feed(*readies)
    doom = consumer.doom()
    assert doom is not None and doom.outcome is Outcome.PROTOCOL_ERROR
    assert fragment in doom.reason
    assert len(consumer.data.posted) == len(readies) - 1  # nothing posted for the bad one
    consumer.reap()
    assert consumer.results == {1: Outcome.PROTOCOL_ERROR} and consumer.data.reads == {}


def test_a_ready_for_the_last_slot_of_the_producer_is_fine(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [OUR_BLOCKS - 1])
    consumer.feed(Ready("r", 0, [0], [PEER_BLOCKS - 1]))
    assert _reads(consumer) == [([OUR_BLOCKS - 1], [PEER_BLOCKS - 1])]
    assert consumer.doom() is None


@pytest.mark.parametrize("end", ["timeout", "read_failed", "done", "finished", "unknown_kv"])
def test_a_ready_for_a_round_that_already_ended_here_is_ignored(consumer: Rig, end: str) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.load(2, "r", [b"c"], [6])  # keeps the request open
    if end == "timeout":
        consumer.tick(30.1)
    elif end == "read_failed":
        consumer.feed(Ready("r", 0, [0], [1]))
        consumer.finish_read(next(iter(consumer.data.reads)), ok=False)
    elif end == "done":
        consumer.feed(Ready("r", 0, [0, 1], [1, 2]))
        consumer.finish_read(next(iter(consumer.data.reads)))
    elif end == "finished":
        consumer.session.consumer.finish("r")
    posted = len(consumer.data.posted)
    kv = "elsewhere" if end == "unknown_kv" else "r"
    consumer.feed(Ready(kv, 0, [1], [3]))
    assert consumer.doom() is None and len(consumer.data.posted) == posted
    consumer.feed(round_failed(kv, 0, "load_timeout: late"))
    assert consumer.doom() is None


@pytest.mark.parametrize("death", ["conn_dies", "bye", "closed"])
def test_session_death_cancels_reads_and_fails_loads_at_once(consumer: Rig, death: str) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.load(2, "q", [b"c"], [6])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]), Ready("r", 0, [1], [2]), Ready("q", 0, [0], [3]))
    rids = sorted(consumer.data.reads)
    mark = len(consumer.events)
    if death == "conn_dies":
        consumer.conn.is_alive = False
    elif death == "bye":
        consumer.feed(Bye("shutdown"))
    else:
        consumer.session.close(Outcome.PEER_DEAD, "gone")
    consumer.reap()
    assert consumer.results == {1: Outcome.PEER_DEAD, 2: Outcome.PEER_DEAD}
    assert sorted(i for ids in consumer.data.cancelled for i in ids) == rids
    events = consumer.since(mark)
    assert _cancelled_at(events, rids[0]) < events.index(("result", 1, Outcome.PEER_DEAD))
    assert _cancelled_at(events, rids[2]) < events.index(("result", 2, Outcome.PEER_DEAD))
    assert ("send", "release") not in events and consumer.sent() == []  # nothing to wait for
    assert consumer.data.reads == {} and consumer.env.owners == {}
    assert consumer.session.state is State.CLOSED and _failed_ids(consumer) == {"r", "q"}
    assert len(consumer.deadlines) == 0


def test_closing_fails_loads_and_marks_ids(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.session.consumer.open_request("idle")
    consumer.session.close(Outcome.PEER_DEAD, "gone")
    consumer.take()
    assert consumer.results == {1: Outcome.PEER_DEAD} and consumer.details[1] == "gone"
    assert _failed_ids(consumer) == {"r", "idle"}
    assert consumer.session.state is State.CLOSED


def test_consumer_wind_down_fails_loads_at_once(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.sent()
    consumer.feed(Ready("r", 0, [0], [1]))
    (rid,) = consumer.data.reads
    assert not consumer.session.wound_down and consumer.session.busy
    mark = len(consumer.events)
    consumer.session.wind_down()
    consumer.take()
    assert consumer.results == {1: Outcome.SHUTDOWN}
    assert consumer.details[1] == "tier shut down during the load"
    events = consumer.since(mark)
    assert events.index(("cancel", [rid])) < events.index(("result", 1, Outcome.SHUTDOWN))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert consumer.session.wound_down and consumer.data.reads == {}


def test_consumer_wind_down_before_the_handshake(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [4])
    rig.session.wind_down()
    rig.take()
    assert rig.results == {1: Outcome.SHUTDOWN} and rig.session.wound_down
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99)]


# -- consumer: probes --------------------------------------------------------------------------


def test_symmetric_probes_batch_per_request_and_resolve(consumer: Rig) -> None:
    client = consumer.session.consumer
    assert client.probe("r", b"a") is LookupResult.RETRY
    assert client.probe("r", b"b") is LookupResult.RETRY
    assert client.probe("q", b"c") is LookupResult.RETRY
    client.flush_lookups()
    assert consumer.sent() == [Lookup(0, "r", [b"a", b"b"]), Lookup(1, "q", [b"c"])]
    client.flush_lookups()
    assert consumer.sent() == []
    assert client.probe("r", b"a") is LookupResult.RETRY
    consumer.feed(LookupResp(0, [True, False]))
    assert client.probe("r", b"a") is LookupResult.HIT
    assert client.probe("r", b"b") is LookupResult.MISS
    consumer.tick(10.1)  # lookup 1 never answered: MISS
    assert client.probe("q", b"c") is LookupResult.MISS
    consumer.feed(LookupResp(1, [True]))  # late: ignored
    assert client.probe("q", b"c") is LookupResult.MISS and consumer.doom() is None


@pytest.mark.parametrize("resp, fragment", [
    (LookupResp(5, [True]), "lookup_resp.seq: 5 was never sent"),
    (LookupResp(0, [True, True]), "lookup_resp.hits: 2 answers for 1 keys"),
])
def test_bad_lookup_responses(consumer: Rig, resp: LookupResp, fragment: str) -> None:
    consumer.session.consumer.probe("r", b"a")
    consumer.session.consumer.flush_lookups()
    consumer.feed(resp)
    assert fragment in consumer.doom().reason


def test_finish_after_probes_only_sends_the_terminal_fetch(consumer: Rig) -> None:
    consumer.session.consumer.probe("r", b"a")
    consumer.session.consumer.flush_lookups()
    consumer.sent()
    consumer.session.consumer.finish("r")
    assert consumer.sent() == [Fetch("r", 0, [])]
    assert consumer.session.consumer.state_sizes()["lookups"] == 0 and consumer.session.consumer.reqs == {}


# -- producer: matching and ready ----------------------------------------------------------------


def test_consumer_first_stores_match_as_they_arrive(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a", b"b", b"c"]))
    assert producer.sent() == []
    assert producer.dir.bound("r") is producer.session.producer
    producer.store(1, "r", [b"b", b"x"], [2, 3])
    assert producer.sent() == [Ready("r", 0, [1], [2])]
    producer.store(2, "r", [b"a", b"c"], [4, 5])
    assert producer.sent() == [Ready("r", 0, [0, 2], [4, 5])]
    assert producer.session.producer.n_pins == 3 and producer.results == {}
    producer.feed(Release("r", 0, True))
    producer.take()
    assert producer.results == {2: Outcome.DONE}  # job 1 still offers b"x"
    assert producer.session.producer.n_pins == 0 and producer.env.counters["blocks_sent"] == 3
    producer.feed(Fetch("r", 1, []))  # terminal fetch
    producer.take()
    assert producer.results[1] is Outcome.DONE
    assert producer.details[1] == "consumer needed only part of the blocks"


def test_producer_first_stores_are_replayed_in_order_when_the_fetch_binds(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [1])
    producer.store(2, "r", [b"a", b"b"], [2, 3])  # b"a" again: the first store keeps it
    assert producer.dir.parked_count == 2
    producer.feed(Fetch("r", 0, [b"b", b"a"]))
    assert producer.sent() == [Ready("r", 0, [0, 1], [3, 1])]
    assert producer.dir.bound("r") is producer.session.producer and producer.dir.parked_count == 0
    producer.feed(Release("r", 0, True))
    producer.take()
    assert producer.results == {1: Outcome.DONE, 2: Outcome.DONE}


def test_a_fetch_partly_held_readies_the_held_part_and_waits_for_the_rest(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"b", b"a", b"c"]))
    assert producer.sent() == [Ready("r", 0, [1], [3])]
    producer.store(2, "r", [b"c"], [4])
    producer.store(3, "r", [b"b"], [5])
    assert producer.sent() == [Ready("r", 0, [2], [4]), Ready("r", 0, [0], [5])]
    assert producer.session.producer.state_sizes()["demand"] == 0


def test_a_key_twice_in_one_store_counts_once(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"zz"]))  # binds the request; demand for another key
    producer.store(1, "r", [b"a", b"a", b"b"], [3, 4, 5])
    producer.feed(Fetch("r", 1, [b"a", b"b"]))
    assert producer.sent() == [Ready("r", 1, [0, 1], [3, 5])]
    producer.feed(Release("r", 1, True))
    producer.take()
    assert producer.results == {1: Outcome.DONE}


def test_untouched_parked_stores_are_released_by_the_terminal_fetch(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [1])
    producer.feed(Fetch("r", 0, [b"z"]))
    producer.dir.producer_finished("r")
    producer.session.producer.producer_finished("r")
    assert producer.sent() == [round_failed(
        "r", 0, "demand_unmet: 1 demanded block(s) were never stored by the producer")]
    producer.feed(Release("r", 0, False))  # what the consumer answers: ignored
    producer.feed(Fetch("r", 1, []))
    producer.take()
    assert producer.results == {1: Outcome.NOTHING_TO_DO}
    assert producer.session.producer.reqs == {} and producer.dir.bound("r") is None
    assert producer.doom() is None


def test_unbound_stores_fail_when_no_consumer_fetches(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [1])
    producer.tick(59.9)
    assert producer.results == {}
    producer.tick(0.2)
    assert producer.results == {1: Outcome.UNBOUND_TIMEOUT}
    assert "no consumer fetched 'r' within 60.0s" in producer.details[1]


def test_fetch_validation_against_the_peer(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a", b"b", b"a"]))
    doom = producer.doom()
    assert doom.outcome is Outcome.PROTOCOL_ERROR and "fetch.keys: duplicate key" in doom.reason


def test_a_round_not_above_the_previous_fails_that_round_only(producer: Rig) -> None:
    """E.g. a finished kv_request_id reused while the producer still holds it: a request
    conflict, not a protocol error."""
    producer.feed(Fetch("r", 1, [b"a"]), Fetch("r", 1, [b"b"]))
    assert producer.doom() is None
    failed = _failed(producer.sent()[0])
    assert failed.round == 1 and failed.reason.startswith("request_conflict:")
    assert "round 1 is not above the previous round 1" in failed.reason


def test_a_key_demanded_twice_fails_that_round_and_the_session_goes_on(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]), Fetch("r", 1, [b"a"]))
    assert producer.doom() is None
    failed = _failed(producer.sent()[0])
    assert failed.round == 1 and failed.reason.startswith("request_conflict:")
    assert "demanded by round 0" in failed.reason
    producer.feed(Release("r", 1, False))  # the consumer's answer: ignored
    producer.store(1, "r", [b"a"], [3])  # round 0 still gets its block
    assert producer.sent() == [Ready("r", 0, [0], [3])]
    assert producer.doom() is None


def test_a_fetch_after_the_terminal_fetch_fails_that_round(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]), Release("r", 0, False), Fetch("r", 1, []),
                  Fetch("r", 2, [b"a"]))
    assert producer.doom() is None
    failed = _failed(producer.sent()[-1])
    assert failed.round == 2
    assert failed.reason == "request_conflict: 'r' was already ended by a terminal fetch"


def test_terminal_fetch_for_an_unknown_request_leaves_no_state(producer: Rig) -> None:
    producer.feed(Fetch("nobody", 3, []))
    assert producer.session.producer.reqs == {} and producer.dir.bound("r") is None
    assert producer.doom() is None and producer.sent() == []


def test_fetch_for_a_finished_request_fails_at_once(producer: Rig) -> None:
    producer.dir.producer_finished("r")
    producer.feed(Fetch("r", 0, [b"a"]))
    failed = _failed(producer.sent()[0])
    assert failed.reason.startswith("demand_unmet") and "already finished" in failed.reason
    assert producer.session.producer.reqs == {}
    producer.feed(Release("r", 0, False))  # the consumer's answer: ignored
    assert producer.doom() is None


def test_unmet_demand_fails_the_round_at_once_and_its_pins_wait_for_the_release(
        producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.store(1, "r", [b"a"], [3])
    producer.sent()
    producer.dir.producer_finished("r")
    producer.session.producer.producer_finished("r")
    failed = _failed(producer.sent()[0])
    assert failed.reason.startswith("demand_unmet: 1 demanded block(s)")
    assert producer.results == {} and producer.session.producer.n_pins == 1  # a is pinned
    producer.feed(Release("r", 0, False))
    producer.take()
    assert producer.results == {1: Outcome.ABORTED}
    assert producer.session.producer.reqs == {} and producer.dir.bound("r") is None


# -- producer: release and the lease -------------------------------------------------------------


def test_release_read_delivers_the_store_jobs(producer: Rig) -> None:
    producer.store(1, "r", [b"a", b"b"], [3, 4])
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    assert producer.sent() == [Ready("r", 0, [0, 1], [3, 4])]
    assert producer.session.producer.busy and not producer.session.wound_down
    producer.feed(Release("r", 0, True))
    producer.take()
    assert producer.results == {1: Outcome.DONE} and producer.details[1] == ""
    assert producer.session.producer.state_sizes()["pins"] == 0
    assert producer.session.producer.n_rounds == 0 and producer.session.wound_down


def test_release_not_read_aborts_the_store_jobs(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.store(2, "r", [b"b"], [4])
    producer.feed(Fetch("r", 0, [b"a", b"c"]))  # c never comes
    producer.feed(Release("r", 0, False))
    producer.take()
    assert producer.results == {1: Outcome.ABORTED}
    assert producer.details[1] == "the consumer gave the round up"
    assert producer.session.producer.state_sizes()["demand"] == 0  # c is not waited for
    producer.store(3, "r", [b"c"], [5])
    assert [m for m in producer.sent() if isinstance(m, Ready)] == [Ready("r", 0, [0], [3])]


def test_lease_expiry_without_release_fails_the_pinned_jobs() -> None:
    rig = Rig(timeouts=Timeouts(store=100.0))  # the store deadline must not come first
    rig.handshake()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.feed(Fetch("r", 0, [b"a"]))
    rig.sent()
    rig.tick(39.9)
    assert rig.results == {} and rig.sent() == []
    rig.tick(0.2)
    detail = "the consumer did not release it within the lease (40.0s)"
    assert rig.results == {1: Outcome.TRANSFER_FAILED} and rig.details[1] == detail
    assert rig.sent() == [round_failed("r", 0, f"load_timeout: {detail}")]
    assert rig.session.producer.n_pins == 0 and rig.session.producer.n_rounds == 0
    rig.feed(Release("r", 0, True))  # late: the round ended here
    rig.take()
    assert rig.doom() is None and len(rig.results) == 1


def test_the_lease_runs_from_the_rounds_latest_ready() -> None:
    rig = Rig(timeouts=Timeouts(store=100.0))
    rig.handshake()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a", b"b"]))
    rig.tick(30.0)
    rig.store(1, "r", [b"a"], [3])
    assert rig.sent() == [Ready("r", 0, [0], [3])]
    rig.tick(39.9)  # 69.9s after the fetch, 39.9s after the ready
    assert rig.results == {} and rig.sent() == []
    rig.tick(0.2)
    assert rig.results == {1: Outcome.TRANSFER_FAILED}
    assert _failed(rig.sent()[0]).reason.startswith("load_timeout:")


def test_a_round_its_consumer_gave_up_does_not_hold_demand_forever(producer: Rig) -> None:
    """A fetch for blocks that never come, whose release was lost or never sent: the round
    ends one lease after the fetch arrived."""
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.tick(producer.timeouts.lease - 0.1)
    assert producer.sent() == [] and producer.session.producer.n_rounds == 1
    producer.tick(0.2)
    failed = _failed(producer.sent()[0])
    assert failed.reason.startswith("load_timeout:")
    assert producer.session.producer.state_sizes()["demand"] == 0 and producer.doom() is None
    assert producer.session.producer.n_rounds == 0


@pytest.mark.parametrize("end, outcome", [("release_read", Outcome.STORE_TIMEOUT),
                                          ("release_not_read", Outcome.ABORTED),
                                          ("lease", Outcome.TRANSFER_FAILED)])
def test_a_store_result_waits_while_its_blocks_are_pinned(producer: Rig, end: str,
                                                          outcome: Outcome) -> None:
    """The store deadline passing while a block is being read withdraws the rest from the
    supply; the release (or the lease) decides: read but incomplete -> store_timeout."""
    producer.store(1, "r", [b"a", b"b"], [3, 4])
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.tick(30.1)  # the store deadline passes while the consumer may be reading a
    assert producer.results == {}
    assert producer.session.producer.state_sizes()["supply"] == 0  # b is offered no more
    if end == "lease":
        producer.tick(9.8)
        assert producer.results == {}
        producer.tick(0.2)
    else:
        producer.feed(Release("r", 0, end == "release_read"))
        producer.take()
    assert producer.results == {1: outcome}


def test_release_read_for_a_round_with_unannounced_keys_is_a_protocol_error(
        producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.feed(Release("r", 0, True))
    doom = producer.doom()
    assert doom.outcome is Outcome.PROTOCOL_ERROR
    assert "release.read: round 0 of 'r' still has 1 block(s) never announced" in doom.reason


def test_release_for_a_round_never_fetched_is_a_protocol_error(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.feed(Release("r", 3, False))
    assert "release.round: round 3 of 'r' was never fetched" in producer.doom().reason


@pytest.mark.parametrize("first", [True, False])
def test_release_for_a_round_that_already_ended_is_ignored(producer: Rig, first: bool) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.store(2, "r", [b"b"], [4])  # keeps state for the request after round 0
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.feed(Release("r", 0, first), Release("r", 0, True), Release("r", 0, False))
    producer.take()
    assert producer.doom() is None
    assert producer.results == {1: Outcome.DONE if first else Outcome.ABORTED}


def test_release_for_a_request_the_producer_no_longer_holds_is_ignored(producer: Rig) -> None:
    producer.feed(Release("nobody", 4, True))
    assert producer.doom() is None


def test_terminal_fetch_aborts_the_rounds_still_pinned(producer: Rig) -> None:
    """An honest consumer releases first; the terminal fetch still leaves nothing pinned."""
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]), Fetch("r", 1, []))
    producer.take()
    assert producer.results == {1: Outcome.ABORTED}
    assert producer.details[1] == "the consumer ended the request"
    assert producer.session.producer.n_pins == 0 and producer.session.producer.n_rounds == 0


# -- producer: session end, shutdown ---------------------------------------------------------------


def test_closing_keeps_the_pins_until_the_lease(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.store(2, "r", [b"b"], [4])
    producer.feed(Fetch("r", 0, [b"a"]))  # a is pinned for the consumer, b is not
    producer.tick(5.0)
    producer.session.close(Outcome.PEER_DEAD, "connection lost")
    producer.take()
    assert producer.results == {2: Outcome.PEER_DEAD}
    assert producer.session.state is State.CLOSED and producer.dir.bound("r") is None
    server = producer.session.producer
    assert server.n_pins == 1 and server.busy
    producer.tick(34.9)  # 39.9s after the ready: the cut-off consumer may still be reading
    assert 1 not in producer.results
    producer.tick(0.2)
    assert producer.results[1] is Outcome.PEER_DEAD
    assert producer.details[1] == "connection lost"
    assert server.n_pins == 0 and server.n_rounds == 0 and not server.busy
    assert server.drop_pins(Outcome.SHUTDOWN, "late") == 0


def test_drop_pins_ends_the_wait_for_the_lease_at_once(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.session.close(Outcome.SHUTDOWN, "shutdown")
    producer.take()
    assert producer.results == {}
    assert producer.session.producer.drop_pins(Outcome.SHUTDOWN, "tier shut down") == 1
    producer.take()
    assert producer.results == {1: Outcome.SHUTDOWN}
    assert producer.session.producer.n_pins == 0 and producer.session.producer.n_rounds == 0
    assert len(producer.deadlines) == 0


def test_producer_wind_down_fails_open_rounds_for_the_consumer(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.store(2, "r", [b"z"], [5])  # offered, not demanded
    producer.feed(Fetch("r", 0, [b"a", b"b"]))  # a pinned, b waiting
    producer.dir.producer_started("q")
    producer.feed(Fetch("q", 0, [b"c"]))  # only waiting
    producer.env.lookup_ends.source_seen = True
    producer.sent()
    producer.session.wind_down()
    producer.take()
    detail = "peer_dead: the producer is shutting down"
    assert sorted(producer.sent(), key=repr) == [round_failed("q", 0, detail),
                                                 round_failed("r", 0, detail)]
    assert producer.results == {2: Outcome.SHUTDOWN}  # the pinned job waits for its release
    assert not producer.session.wound_down
    producer.feed(Fetch("r", 1, [b"z"]))  # later fetches fail at once
    assert producer.sent() == [round_failed("r", 1, detail)]
    producer.feed(Lookup(0, "r", [b"a"]))
    assert producer.sent() == [LookupResp(0, [False])]
    producer.feed(Release("r", 0, False))
    producer.take()
    assert 1 in producer.results and producer.session.wound_down


def test_a_release_read_crossing_the_wind_down_round_failed_is_no_protocol_error(
        producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]))
    assert producer.sent() == [Ready("r", 0, [0], [3])]
    producer.session.wind_down()  # meanwhile the consumer read a and sent release(read=True)
    assert _failed(producer.sent()[0]).reason.startswith("peer_dead:")
    assert producer.results == {} and not producer.session.wound_down
    producer.feed(Release("r", 0, True))
    assert producer.doom() is None and 1 in producer.results
    assert producer.session.wound_down


def test_a_pinned_job_read_before_the_wind_down_reached_the_consumer_is_done(
        producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.session.wind_down()
    producer.feed(Release("r", 0, True))
    assert producer.results == {1: Outcome.DONE}


def test_the_release_for_a_fetch_refused_during_wind_down_is_not_a_protocol_error(
        producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.store(1, "r", [b"a"], [3])  # pinned for round 0: the request state stays
    producer.session.wind_down()
    producer.feed(Fetch("r", 1, [b"b"]))
    assert _failed(producer.sent()[-1]).round == 1
    producer.feed(Release("r", 1, False))
    assert producer.doom() is None


# -- producer: lookups -------------------------------------------------------------------------


def test_lookup_without_a_source_answers_all_miss_at_once(producer: Rig) -> None:
    producer.feed(Lookup(0, "r", [b"a", b"b"]))
    assert producer.sent() == [LookupResp(0, [False, False])]
    producer.feed(Lookup(0, "r", [b"a"]))
    assert "lookup.seq: 0 is not above the previous lookup 0" in producer.doom().reason


class Source:
    def __init__(self, have: dict[bytes, int], retry: frozenset[bytes] = frozenset(),
                 fail: str = "") -> None:
        self.have, self.retry, self.fail = have, set(retry), fail
        self.calls: list[str] = []

    def begin(self, kv: str) -> object:
        self.calls.append("begin")
        if self.fail == "begin":
            raise RuntimeError("begin failed")
        return kv

    def lookup(self, handle: object, key: bytes) -> LookupResult:
        if key in self.retry:
            return LookupResult.RETRY
        return LookupResult.HIT if key in self.have else LookupResult.MISS

    def pin(self, handle: object, keys: Sequence[bytes]) -> Job:
        self.calls.append("pin")
        if self.fail == "pin":
            raise RuntimeError("pin failed")
        return Job(500, keys, [self.have[k] for k in keys], False, RequestContext("pin"))

    def end(self, handle: object) -> None:
        self.calls.append("end")


def test_lookup_served_from_the_source_pins_hits_as_supply(consumer: Rig) -> None:
    rig = consumer
    rig.env.lookup_ends.source_seen = True
    rig.feed(Lookup(0, "r", [b"a", b"b", b"c"]))
    src = Source({b"a": 1, b"c": 3}, retry=frozenset({b"b"}))
    rig.session.producer.serve(src)
    assert rig.sent() == []  # b is still RETRY
    src.retry.clear()
    rig.session.producer.serve(src)
    assert rig.sent() == [LookupResp(0, [True, False, True])]
    assert src.calls == ["begin", "pin", "end"]
    rig.feed(Fetch("r", 0, [b"c", b"a"]))
    assert rig.sent() == [Ready("r", 0, [0, 1], [3, 1])]
    rig.feed(Fetch("r", 1, [b"zz"]))  # lookup-served: nothing more will come
    assert _failed(rig.sent()[-1]).reason.startswith("demand_unmet")
    rig.feed(Release("r", 0, True))
    rig.take()
    assert rig.results == {500: Outcome.DONE}


@pytest.mark.parametrize("fail", ["begin", "pin"])
def test_hit_source_failures_answer_miss(consumer: Rig, fail: str) -> None:
    consumer.env.lookup_ends.source_seen = True
    consumer.feed(Lookup(0, "r", [b"a"]))
    src = Source({b"a": 1}, fail=fail)
    consumer.session.producer.serve(src)
    assert consumer.sent() == [LookupResp(0, [False])]
    assert src.calls[-1] == ("end" if fail == "pin" else "begin")


def test_lookup_deadline_without_serving_answers_miss_and_defers_end(consumer: Rig) -> None:
    consumer.env.lookup_ends.source_seen = True
    consumer.feed(Lookup(0, "r", [b"a"]))
    src = Source({}, retry=frozenset({b"a"}))
    consumer.session.producer.serve(src)
    consumer.tick(5.1)
    assert consumer.sent() == [LookupResp(0, [False])]
    assert consumer.env.lookup_ends.take() == ["r"]


# -- both ends over the wire ---------------------------------------------------------------------


def _pair() -> tuple[Rig, Rig]:
    """A consumer and a producer session talking to each other (both see the other as PEER)."""
    c = Rig(address=PEER, peer_blocks=OUR_BLOCKS)
    p = Rig(address=PEER, peer_blocks=OUR_BLOCKS)
    _shuttle(c, p)
    assert c.session.ready and p.session.ready
    return c, p


def _shuttle(a: Rig, b: Rig) -> None:
    while a.conn.sent or b.conn.sent:
        for src, dst in ((a, b), (b, a)):
            frames, src.conn.sent = src.conn.sent, []
            dst.conn.inbox.extend(frames)
            dst.session.receive()
            dst.take()


@pytest.mark.parametrize("ok", [True, False])
def test_a_load_end_to_end(ok: bool) -> None:
    c, p = _pair()
    p.dir.producer_started("r")
    p.store(1, "r", [b"a", b"b"], [10, 11])
    c.load(1, "r", [b"b", b"a"], [3, 4])
    _shuttle(c, p)
    assert c.data.posted == [(PEER, [3, 4], [11, 10])]
    (rid,) = c.data.reads
    c.finish_read(rid, ok)
    _shuttle(c, p)
    if ok:
        assert c.results == {1: Outcome.DONE} and p.results == {1: Outcome.DONE}
    else:
        assert c.results == {1: Outcome.TRANSFER_FAILED} and p.results == {1: Outcome.ABORTED}
    c.session.consumer.finish("r")
    p.dir.producer_finished("r")
    p.session.producer.producer_finished("r")
    _shuttle(c, p)
    assert p.session.producer.reqs == {} and p.dir.bound("r") is None
    assert c.session.consumer.reqs == {} and p.session.wound_down and c.session.wound_down
    assert c.doom() is None and p.doom() is None


# -- our own frames over the size cap -------------------------------------------------------


@pytest.mark.parametrize("error", [FrameTooLarge, ProtocolError])  # ProtocolError: older
def test_an_oversize_fetch_fails_its_load_not_the_session(consumer: Rig,
                                                          error: type[Exception]) -> None:
    consumer.conn.max_frame, consumer.conn.too_large = 64, error
    consumer.load(1, "r", [b"k" * 40, b"j" * 40], [0, 1])
    assert consumer.results == {1: Outcome.SUBMIT_FAILED}
    assert "larger than a frame" in consumer.details[1]
    assert consumer.sent() == [] and consumer.doom() is None and "r" in consumer.env.failed_loads
    consumer.load(2, "q", [b"a"], [2])
    assert consumer.sent() == [Fetch("q", 0, [b"a"])]


def test_an_oversize_lookup_answers_its_keys_miss(consumer: Rig) -> None:
    consumer.conn.max_frame = 64
    client = consumer.session.consumer
    for i in range(4):
        assert client.probe("r", bytes([i]) * 20) is LookupResult.RETRY
    client.flush_lookups()
    assert consumer.sent() == [] and consumer.doom() is None and client.state_sizes()["lookups"] == 0
    assert client.probe("r", b"\x00" * 20) is LookupResult.MISS


def test_an_oversize_ready_fails_the_round_and_keeps_the_pins_until_release(
        producer: Rig) -> None:
    keys = [b"%02d" % i for i in range(60)]
    producer.store(1, "r", keys, list(range(60)))
    producer.conn.max_frame = 150  # a round_failed fits, a ready for 60 blocks does not
    assert len(encode(Ready("r", 0, list(range(60)), list(range(60))))) > 150
    producer.feed(Fetch("r", 0, keys))
    (msg,) = producer.sent()
    assert _failed(msg).outcome == "submit_failed" and producer.doom() is None
    assert producer.session.producer.n_pins == 60 and producer.results == {}
    producer.feed(Release("r", 0, False))
    assert producer.session.producer.n_pins == 0 and producer.results == {1: Outcome.ABORTED}
