"""Session tests, consumer side: fetch, ready, the reads into our slots, release.

A round's result comes once: done after its last read within the lease, or a failure after
its reads were cancelled. Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

import pytest
from p2pkv.config import Timeouts
from p2pkv.protocol import Fetch, HelloAck, Message, Ready, Release
from p2pkv.session.consumer_role import LEASE_DRIFT, failure_outcome
from p2pkv.types import Outcome
from session_rig import OUR_BLOCKS, PEER, PEER_BLOCKS, Rig, failed_ids, reads_posted, round_failed


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
    consumer: Rig,
) -> None:
    consumer.load(1, "r", [b"a", b"b", b"c", b"d"], [4, 5, 6, 7])
    consumer.sent()
    consumer.feed(Ready("r", 0, [1], [20]))
    consumer.feed(Ready("r", 0, [3, 0], [21, 22]))
    assert reads_posted(consumer) == [([5], [20]), ([7, 4], [21, 22])]
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


@pytest.mark.parametrize(
    "value, outcome",
    [
        ("demand_unmet", Outcome.DEMAND_UNMET),
        ("submit_failed", Outcome.SUBMIT_FAILED),
        ("request_conflict", Outcome.REQUEST_CONFLICT),
        ("shutdown", Outcome.SHUTDOWN),
        ("peer_dead", Outcome.PEER_DEAD),
        ("load_timeout", Outcome.LOAD_TIMEOUT),
        ("done", Outcome.TRANSFER_FAILED),
        ("nothing_to_do", Outcome.TRANSFER_FAILED),
        ("gibberish", Outcome.TRANSFER_FAILED),
        ("", Outcome.TRANSFER_FAILED),
    ],
)
def test_round_failed_outcomes(value: str, outcome: Outcome) -> None:
    assert failure_outcome(value) is outcome


@pytest.mark.parametrize(
    "reason, outcome",
    [
        ("demand_unmet: 1 demanded block(s) were never stored", Outcome.DEMAND_UNMET),
        ("peer_dead: the producer is shutting down", Outcome.PEER_DEAD),
        ("load_timeout: the consumer did not release it", Outcome.LOAD_TIMEOUT),
        ("something new", Outcome.TRANSFER_FAILED),
    ],
)
def test_round_failed_cancels_the_reads_and_releases(
    consumer: Rig, reason: str, outcome: Outcome
) -> None:
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
    assert events.index(("cancel", [other])) < events.index(("result", 1, Outcome.TRANSFER_FAILED))
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
"""How long after its fetch a read is still accepted (the default lease, less the drift)."""


@pytest.mark.parametrize(
    "after, outcome",
    [
        (LEASE_LIMIT - 0.05, Outcome.DONE),
        (LEASE_LIMIT + 0.05, Outcome.TRANSFER_FAILED),
    ],
)
def test_a_read_is_accepted_only_within_the_lease_of_the_fetch(
    consumer: Rig, after: float, outcome: Outcome
) -> None:
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
    assert events.index(("cancel", [rid])) < events.index(("result", 1, Outcome.REQUEST_FINISHED))
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


def test_a_failed_load_ends_the_request_with_the_producer_and_marks_the_id(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.sent()
    consumer.feed(round_failed("r", 0, "transfer_failed: x"))
    assert consumer.sent() == [Release("r", 0, False), Fetch("r", 1, [])]
    assert failed_ids(consumer) == {"r"}
    consumer.load(2, "r", [b"b"], [1])  # the request was ended with its producer
    assert consumer.results[2] is Outcome.REQUEST_CONFLICT
    assert "already ended with its producer" in consumer.details[2]
    assert consumer.sent() == []


def test_a_load_of_keys_already_being_loaded_is_a_request_conflict(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a", b"b"], [0, 1])
    consumer.load(2, "r", [b"b", b"c"], [2, 3])
    consumer.take()
    assert consumer.results == {2: Outcome.REQUEST_CONFLICT}
    assert (
        "1 of its blocks are already being loaded for request 'r' by job 1" in consumer.details[2]
    )
    assert consumer.sent() == [Fetch("r", 0, [b"a", b"b"])]  # job 1 goes on
    assert "r" not in consumer.env.failed_loads
    consumer.load(3, "r", [b"c"], [3])
    assert consumer.sent() == [Fetch("r", 1, [b"c"])]


@pytest.mark.parametrize(
    "msg, fragment",
    [
        (Ready("r", 5, [0], [1]), "ready.round: round 5 of 'r' was never sent"),
        (Ready("r", 1, [0], [1]), "ready.round: round 1 of 'r' was never sent"),
        (
            round_failed("r", 3, "demand_unmet: x"),
            "round_failed.round: round 3 of 'r' was never sent",
        ),
    ],
)
def test_messages_for_a_round_never_sent_are_protocol_errors(
    consumer: Rig, msg: Message, fragment: str
) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.feed(msg)
    doom = consumer.doomed()
    assert doom.outcome is Outcome.PROTOCOL_ERROR and fragment in doom.reason
    assert consumer.data.posted == []


@pytest.mark.parametrize(
    "readies, fragment",
    [
        (
            [Ready("r", 0, [0, 0], [1, 2])],
            "ready.pos: position 0 is outside the round's 2 key(s) or was already announced",
        ),
        ([Ready("r", 0, [1], [1]), Ready("r", 0, [0, 1], [2, 3])], "ready.pos: position 1"),
        ([Ready("r", 0, [2], [1])], "ready.pos: position 2 is outside the round's 2 key(s)"),
        (
            [Ready("r", 0, [0], [PEER_BLOCKS])],
            f"ready.slots: slot {PEER_BLOCKS} is outside the producer's region "
            f"0..{PEER_BLOCKS - 1}",
        ),
    ],
)
def test_bad_readies_are_protocol_errors(
    consumer: Rig, readies: list[Ready], fragment: str
) -> None:
    consumer.load(1, "r", [b"a", b"b"], [4, 5])
    consumer.feed(*readies)
    doom = consumer.doomed()
    assert doom is not None and doom.outcome is Outcome.PROTOCOL_ERROR
    assert fragment in doom.reason
    assert len(consumer.data.posted) == len(readies) - 1  # nothing posted for the bad one
    consumer.reap()
    assert consumer.results == {1: Outcome.PROTOCOL_ERROR} and consumer.data.reads == {}


def test_a_ready_for_the_last_slot_of_the_producer_is_fine(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [OUR_BLOCKS - 1])
    consumer.feed(Ready("r", 0, [0], [PEER_BLOCKS - 1]))
    assert reads_posted(consumer) == [([OUR_BLOCKS - 1], [PEER_BLOCKS - 1])]
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
