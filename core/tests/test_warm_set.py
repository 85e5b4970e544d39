"""``peers.connect`` at fleet scale (issue 48, items 2 and 3): the warm set's dials are paced.

Memory transports on a fake clock; ``peers.connect`` names every peer. A member's first dial
waits a random part of a second, at most ``peers.max_handshakes`` of the set's dials are in
their handshake at once, and a member whose peer went away is dialed again after a backoff,
quietly: no warning blames requests, and nothing is logged per attempt.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest
from p2pkv.testing.waiting import wait_until

T = 60.0


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


def service(cluster: Any, size: int, **peers: Any) -> tuple[Any, list[Any]]:
    """A consumer whose ``peers.connect`` lists ``size`` new peers."""
    members = [cluster() for _ in range(size)]
    c = cluster(
        peers={"connect": [p.address for p in members], **peers},
        control_options={"connect_timeout": 0.001},
    )
    return c, members


def resolved(c: Any, size: int) -> None:
    """Wait for the discovery thread's answer (real time) without moving the clock."""
    wait_until(
        lambda: c.tier.stats()["peers_warm"] == size,
        timeout=T,
        pumps=[c.collect],
        what="peers.connect's answer",
    )


def test_first_dials_spread_and_at_most_max_handshakes_are_under_way(
    h: Any,
    cluster: Any,
) -> None:
    c, members = service(cluster, 40, warm=40, max_handshakes=4)
    resolved(c, 40)
    assert c.tier.stats()["sessions"] == 0  # each first dial waits a random part of 1 s
    c.clock.advance(1.0)
    h.pump([c], 2)  # the members never answer: their dials stay in the handshake
    assert c.tier.stats()["peers_dialing"] == 4
    dialing = []

    def step() -> None:
        h.pump([c, *members], 1)
        dialing.append(c.tier.stats()["peers_dialing"])
        c.clock.advance(0.1)  # members the resolver adds later wait their own jitter

    wait_until(
        lambda: c.tier.stats()["peers_warm_ready"] == 40,
        timeout=T,
        what="every member warm",
        pumps=[step],
    )
    assert max(dialing) <= 4, dialing


def test_a_member_that_went_away_is_dialed_again_quietly_after_a_backoff(
    h: Any,
    cluster: Any,
    caplog: pytest.LogCaptureFixture,
) -> None:
    c, members = service(cluster, 3, warm=3)
    resolved(c, 3)
    c.clock.advance(1.0)
    h.pump_until([c, *members], lambda: c.tier.stats()["peers_warm_ready"] == 3)
    caplog.set_level(logging.DEBUG, logger="p2pkv")
    gone = members[0]
    gone.shutdown()  # says bye: nothing listens at its address any more
    for _ in range(40):  # 40 s of fake time: a dial each time the backoff passes
        c.clock.advance(1.0)
        wait_until(
            lambda: not c.tier.stats()["peers_dialing"],
            timeout=T,
            pumps=[c.collect],
            what="the dial to end",
        )
    stats = c.tier.stats()
    assert stats["peers_warm_ready"] == 2 and stats["peers_warm"] == 3, stats
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert not warnings, warnings
    told = [
        r.getMessage()
        for r in caplog.records
        if r.getMessage().startswith(f"peers.connect: {gone.address}")
    ]
    assert len(told) == 1 and "does not answer" in told[0], told
    failed = [
        r
        for r in caplog.records
        if r.getMessage().startswith(f"session with {gone.address} closed: connection")
    ]
    assert 3 <= len(failed) <= 12, len(failed)  # 1 s doubling to 10 s (jittered), not 40
