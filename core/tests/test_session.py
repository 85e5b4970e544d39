"""Session unit tests: handshake, dispatch, client and server roles, one message at a time.

The test plays the peer: it feeds encoded frames into a fake connection and decodes what the
session sent. The data transport is a scripted fake; the host is the real ``Directory``.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any, ClassVar

import pytest
from p2pkv.config import Limits, Timeouts
from p2pkv.contracts import (
    EMPTY_POLL,
    CancelMode,
    Capabilities,
    ControlConnection,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import ConnectionClosed, PeerRejected, TransferSubmitError
from p2pkv.protocol import (
    WIRE_MAJOR,
    WIRE_MINOR,
    Abort,
    AbortAck,
    Bye,
    Fetch,
    Hello,
    HelloAck,
    Lookup,
    LookupResp,
    Message,
    Quiesced,
    TransferDone,
    decode,
    encode,
)
from p2pkv.registry import Observers
from p2pkv.session import Deadlines, JobLedger, LocalIdentity, Session, SessionEnv, State
from p2pkv.session.client import outcome_from_reason
from p2pkv.session.directory import Directory
from p2pkv.session.retiring import RetiringWrites
from p2pkv.types import Job, LookupResult, Outcome, RequestContext

PEER = "peer:1"
LIMITS = Limits()


class FakeConn(ControlConnection):
    def __init__(self) -> None:
        self.inbox: list[bytes] = []
        self.sent: list[bytes] = []
        self.is_alive = True
        self.fail_send = False

    @property
    def peer_address(self) -> str:
        return PEER

    @property
    def alive(self) -> bool:
        return self.is_alive

    def send(self, frame: bytes) -> None:
        if not self.is_alive or self.fail_send:
            raise ConnectionClosed("closed")
        self.sent.append(frame)

    def recv(self) -> Sequence[bytes]:
        out, self.inbox = self.inbox, []
        return out

    def close(self) -> None:
        self.is_alive = False


class FakeData(DataTransport):
    """Scripted data plane: transfers stay in flight until the test finishes them."""

    name: ClassVar[str] = "fake"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)

    def __init__(self, *, two_sided: bool = False) -> None:
        self.ids = itertools.count(1)
        self.peers: dict[str, bytes] = {}
        self.writes: dict[int, tuple[list[int], list[int]]] = {}
        self.expects: dict[int, list[int]] = {}
        self.finished: list[tuple[int, bool]] = []
        self.cancels: list[tuple[list[int], CancelMode]] = []
        self.refuse_wait = False
        self.fail_submit = False
        self.reject_peer = ""
        self.two_sided = two_sided

    @classmethod
    def create(cls, settings: DataSettings) -> FakeData:
        raise NotImplementedError

    @property
    def num_blocks(self) -> int:
        return 64

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

    def write_blocks(self, peer_id: str, local_idxs: Sequence[int],
                     remote_idxs: Sequence[int]) -> int:
        if self.fail_submit:
            raise TransferSubmitError("refused")
        tid = next(self.ids)
        self.writes[tid] = (list(local_idxs), list(remote_idxs))
        return tid

    def expect_blocks(self, peer_id: str, local_idxs: Sequence[int]) -> int | None:
        if not self.two_sided:
            return None
        xid = next(self.ids)
        self.expects[xid] = list(local_idxs)
        return xid

    def finish(self, tid: int, ok: bool = True) -> None:
        self.finished.append((tid, ok))

    def poll(self, peer_id: str | None = None) -> PollResult:
        if not self.finished:
            return EMPTY_POLL
        done = [t for t, ok in self.finished if ok]
        failed = [t for t, ok in self.finished if not ok]
        self.finished = []
        for t in done + failed:
            self.writes.pop(t, None)
            self.expects.pop(t, None)
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode) -> list[int]:
        self.cancels.append((list(transfer_ids), mode))
        if mode is CancelMode.WAIT and self.refuse_wait:
            return [t for t in transfer_ids if t in self.writes or t in self.expects]
        for t in transfer_ids:
            self.writes.pop(t, None)
            self.expects.pop(t, None)
        return []

    def close(self) -> list[int]:
        return []


class Rig:
    """One session under test plus everything around it."""

    def __init__(self, *, two_sided: bool = False, **local: Any) -> None:
        self.now = 100.0
        self.conn = FakeConn()
        self.data = FakeData(two_sided=two_sided)
        self.deadlines = Deadlines()
        self.ledger = JobLedger(self.clock, Observers())
        self.timeouts = Timeouts()
        self.quiet: list[tuple[str, bool]] = []
        self.retiring = RetiringWrites(self.deadlines, self.clock, self.timeouts,
                                       lambda peer, drained: self.quiet.append((peer, drained)))
        self.dir = Directory(self.ledger, self.deadlines, self.clock, self.timeouts, Observers(),
                             self.retiring)
        ident = {"address": "me:1", "epoch": 7, "descriptor": b"ours", "num_blocks": 64,
                 "block_len": 16, "fingerprint": "", "hash_seed": ""}
        ident.update(local)
        self.env = SessionEnv(
            data=self.data, ledger=self.ledger, deadlines=self.deadlines, clock=self.clock,
            observers=Observers(), timeouts=self.timeouts, limits=LIMITS,
            local=LocalIdentity(**ident), host=self.dir,
        )
        self.session = Session(self.env, PEER, self.conn)
        self.session.start()
        self.results: dict[int, Outcome] = {}
        self.details: dict[int, str] = {}

    def clock(self) -> float:
        return self.now

    def feed(self, *msgs: Message) -> list[bytes] | None:
        self.conn.inbox.extend(encode(m) for m in msgs)
        return self.session.receive()

    def sent(self) -> list[Message]:
        out = [decode(f, LIMITS) for f in self.conn.sent]
        self.conn.sent.clear()
        return out  # type: ignore[return-value]

    def hello(self, **over: Any) -> Hello:
        fields: dict[str, Any] = {"wire": (WIRE_MAJOR, WIRE_MINOR), "epoch": 99, "address": PEER,
                                      "descriptor": b"theirs", "num_blocks": 32, "block_len": 16,
                                      "fingerprint": "", "hash_seed": ""}
        fields.update(over)
        return Hello(**fields)

    def ready(self) -> None:
        self.feed(self.hello(), HelloAck(7))
        assert self.session.state is State.READY
        self.sent()

    def tick(self, advance: float = 0.0) -> None:
        self.now += advance
        done, failed = self.data.poll(PEER)
        for ok, ids in ((True, done), (False, failed)):
            for tid in ids:
                owner = self.env.owners.pop(tid, None)
                if owner is not None:
                    owner.on_data(tid, ok)
        self.deadlines.fire_due(self.now)
        self.take()

    def take(self) -> None:
        for r in self.ledger.take():
            assert r.job_id not in self.results, f"duplicate result {r}"
            self.results[r.job_id] = r.outcome
            self.details[r.job_id] = r.detail

    def load(self, job_id: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        self.ledger.open(job_id, True, kv, PEER)
        self.session.client.submit(Job(job_id, keys, slots, True, RequestContext("c")), kv)

    def store(self, job_id: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        """As the tier does it: to the bound session, else parked."""
        self.ledger.open(job_id, False, kv)
        job = Job(job_id, keys, slots, False, RequestContext("p"))
        if self.dir.bindings.get(kv) is self.session:
            self.session.server.add_store(kv, job)
        else:
            self.dir.park(kv, job)

    def doom(self) -> Any:
        return self.session.doomed


@pytest.fixture
def rig() -> Rig:
    return Rig()


# -- handshake ---------------------------------------------------------------------------------


def test_start_sends_our_hello(rig: Rig) -> None:
    (hello,) = rig.sent()
    assert hello == Hello((WIRE_MAJOR, WIRE_MINOR), 7, "me:1", b"ours", 64, 16, "", "")


def test_peer_hello_registers_and_acks_ready_only_after_our_ack(rig: Rig) -> None:
    rig.sent()
    rig.feed(rig.hello())
    assert rig.data.peers == {PEER: b"theirs"}
    assert rig.sent() == [HelloAck(99)]
    assert rig.session.state is State.HANDSHAKE
    rig.feed(HelloAck(7))
    assert rig.session.ready


def test_rounds_submitted_before_the_handshake_are_sent_once_ready(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [3])
    assert rig.sent() == []
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99), Quiesced(), Fetch("r", 0, [b"a"], [3])]


@pytest.mark.parametrize("over, fragment", [
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


@pytest.mark.parametrize("msg", [
    Fetch("r", 0, [b"a"], [0]), Lookup(0, "r", [b"a"]), Abort("r", 0), AbortAck("r", 0),
    TransferDone("r", 0, True), LookupResp(0, [True]), Quiesced(),
])
def test_messages_before_the_handshake_are_protocol_errors(rig: Rig, msg: Message) -> None:
    rig.feed(rig.hello(), msg)  # peer hello seen, but our hello not acked yet
    doom = rig.doom()
    assert doom.outcome is Outcome.PROTOCOL_ERROR
    assert "before the handshake completed" in doom.reason
    assert doom.bye.startswith("protocol error")


def test_hello_ack_must_echo_our_epoch(rig: Rig) -> None:
    rig.feed(rig.hello(), HelloAck(8))
    assert "does not echo our epoch" in rig.doom().reason


def test_duplicate_hello_of_the_same_incarnation_is_a_protocol_error(rig: Rig) -> None:
    rig.ready()
    rig.feed(rig.hello())
    assert "duplicate hello" in rig.doom().reason


def test_hello_with_a_new_epoch_hands_the_frames_back_for_a_fresh_session(rig: Rig) -> None:
    rig.ready()
    rest = rig.feed(rig.hello(epoch=100), Fetch("r", 0, [b"a"], [0]))
    assert rest is not None and len(rest) == 2
    assert decode(rest[0], LIMITS) == rig.hello(epoch=100)
    assert rig.doom() is None


@pytest.mark.parametrize("reason, outcome", [
    ("rejected: block_len", Outcome.PEER_REJECTED),
    ("protocol error: x", Outcome.PROTOCOL_ERROR),
    ("shutdown", Outcome.PEER_DEAD),
])
def test_bye_from_the_peer(rig: Rig, reason: str, outcome: Outcome) -> None:
    rig.feed(Bye(reason))
    assert rig.doom().outcome is outcome and rig.doom().bye is None


def test_unknown_types_are_errors_unless_the_peer_is_newer() -> None:
    import msgpack

    older = Rig()
    older.ready()
    older.conn.inbox.append(msgpack.packb({"type": "gossip"}))
    older.session.receive()
    assert "unknown message type 'gossip'" in older.doom().reason
    newer = Rig()
    newer.feed(newer.hello(wire=(WIRE_MAJOR, WIRE_MINOR + 1)), HelloAck(7))
    newer.conn.inbox.append(msgpack.packb({"type": "gossip"}))
    newer.session.receive()
    assert newer.doom() is None and newer.session.ready


def test_handshake_deadline(rig: Rig) -> None:
    rig.tick(9.9)
    assert rig.doom() is None
    rig.tick(0.2)
    assert rig.doom().outcome is Outcome.PEER_DEAD and "handshake" in rig.doom().reason


def test_malformed_frames_doom_only_this_session(rig: Rig) -> None:
    rig.ready()
    rig.conn.inbox.append(b"\xc1")
    rig.session.receive()
    assert rig.doom().outcome is Outcome.PROTOCOL_ERROR
    assert "not a valid msgpack" in rig.doom().reason


def test_consecutive_internal_errors_reach_the_threshold(rig: Rig, monkeypatch: Any) -> None:
    rig.ready()
    calls = {"n": 0}

    def boom(*a: Any) -> None:
        calls["n"] += 1
        raise RuntimeError("bug")

    monkeypatch.setitem(rig.session._handlers, Abort, boom)
    for _ in range(LIMITS.max_consecutive_internal_errors - 1):
        rig.feed(Abort("r", 0))
        rig.feed(AbortAck("r", 0))  # a successful dispatch resets the counter
    assert rig.doom() is None and rig.session.internal_errors == 0
    rig.feed(*[Abort("r", i) for i in range(LIMITS.max_consecutive_internal_errors)])
    assert rig.doom().outcome is Outcome.PROTOCOL_ERROR
    assert "consecutive internal errors" in rig.doom().reason


def test_a_failed_send_dooms_the_session(rig: Rig) -> None:
    rig.ready()
    rig.conn.fail_send = True
    rig.load(1, "r", [b"a"], [0])
    assert rig.doom().outcome is Outcome.PEER_DEAD and "send failed" in rig.doom().reason


# -- client role -------------------------------------------------------------------------------


def test_load_done_and_failure_reasons(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a", b"b"], [4, 5])
    rig.load(2, "r", [b"c"], [6])
    assert rig.sent() == [Fetch("r", 0, [b"a", b"b"], [4, 5]), Fetch("r", 1, [b"c"], [6])]
    rig.feed(TransferDone("r", 1, False, "demand_unmet: 1 block missing"))
    rig.feed(TransferDone("r", 0, True))
    rig.take()
    assert rig.results == {1: Outcome.DONE, 2: Outcome.DEMAND_UNMET}
    assert "r" in rig.dir.failed
    rig.feed(TransferDone("r", 0, True))  # late duplicate: ignored
    rig.take()
    assert len(rig.results) == 2 and rig.doom() is None


@pytest.mark.parametrize("reason, outcome", [
    ("demand_unmet: x", Outcome.DEMAND_UNMET), ("submit_failed", Outcome.SUBMIT_FAILED),
    ("done", Outcome.TRANSFER_FAILED), ("gibberish", Outcome.TRANSFER_FAILED),
    ("", Outcome.TRANSFER_FAILED),
])
def test_outcome_from_reason(reason: str, outcome: Outcome) -> None:
    assert outcome_from_reason(reason) is outcome


def test_transfer_done_for_a_round_never_sent_is_a_protocol_error(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.feed(TransferDone("r", 5, True))
    assert "round 5 of 'r' was never sent" in rig.doom().reason


def test_load_timeout_aborts_then_reports_on_ack(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.sent()
    rig.tick(30.1)
    assert rig.sent() == [Abort("r", 0)] and 1 not in rig.results
    rig.feed(AbortAck("r", 0))
    rig.take()
    assert rig.results == {1: Outcome.LOAD_TIMEOUT}


def test_abort_ack_timeout(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.tick(30.1)
    rig.tick(9.8)
    assert 1 not in rig.results
    rig.tick(0.3)
    assert rig.results == {1: Outcome.ABORT_ACK_TIMEOUT}


def test_transfer_done_racing_a_timeout_abort_keeps_its_success(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.tick(30.1)
    rig.feed(TransferDone("r", 0, True), AbortAck("r", 0))
    rig.take()
    assert rig.results == {1: Outcome.DONE}


# -- fences (docs/protocol.md §5.1) ------------------------------------------------------------


def _fenced(rig: Rig) -> list[tuple[str, str, list[int]]]:
    return [(f.peer, f.kv, f.slots.tolist()) for f in rig.env.fences.live.values()]


@pytest.mark.parametrize("end", ["peer_dead", "protocol_error", "abort_ack_timeout",
                                 "aborting_then_dead"])
def test_rounds_released_without_the_producers_word_fence_their_slots(rig: Rig,
                                                                     end: str) -> None:
    rig.ready()
    rig.load(1, "r", [b"a", b"b"], [3, 4])
    rig.load(2, "r", [b"c"], [5])
    rig.feed(TransferDone("r", 1, True))
    if end == "peer_dead":
        rig.session.close(Outcome.PEER_DEAD, "connection lost")
    elif end == "protocol_error":
        rig.feed(TransferDone("r", 9, True))
        rig.session.close(rig.doom().outcome, rig.doom().reason)
    elif end == "abort_ack_timeout":
        rig.tick(30.1)
        rig.tick(10.1)
    else:
        rig.tick(30.1)
        rig.session.close(Outcome.PEER_DEAD, "connection lost")
    rig.take()
    assert rig.results[2] is Outcome.DONE and not rig.results[1].success
    assert _fenced(rig) == [(PEER, "r", [3, 4])]


@pytest.mark.parametrize("end", ["done", "failed", "abort_ack", "unsent", "shutdown"])
def test_rounds_the_producer_confirmed_or_never_saw_fence_nothing(rig: Rig, end: str) -> None:
    if end == "unsent":
        rig.load(1, "r", [b"a"], [3])
        rig.session.close(Outcome.PEER_DEAD, "handshake never completed")
    else:
        rig.ready()
        rig.load(1, "r", [b"a"], [3])
        if end == "done":
            rig.feed(TransferDone("r", 0, True))
        elif end == "failed":
            rig.feed(TransferDone("r", 0, False, "transfer_failed: x"))
        elif end == "abort_ack":
            rig.tick(30.1)
            rig.feed(AbortAck("r", 0))
        else:
            rig.session.close(Outcome.SHUTDOWN, "shutdown")
    rig.take()
    assert 1 in rig.results and _fenced(rig) == []


def test_a_fenced_round_waits_unsent_and_goes_out_once_lifted(rig: Rig) -> None:
    rig.env.fences.fence(PEER, "old", [3])  # by an earlier session with the peer
    rig.env.deadlines.cancel(rig.session.timer)
    rig.session = Session(rig.env, PEER, rig.conn)
    rig.session.start()
    rig.ready()
    rig.load(1, "r", [b"a", b"b"], [2, 3])
    rig.load(2, "r", [b"c"], [4])
    assert rig.sent() == [Fetch("r", 1, [b"c"], [4])]
    assert rig.feed(Quiesced()) is None
    assert rig.sent() == [Fetch("r", 0, [b"a", b"b"], [2, 3])]
    assert rig.env.fences.live == {}


def test_quiesced_lifts_only_fences_older_than_its_session(rig: Rig) -> None:
    rig.ready()
    rig.env.fences.fence(PEER, "young", [3])  # e.g. an abort_ack_timeout on this session
    rig.feed(Quiesced())
    assert _fenced(rig) == [(PEER, "young", [3])]
    rig.feed(Quiesced())
    assert "quiesced: sent twice" in rig.doom().reason


def test_finish_mid_load_reports_request_finished_after_the_ack(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.sent()
    rig.session.client.finish("r")
    assert rig.sent() == [Abort("r", 0)]
    rig.take()
    assert rig.results == {}
    rig.feed(TransferDone("r", 0, True))  # raced the abort: still a finished request
    rig.take()
    assert rig.results == {1: Outcome.REQUEST_FINISHED}
    assert rig.sent() == [Fetch("r", 1, [], [])]  # terminal fetch releases the producer
    assert "r" not in rig.dir.failed and rig.session.client.reqs == {}


def test_finish_before_the_handshake_reports_at_once_and_sends_nothing(rig: Rig) -> None:
    rig.sent()
    rig.load(1, "r", [b"a"], [0])
    rig.session.client.finish("r")
    rig.take()
    assert rig.results == {1: Outcome.REQUEST_FINISHED}
    rig.feed(rig.hello(), HelloAck(7))
    assert rig.sent() == [HelloAck(99), Quiesced()]


def test_a_failed_load_releases_the_producer_and_marks_the_id(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.sent()
    rig.feed(TransferDone("r", 0, False, "transfer_failed: x"))
    assert rig.sent() == [Fetch("r", 1, [], [])]
    assert set(rig.dir.failed) == {"r"}


def test_symmetric_probes_batch_per_request_and_resolve(rig: Rig) -> None:
    rig.ready()
    client = rig.session.client
    assert client.probe("r", b"a") is LookupResult.RETRY
    assert client.probe("r", b"b") is LookupResult.RETRY
    assert client.probe("q", b"c") is LookupResult.RETRY
    client.flush_lookups()
    assert rig.sent() == [Lookup(0, "r", [b"a", b"b"]), Lookup(1, "q", [b"c"])]
    client.flush_lookups()
    assert rig.sent() == []
    assert client.probe("r", b"a") is LookupResult.RETRY
    rig.feed(LookupResp(0, [True, False]))
    assert client.probe("r", b"a") is LookupResult.HIT
    assert client.probe("r", b"b") is LookupResult.MISS
    rig.tick(10.1)  # lookup 1 never answered: MISS
    assert client.probe("q", b"c") is LookupResult.MISS
    rig.feed(LookupResp(1, [True]))  # late: ignored
    assert client.probe("q", b"c") is LookupResult.MISS and rig.doom() is None


@pytest.mark.parametrize("resp, fragment", [
    (LookupResp(5, [True]), "lookup_resp.seq: 5 was never sent"),
    (LookupResp(0, [True, True]), "2 answers for 1 keys"),
])
def test_bad_lookup_responses(rig: Rig, resp: LookupResp, fragment: str) -> None:
    rig.ready()
    rig.session.client.probe("r", b"a")
    rig.session.client.flush_lookups()
    rig.feed(resp)
    assert fragment in rig.doom().reason


def test_finish_after_probes_only_sends_the_terminal_fetch(rig: Rig) -> None:
    rig.ready()
    rig.session.client.probe("r", b"a")
    rig.session.client.flush_lookups()
    rig.sent()
    rig.session.client.finish("r")
    assert rig.sent() == [Fetch("r", 0, [], [])]
    assert rig.session.client.lookups == {} and rig.session.client.reqs == {}


def test_two_sided_load_needs_both_the_done_and_the_receive() -> None:
    rig = Rig(two_sided=True)
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    (xid,) = rig.data.expects
    rig.feed(TransferDone("r", 0, True))
    rig.take()
    assert rig.results == {}
    rig.data.finish(xid)
    rig.tick()
    assert rig.results == {1: Outcome.DONE}


def test_two_sided_receive_failure_fails_the_load() -> None:
    rig = Rig(two_sided=True)
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    (xid,) = rig.data.expects
    rig.data.finish(xid, ok=False)
    rig.tick()
    rig.feed(TransferDone("r", 0, True))
    rig.take()
    assert rig.results == {1: Outcome.TRANSFER_FAILED}


def test_two_sided_failure_waits_for_the_receive_to_be_cancelled() -> None:
    rig = Rig(two_sided=True)
    rig.ready()
    rig.data.refuse_wait = True
    rig.load(1, "r", [b"a"], [0])
    (xid,) = rig.data.expects
    rig.feed(TransferDone("r", 0, False, "transfer_failed"))
    rig.take()
    assert rig.results == {} and rig.data.cancels == [([xid], CancelMode.WAIT)]
    rig.data.finish(xid, ok=False)
    rig.tick()
    assert rig.results == {1: Outcome.TRANSFER_FAILED}


def test_two_sided_receive_that_never_settles_is_given_up_after_a_deadline() -> None:
    rig = Rig(two_sided=True)
    rig.ready()
    rig.data.refuse_wait = True
    rig.load(1, "r", [b"a"], [0])
    rig.feed(TransferDone("r", 0, False, "x"))
    rig.tick(10.1)
    assert rig.results == {1: Outcome.TRANSFER_FAILED}
    assert rig.data.cancels[-1][1] is CancelMode.IMMEDIATE and rig.env.owners == {}


def test_closing_fails_loads_and_marks_ids(rig: Rig) -> None:
    rig.ready()
    rig.load(1, "r", [b"a"], [0])
    rig.session.client.open_request("idle")
    rig.session.close(Outcome.PEER_DEAD, "gone")
    rig.take()
    assert rig.results == {1: Outcome.PEER_DEAD} and set(rig.dir.failed) == {"r", "idle"}
    assert rig.session.state is State.CLOSED


# -- server role -------------------------------------------------------------------------------


def test_fetch_first_then_stores_match_as_they_arrive(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a", b"b", b"c"], [10, 11, 12]))
    assert rig.data.writes == {}
    rig.store(1, "r", [b"b", b"x"], [2, 3])
    assert list(rig.data.writes.values()) == [([2], [11])]
    rig.store(2, "r", [b"a", b"c"], [4, 5])
    assert list(rig.data.writes.values())[1] == ([4, 5], [10, 12])
    for tid in list(rig.data.writes):
        rig.data.finish(tid)
    rig.tick()
    assert rig.sent() == [TransferDone("r", 0, True)]
    assert rig.results == {2: Outcome.DONE}  # job 1 still holds b"x"
    rig.feed(Fetch("r", 1, [], []))  # terminal fetch
    rig.take()
    assert rig.results[1] is Outcome.DONE  # delivered one, the rest was not needed


def test_stores_first_are_replayed_in_order_when_the_fetch_binds(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [1])
    rig.store(2, "r", [b"a", b"b"], [2, 3])  # b"a" again: the first store keeps it
    rig.feed(Fetch("r", 0, [b"a", b"b"], [20, 21]))
    assert list(rig.data.writes.values()) == [([1, 3], [20, 21])]
    assert rig.dir.bindings == {"r": rig.session}


def test_untouched_parked_stores_released_by_the_terminal_fetch(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [1])
    rig.feed(Fetch("r", 0, [b"z"], [0]))
    rig.dir.producer_finished("r")
    rig.session.server.producer_finished("r")
    rig.feed(Fetch("r", 1, [], []))
    rig.take()
    assert rig.results == {1: Outcome.NOTHING_TO_DO}
    assert rig.sent()[0] == TransferDone(
        "r", 0, False, "demand_unmet: 1 demanded block(s) were never stored by the producer")
    assert rig.session.server.reqs == {} and rig.dir.bindings == {}


@pytest.mark.parametrize("fetch, fragment", [
    (Fetch("r", 0, [b"a", b"a"], [0, 1]), "fetch.keys: duplicate key"),
    (Fetch("r", 0, [b"a", b"b"], [1, 1]), "fetch.slots: duplicate slot"),
    (Fetch("r", 0, [b"a"], [32]), "slot 32 is outside the consumer's region 0..31"),
])
def test_fetch_validation_against_the_peer(rig: Rig, fetch: Fetch, fragment: str) -> None:
    rig.ready()
    rig.feed(fetch)
    assert fragment in rig.doom().reason and rig.doom().outcome is Outcome.PROTOCOL_ERROR


def test_rounds_must_increase(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 1, [b"a"], [0]), Fetch("r", 1, [b"b"], [1]))
    assert "fetch.round: 1 is not above the previous round 1" in rig.doom().reason


def test_a_key_demanded_twice_fails_that_round_and_the_session_goes_on(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a"], [0]), Fetch("r", 1, [b"a"], [1]))
    assert rig.doom() is None
    (done,) = rig.sent()
    assert isinstance(done, TransferDone) and done.round == 1 and not done.success
    assert done.reason.startswith("request_conflict:") and "demanded by round 0" in done.reason
    rig.store(1, "r", [b"a"], [3])  # round 0 still gets its block
    rig.tick()
    assert list(rig.data.writes.values()) == [([3], [0])]


def test_a_fetch_after_the_terminal_fetch_fails_that_round(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a"], [0]), Fetch("r", 1, [], []), Fetch("r", 2, [b"a"], [0]))
    assert rig.doom() is None
    done = rig.sent()[-1]
    assert isinstance(done, TransferDone) and done.round == 2 and not done.success
    assert done.reason == "request_conflict: 'r' was already ended by a terminal fetch"


def test_terminal_fetch_for_an_unknown_request_leaves_no_state(rig: Rig) -> None:
    rig.ready()
    rig.feed(Fetch("nobody", 3, [], []))
    assert rig.session.server.reqs == {} and rig.dir.bindings == {} and rig.doom() is None


def test_fetch_for_a_finished_request_fails_at_once(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.dir.producer_finished("r")
    rig.feed(Fetch("r", 0, [b"a"], [0]))
    (done,) = rig.sent()
    assert isinstance(done, TransferDone) and not done.success
    assert done.reason.startswith("demand_unmet") and "already finished" in done.reason
    assert rig.session.server.reqs == {}


def test_submit_and_transfer_failures_fail_the_round_and_the_jobs(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a", b"b"], [0, 1]))
    rig.store(1, "r", [b"a"], [5])
    rig.data.fail_submit = True
    rig.store(2, "r", [b"b"], [6])
    rig.take()
    assert rig.results == {2: Outcome.SUBMIT_FAILED}
    assert rig.sent() == []  # the first transfer is still in flight
    (tid,) = rig.data.writes
    rig.data.finish(tid, ok=False)
    rig.tick()
    assert rig.results[1] is Outcome.TRANSFER_FAILED
    (done,) = rig.sent()
    assert isinstance(done, TransferDone) and done.reason.startswith("submit_failed")


def test_abort_with_nothing_in_flight_is_acked_at_once(rig: Rig) -> None:
    rig.ready()
    rig.feed(Abort("unknown", 0))
    assert rig.sent() == [AbortAck("unknown", 0)]
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a"], [0]), Abort("r", 0))
    assert rig.sent() == [AbortAck("r", 0)]
    rig.store(1, "r", [b"a"], [3])  # the aborted demand is gone
    assert rig.data.writes == {}


def test_abort_wait_cancels_and_acks_when_drained(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.data.refuse_wait = True
    rig.feed(Fetch("r", 0, [b"a"], [0]), Abort("r", 0), Abort("r", 0))
    (tid,) = rig.data.writes
    assert rig.data.cancels == [([tid], CancelMode.WAIT)]
    assert rig.sent() == []
    rig.data.finish(tid)
    rig.tick()
    assert rig.sent() == [AbortAck("r", 0)]  # exactly one ack for the repeated abort
    assert rig.results == {1: Outcome.DONE}  # its block did land before the stop


def test_abort_cancelled_transfer_fails_its_store_with_aborted(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.feed(Fetch("r", 0, [b"a"], [0]), Abort("r", 0))
    rig.take()
    assert rig.sent() == [AbortAck("r", 0)] and rig.results == {1: Outcome.ABORTED}


def test_abort_drain_deadline_closes_the_session_instead_of_acking(rig: Rig) -> None:
    """An ack would tell the consumer a live write is over: the session is doomed instead."""
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.data.refuse_wait = True
    rig.feed(Fetch("r", 0, [b"a"], [0]), Abort("r", 0))
    rig.tick(10.1)
    assert rig.sent() == []
    assert all(mode is CancelMode.WAIT for _, mode in rig.data.cancels)
    doom = rig.session.doomed
    assert doom is not None and doom.outcome is Outcome.TRANSFER_FAILED
    assert doom.bye is not None and doom.bye.startswith("transfer_failed: 1 write(s)")
    assert rig.results == {}  # its block is still being read


def test_store_timeout_waits_for_its_blocks_in_flight_and_reports_once(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a", b"b"], [3, 4])
    rig.feed(Fetch("r", 0, [b"a"], [0]))
    rig.tick(30.1)
    assert rig.results == {}  # its block a is still being read
    (tid,) = rig.data.writes
    rig.data.finish(tid)
    rig.tick()
    assert rig.results == {1: Outcome.STORE_TIMEOUT}
    assert rig.sent() == [TransferDone("r", 0, True)]


def test_unmet_demand_fails_once_the_producer_finishes(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"a", b"b"], [0, 1]))
    rig.store(1, "r", [b"a"], [3])
    rig.dir.producer_finished("r")
    rig.session.server.producer_finished("r")
    assert rig.sent() == []  # a is in flight: wait for it
    (tid,) = rig.data.writes
    rig.data.finish(tid)
    rig.tick()
    (done,) = rig.sent()
    assert isinstance(done, TransferDone) and done.reason.startswith("demand_unmet")
    assert rig.results == {1: Outcome.DONE}


def test_lookup_without_a_source_answers_all_miss_at_once(rig: Rig) -> None:
    rig.ready()
    rig.feed(Lookup(0, "r", [b"a", b"b"]))
    assert rig.sent() == [LookupResp(0, [False, False])]
    rig.feed(Lookup(0, "r", [b"a"]))
    assert "lookup.seq: 0 is not above" in rig.doom().reason


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

    def pin(self, handle: object, keys: list[bytes]) -> Job:
        self.calls.append("pin")
        if self.fail == "pin":
            raise RuntimeError("pin failed")
        return Job(500, keys, [self.have[k] for k in keys], False, RequestContext("pin"))

    def end(self, handle: object) -> None:
        self.calls.append("end")


def test_lookup_served_from_the_source_pins_hits_as_supply(rig: Rig) -> None:
    rig.ready()
    rig.dir.source_seen = True
    rig.feed(Lookup(0, "r", [b"a", b"b", b"c"]))
    src = Source({b"a": 1, b"c": 3}, retry=frozenset({b"b"}))
    rig.session.server.serve(src)
    assert rig.sent() == []  # b is still RETRY
    src.retry.clear()
    rig.session.server.serve(src)
    assert rig.sent() == [LookupResp(0, [True, False, True])]
    assert src.calls == ["begin", "pin", "end"]
    rig.feed(Fetch("r", 0, [b"a", b"c"], [7, 8]))
    assert list(rig.data.writes.values()) == [([1, 3], [7, 8])]
    rig.feed(Fetch("r", 1, [b"zz"], [9]))  # lookup-served: nothing more will come
    done = rig.sent()[-1]
    assert isinstance(done, TransferDone) and done.reason.startswith("demand_unmet")


@pytest.mark.parametrize("fail", ["begin", "pin"])
def test_hit_source_failures_answer_miss(rig: Rig, fail: str) -> None:
    rig.ready()
    rig.dir.source_seen = True
    rig.feed(Lookup(0, "r", [b"a"]))
    src = Source({b"a": 1}, fail=fail)
    rig.session.server.serve(src)
    assert rig.sent() == [LookupResp(0, [False])]
    assert src.calls[-1] == ("end" if fail == "pin" else "begin")


def test_lookup_deadline_without_serving_answers_miss_and_defers_end(rig: Rig) -> None:
    rig.ready()
    rig.dir.source_seen = True
    rig.feed(Lookup(0, "r", [b"a"]))
    src = Source({}, retry=frozenset({b"a"}))
    rig.session.server.serve(src)
    rig.tick(5.1)
    assert rig.sent() == [LookupResp(0, [False])]
    assert rig.dir.take_ends() == ["r"]


def test_closing_fails_stores_only_after_their_transfers_drain(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.store(2, "r", [b"b"], [4])
    rig.data.refuse_wait = True
    rig.feed(Fetch("r", 0, [b"a"], [0]))
    rig.session.close(Outcome.PEER_DEAD, "connection lost")
    rig.take()
    assert rig.results == {2: Outcome.PEER_DEAD}
    assert rig.session.state is State.CLOSING and not rig.session.quiescent
    (tid,) = rig.data.writes
    rig.data.finish(tid)
    rig.tick()
    assert rig.results[1] is Outcome.PEER_DEAD and rig.session.state is State.CLOSED
    assert rig.dir.bindings == {}


def test_force_quiesce_gives_up_on_transfers_that_never_drain(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.data.refuse_wait = True
    rig.feed(Fetch("r", 0, [b"a"], [0]))
    rig.session.close(Outcome.SHUTDOWN, "shutdown")
    stuck = rig.session.force_quiesce()
    rig.take()
    assert len(stuck) == 1 and rig.results == {1: Outcome.SHUTDOWN}
    assert rig.session.state is State.CLOSED
    assert all(mode is CancelMode.WAIT for _, mode in rig.data.cancels)  # never released
    assert rig.retiring.live(PEER) and len(rig.retiring) == 1 and not rig.env.owners
    rig.retiring.ended(stuck[0])
    assert rig.quiet == [(PEER, True)] and not rig.retiring.live(PEER)
    assert len(rig.deadlines) == 0


def test_a_key_twice_in_one_store_counts_once(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.feed(Fetch("r", 0, [b"zz"], [9]))  # binds the request; demand for another key
    rig.store(1, "r", [b"a", b"a", b"b"], [3, 4, 5])
    rig.feed(Fetch("r", 1, [b"a", b"b"], [0, 1]))
    (tid,) = rig.data.writes
    assert rig.data.writes[tid] == ([3, 5], [0, 1])
    rig.data.finish(tid)
    rig.tick()
    assert rig.results == {1: Outcome.DONE}


def test_a_fetch_partly_held_writes_the_held_part_and_waits_for_the_rest(rig: Rig) -> None:
    rig.ready()
    rig.dir.producer_started("r")
    rig.store(1, "r", [b"a"], [3])
    rig.feed(Fetch("r", 0, [b"a", b"b"], [0, 1]))
    assert list(rig.data.writes.values()) == [([3], [0])]
    rig.store(2, "r", [b"b"], [4])
    assert list(rig.data.writes.values())[1] == ([4], [1])


def test_a_round_its_consumer_gave_up_does_not_hold_demand_forever(rig: Rig) -> None:
    """A fetch whose abort was lost (or arrived first, reordered) for blocks that never come:
    the producer ends the round once the consumer's load and abort deadlines have passed."""
    rig.ready()
    rig.feed(Fetch("r", 0, [b"a", b"b"], [0, 1]))
    t = rig.env.timeouts
    rig.tick(t.load + 2 * t.abort_ack - 0.1)
    assert rig.sent() == [] and rig.session.server.reqs
    rig.tick(0.2)
    (done,) = rig.sent()
    assert isinstance(done, TransferDone) and not done.success
    assert done.reason.startswith("load_timeout:") and "2 block(s) never stored" in done.reason
    assert rig.session.server.state_sizes()["demand"] == 0 and rig.doom() is None
