"""Session tests, producer side: the release of a round, and the lease behind it.

Pinned blocks are delivered by ``release(read=True)``, failed by ``release(read=False)`` or
by the lease passing. Rig and fixtures: ``session_rig.py``.
"""

from __future__ import annotations

import pytest
from p2pkv.config import Timeouts
from p2pkv.protocol import Fetch, Ready, Release
from p2pkv.types import Outcome
from session_rig import Rig, as_round_failed, round_failed


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
    assert as_round_failed(rig.sent()[0]).reason.startswith("load_timeout:")


def test_a_round_its_consumer_gave_up_does_not_hold_demand_forever(producer: Rig) -> None:
    """A fetch for blocks that never come, whose release was lost or never sent: the round
    ends one lease after the fetch arrived."""
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.tick(producer.timeouts.lease - 0.1)
    assert producer.sent() == [] and producer.session.producer.n_rounds == 1
    producer.tick(0.2)
    failed = as_round_failed(producer.sent()[0])
    assert failed.reason.startswith("load_timeout:")
    assert producer.session.producer.state_sizes()["demand"] == 0 and producer.doom() is None
    assert producer.session.producer.n_rounds == 0


@pytest.mark.parametrize(
    "end, outcome",
    [
        ("release_read", Outcome.STORE_TIMEOUT),
        ("release_not_read", Outcome.ABORTED),
        ("lease", Outcome.TRANSFER_FAILED),
    ],
)
def test_a_store_result_waits_while_its_blocks_are_pinned(
    producer: Rig, end: str, outcome: Outcome
) -> None:
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


def test_release_read_for_a_round_with_unannounced_keys_is_a_protocol_error(producer: Rig) -> None:
    producer.store(1, "r", [b"a"], [3])
    producer.feed(Fetch("r", 0, [b"a", b"b"]))
    producer.feed(Release("r", 0, True))
    doom = producer.doomed()
    assert doom.outcome is Outcome.PROTOCOL_ERROR
    assert "release.read: round 0 of 'r' still has 1 block(s) never announced" in doom.reason


def test_release_for_a_round_never_fetched_is_a_protocol_error(producer: Rig) -> None:
    producer.feed(Fetch("r", 0, [b"a"]))
    producer.feed(Release("r", 3, False))
    assert "release.round: round 3 of 'r' was never fetched" in producer.doomed().reason


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
