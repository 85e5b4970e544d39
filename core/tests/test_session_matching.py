"""Session tests, producer side: supply and demand matched, whichever comes first.

A fetch the producer cannot serve fails that round only, and the session goes on. Rig and
fixtures: ``session_rig.py``.
"""

from __future__ import annotations

from p2pkv.protocol import Fetch, Ready, Release
from p2pkv.types import Outcome
from session_rig import Rig, as_round_failed, round_failed


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
    assert producer.sent() == [
        round_failed("r", 0, "demand_unmet: 1 demanded block(s) were never stored by the producer")
    ]
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
    doom = producer.doomed()
    assert doom.outcome is Outcome.PROTOCOL_ERROR and "fetch.keys: duplicate key" in doom.reason


def test_a_round_not_above_the_previous_fails_that_round_only(producer: Rig) -> None:
    """E.g. a finished kv_request_id reused while the producer still holds it: a request
    conflict, not a protocol error."""
    producer.feed(Fetch("r", 1, [b"a"]), Fetch("r", 1, [b"b"]))
    assert producer.doom() is None
    failed = as_round_failed(producer.sent()[0])
    assert failed.round == 1 and failed.reason.startswith("request_conflict:")
    assert "round 1 is not above the previous round 1" in failed.reason


def test_a_key_demanded_twice_fails_that_round_and_the_session_goes_on(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]), Fetch("r", 1, [b"a"]))
    assert producer.doom() is None
    failed = as_round_failed(producer.sent()[0])
    assert failed.round == 1 and failed.reason.startswith("request_conflict:")
    assert "demanded by round 0" in failed.reason
    producer.feed(Release("r", 1, False))  # the consumer's answer: ignored
    producer.store(1, "r", [b"a"], [3])  # round 0 still gets its block
    assert producer.sent() == [Ready("r", 0, [0], [3])]
    assert producer.doom() is None


def test_a_fetch_after_the_terminal_fetch_fails_that_round(producer: Rig) -> None:
    producer.feed(
        Fetch("r", 0, [b"a"]), Release("r", 0, False), Fetch("r", 1, []), Fetch("r", 2, [b"a"])
    )
    assert producer.doom() is None
    failed = as_round_failed(producer.sent()[-1])
    assert failed.round == 2
    assert failed.reason == "request_conflict: 'r' was already ended by a terminal fetch"


def test_terminal_fetch_for_an_unknown_request_leaves_no_state(producer: Rig) -> None:
    producer.feed(Fetch("nobody", 3, []))
    assert producer.session.producer.reqs == {} and producer.dir.bound("r") is None
    assert producer.doom() is None and producer.sent() == []


def test_fetch_for_a_finished_request_fails_at_once(producer: Rig) -> None:
    producer.dir.producer_finished("r")
    producer.feed(Fetch("r", 0, [b"a"]))
    failed = as_round_failed(producer.sent()[0])
    assert failed.reason.startswith("demand_unmet") and "already finished" in failed.reason
    assert producer.session.producer.reqs == {}
    producer.feed(Release("r", 0, False))  # the consumer's answer: ignored
    assert producer.doom() is None


def test_unmet_demand_fails_the_round_at_once_and_its_pins_wait_for_the_release(
    producer: Rig,
) -> None:
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.store(1, "r", [b"a"], [3])
    producer.sent()
    producer.dir.producer_finished("r")
    producer.session.producer.producer_finished("r")
    failed = as_round_failed(producer.sent()[0])
    assert failed.reason.startswith("demand_unmet: 1 demanded block(s)")
    assert producer.results == {} and producer.session.producer.n_pins == 1  # a is pinned
    producer.feed(Release("r", 0, False))
    producer.take()
    assert producer.results == {1: Outcome.ABORTED}
    assert producer.session.producer.reqs == {} and producer.dir.bound("r") is None
