"""Session tests: the handshake, dispatch, and what dooms a session.

Hellos are compared (wire version, block length, fingerprint, hash seed, address) and a
mismatch is rejected with a bye that says why. A message before the handshake, a malformed
frame or a failed send dooms only this session. Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

from typing import Any

import pytest
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
    decode,
    message_type,
)
from p2pkv.session.consumer_role import LEASE_DRIFT
from p2pkv.session.producer_role import ProducerRole
from p2pkv.session.session import State
from p2pkv.types import Outcome
from session_rig import LIMITS, OUR_BLOCKS, PEER, Rig, round_failed


def test_start_sends_our_hello(rig: Rig) -> None:
    (hello,) = rig.sent()
    assert hello == Hello(
        (WIRE_MAJOR, WIRE_MINOR),
        7,
        "me:1",
        b"ours",
        OUR_BLOCKS,
        16,
        "",
        "",
        lease_ms=int(rig.timeouts.lease * 1000),
    )
    assert (WIRE_MAJOR, WIRE_MINOR) == (2, 1)


@pytest.mark.parametrize("after, outcome", [(4.9, Outcome.DONE), (5.0, Outcome.TRANSFER_FAILED)])
def test_a_shorter_lease_announced_by_the_producer_bounds_our_reads(
    rig: Rig, after: float, outcome: Outcome
) -> None:
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


@pytest.mark.parametrize(
    "over, fragment",
    [
        ({"wire": (1, 0)}, f"wire version 1.0 is incompatible with ours {WIRE_MAJOR}.{WIRE_MINOR}"),
        ({"wire": (1, 7)}, "wire version 1.7 is incompatible"),
        ({"wire": (WIRE_MAJOR + 1, 0)}, "major versions differ"),
        ({"block_len": 32}, "block_len 32"),
        ({"hash_seed": "42"}, "seed"),
        ({"address": "other:2"}, "not the connection's peer address"),
    ],
)
def test_incompatible_hello_is_rejected_with_a_bye_that_says_why(
    rig: Rig, over: dict[str, Any], fragment: str
) -> None:
    rig.sent()
    rig.feed(rig.hello(**over))
    doom = rig.doomed()
    assert doom.outcome is Outcome.PEER_REJECTED and fragment in doom.reason
    assert doom.bye is not None
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
    assert b.doomed().outcome is Outcome.PEER_REJECTED and "fingerprint" in b.doomed().reason


def test_data_transport_refusing_the_descriptor_rejects_the_peer(rig: Rig) -> None:
    rig.data.reject_peer = "descriptor is garbage"
    rig.feed(rig.hello())
    assert rig.doomed().outcome is Outcome.PEER_REJECTED
    assert "descriptor is garbage" in rig.doomed().reason
    assert len(rig.env.data_peers) == 0


@pytest.mark.parametrize(
    "msg",
    [
        Fetch("r", 0, [b"a"]),
        Lookup(0, "r", [b"a"]),
        Ready("r", 0, [0], [1]),
        Release("r", 0, True),
        round_failed("r", 0, "demand_unmet: x"),
        LookupResp(0, [True]),
    ],
    ids=lambda m: message_type(m),
)
def test_messages_before_the_handshake_are_protocol_errors(rig: Rig, msg: Message) -> None:
    rig.feed(rig.hello(), msg)  # peer hello seen, but our hello not acked yet
    doom = rig.doomed()
    assert doom.outcome is Outcome.PROTOCOL_ERROR
    assert f"{message_type(msg)}: received before the handshake completed" in doom.reason
    assert doom.bye is not None and doom.bye.startswith("protocol error")


def test_hello_ack_must_echo_our_epoch(rig: Rig) -> None:
    rig.feed(rig.hello(), HelloAck(8))
    assert "hello_ack.epoch: 8 does not echo our epoch 7" in rig.doomed().reason


def test_duplicate_hello_of_the_same_incarnation_is_a_protocol_error(rig: Rig) -> None:
    rig.handshake()
    rig.feed(rig.hello())
    assert "hello: duplicate hello" in rig.doomed().reason


def test_hello_with_a_new_epoch_hands_the_frames_back_for_a_fresh_session(rig: Rig) -> None:
    rig.handshake()
    rest = rig.feed(rig.hello(epoch=100), Fetch("r", 0, [b"a"]))
    assert rest is not None and len(rest) == 2
    assert decode(rest[0], LIMITS) == rig.hello(epoch=100)
    assert rig.doom() is None


@pytest.mark.parametrize(
    "reason, outcome",
    [
        ("rejected: block_len", Outcome.PEER_REJECTED),
        ("protocol error: x", Outcome.PROTOCOL_ERROR),
        ("shutdown", Outcome.PEER_DEAD),
    ],
)
def test_bye_from_a_wire_2_0_peer_names_its_outcome_in_the_reason(
    rig: Rig, reason: str, outcome: Outcome
) -> None:
    rig.feed_raw(type="bye", reason=reason)
    assert rig.doomed().outcome is outcome and rig.doomed().bye is None


@pytest.mark.parametrize(
    "bye, outcome, fragment",
    [
        (
            Bye("block_len 32 differs", "peer_rejected"),
            Outcome.PEER_REJECTED,
            "rejected us: block_len 32 differs",
        ),
        (Bye("rejected: seed", "peer_rejected"), Outcome.PEER_REJECTED, "rejected us: seed"),
        (Bye("bad frame", "protocol_error"), Outcome.PROTOCOL_ERROR, "peer said bye: bad frame"),
        (Bye("rejected: but the field says otherwise", "peer_dead"), Outcome.PEER_DEAD, "bye"),
        (Bye("x", "done"), Outcome.PEER_DEAD, "peer said bye: x"),
        (Bye("x", "from_the_future"), Outcome.PEER_DEAD, "peer said bye: x"),
    ],
)
def test_bye_outcome_field_decides(rig: Rig, bye: Bye, outcome: Outcome, fragment: str) -> None:
    rig.feed(bye)
    assert rig.doomed().outcome is outcome and fragment in rig.doomed().reason


def test_our_byes_tell_the_peer_its_outcome(rig: Rig) -> None:
    rig.handshake()
    rig.session.close(Outcome.SHUTDOWN, "shutdown", bye="shutdown")
    assert rig.sent() == [Bye("shutdown", "peer_dead")]


def test_unknown_types_are_errors_unless_the_peer_is_newer() -> None:
    older = Rig()
    older.handshake()
    older.feed_raw(type="gossip")
    assert "frame.type: unknown message type 'gossip'" in older.doomed().reason
    newer = Rig()
    newer.feed(newer.hello(wire=(WIRE_MAJOR, WIRE_MINOR + 1)), HelloAck(7))
    newer.feed_raw(type="gossip")
    assert newer.doom() is None and newer.session.ready


@pytest.mark.parametrize("old", ["abort", "abort_ack", "quiesced", "transfer_done"])
def test_push_era_messages_are_unknown_types_now(rig: Rig, old: str) -> None:
    rig.handshake()
    rig.feed_raw(type=old, kv_request_id="r", round=0)
    assert f"unknown message type {old!r}" in rig.doomed().reason


def test_handshake_deadline(rig: Rig) -> None:
    rig.tick(9.9)
    assert rig.doom() is None
    rig.tick(0.2)
    assert rig.doomed().outcome is Outcome.PEER_DEAD and "handshake" in rig.doomed().reason
    assert rig.doomed().bye == "handshake timeout"


def test_malformed_frames_doom_only_this_session(rig: Rig) -> None:
    rig.handshake()
    rig.conn.inbox.append(b"\xc1")
    rig.session.receive()
    assert rig.doomed().outcome is Outcome.PROTOCOL_ERROR
    assert "not a valid msgpack" in rig.doomed().reason
    assert rig.env.counters["protocol_errors"] == 1


@pytest.mark.parametrize(
    "body, fragment",
    [
        (
            {"type": "ready", "kv_request_id": "r", "round": 0, "pos": [0], "slots": [1, 2]},
            "ready.slots: 2 slots for 1 positions",
        ),
        (
            {"type": "ready", "kv_request_id": "r", "round": 0, "pos": [], "slots": []},
            "ready.pos: must not be empty",
        ),
        (
            {"type": "release", "kv_request_id": "r", "round": 0, "read": 1},
            "release.read: expected a boolean, got int",
        ),
        (
            {"type": "round_failed", "kv_request_id": "r", "round": 0, "reason": ""},
            "round_failed.reason: must not be empty",
        ),
        (
            {"type": "fetch", "kv_request_id": "r", "round": 0, "keys": ["a"]},
            "fetch.keys[0]: expected bytes, got str",
        ),
    ],
)
def test_malformed_messages_are_protocol_errors_naming_the_field(
    rig: Rig, body: dict[str, Any], fragment: str
) -> None:
    rig.handshake()
    rig.feed_raw(**body)
    doom = rig.doomed()
    assert doom.outcome is Outcome.PROTOCOL_ERROR and fragment in doom.reason
    assert doom.reason.startswith("protocol error: ") and doom.bye == doom.reason


def test_consecutive_internal_errors_reach_the_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(self: ProducerRole, msg: Release) -> None:
        raise RuntimeError("bug")

    monkeypatch.setattr(ProducerRole, "on_release", boom)
    rig = Rig()
    rig.handshake()
    for _ in range(LIMITS.max_consecutive_internal_errors - 1):
        rig.feed(Release("r", 0, False))
        rig.feed(round_failed("nobody", 0, "x"))  # a successful dispatch resets the counter
    assert rig.doom() is None and rig.session.internal_errors == 0
    rig.feed(*[Release("r", i, False) for i in range(LIMITS.max_consecutive_internal_errors)])
    assert rig.doomed().outcome is Outcome.PROTOCOL_ERROR
    assert "consecutive internal errors, last: RuntimeError: bug" in rig.doomed().reason


def test_a_failed_send_dooms_the_session(rig: Rig) -> None:
    rig.handshake()
    rig.conn.fail_send = True
    rig.load(1, "r", [b"a"], [0])
    assert rig.doomed().outcome is Outcome.PEER_DEAD and "send failed" in rig.doomed().reason
