"""Session tests: a session that dies or closes, and the tier's wind-down, on both sides.

The consumer fails its loads at once (reads cancelled first). The producer keeps its pins
until the consumer's release or the lease. Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

import pytest
from p2pkv.protocol import Bye, Fetch, HelloAck, Lookup, LookupResp, Ready, Release
from p2pkv.session.session import State
from p2pkv.types import Outcome
from session_rig import Rig, as_round_failed, cancelled_at, failed_ids, round_failed


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
    assert cancelled_at(events, rids[0]) < events.index(("result", 1, Outcome.PEER_DEAD))
    assert cancelled_at(events, rids[2]) < events.index(("result", 2, Outcome.PEER_DEAD))
    assert ("send", "release") not in events and consumer.sent() == []  # nothing to wait for
    assert consumer.data.reads == {} and consumer.env.owners == {}
    assert consumer.session.state is State.CLOSED and failed_ids(consumer) == {"r", "q"}
    assert len(consumer.deadlines) == 0


def test_closing_fails_loads_and_marks_ids(consumer: Rig) -> None:
    consumer.load(1, "r", [b"a"], [0])
    consumer.session.consumer.open_request("idle")
    consumer.session.close(Outcome.PEER_DEAD, "gone")
    consumer.take()
    assert consumer.results == {1: Outcome.PEER_DEAD} and consumer.details[1] == "gone"
    assert failed_ids(consumer) == {"r", "idle"}
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
    assert sorted(producer.sent(), key=repr) == [
        round_failed("q", 0, detail),
        round_failed("r", 0, detail),
    ]
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
    producer: Rig,
) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]))
    assert producer.sent() == [Ready("r", 0, [0], [3])]
    producer.session.wind_down()  # meanwhile the consumer read a and sent release(read=True)
    assert as_round_failed(producer.sent()[0]).reason.startswith("peer_dead:")
    assert producer.results == {} and not producer.session.wound_down
    producer.feed(Release("r", 0, True))
    assert producer.doom() is None and 1 in producer.results
    assert producer.session.wound_down


def test_a_pinned_job_read_before_the_wind_down_reached_the_consumer_is_done(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.session.wind_down()
    producer.feed(Release("r", 0, True))
    assert producer.results == {1: Outcome.DONE}


def test_the_release_for_a_fetch_refused_during_wind_down_is_not_a_protocol_error(
    producer: Rig,
) -> None:
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.store(1, "r", [b"a"], [3])  # pinned for round 0: the request state stays
    producer.session.wind_down()
    producer.feed(Fetch("r", 1, [b"b"]))
    assert as_round_failed(producer.sent()[-1]).round == 1
    producer.feed(Release("r", 1, False))
    assert producer.doom() is None
