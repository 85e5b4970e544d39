"""``peers.idle_timeout``: which sessions the tier closes for carrying nothing, by timers on
the deadline heap (nothing walks the sessions)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pkv.idle_reaper import IdleReaper
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.session import State


@dataclass(eq=False)
class FakeSession:
    """What the reaper reads of a session."""

    peer: str
    last_active: float = 0.0
    dialed: bool = True
    ready: bool = True
    idle: bool = True
    state: State = State.READY


class Reaping:
    """A reaper on its own heap and clock, recording what it closes."""

    def __init__(self, idle_timeout: float, kept: frozenset[str] = frozenset()) -> None:
        self.now = 0.0
        self.timers = Deadlines()
        self.closed: list[str] = []
        self.reaper = IdleReaper(
            idle_timeout, self.timers, lambda: self.now, self.close, kept.__contains__
        )

    def close(self, session: Any, reason: str) -> None:
        assert "peers.idle_timeout" in reason
        session.state = State.CLOSED
        self.reaper.closed(session, lost=False)
        self.closed.append(session.peer)

    def open(self, *sessions: FakeSession) -> None:
        for session in sessions:
            self.reaper.opened(session)  # type: ignore[arg-type]

    def at(self, now: float) -> list[str]:
        self.now = now
        self.timers.fire_due(now)
        closed, self.closed = self.closed, []
        return closed


def test_only_idle_ready_dialed_sessions_not_kept_are_reaped() -> None:
    r = Reaping(100.0, kept=frozenset({"kept"}))
    sessions = [
        FakeSession("idle"),
        FakeSession("theirs", dialed=False),
        FakeSession("handshaking", ready=False),
        FakeSession("working", idle=False),
        FakeSession("kept"),
    ]
    r.open(*sessions)
    assert r.at(99.0) == []
    assert r.at(100.0) == ["idle"]
    assert r.reaper.reaped == 1
    assert len(r.timers) == 3  # the others are looked at again later; "theirs" has none


def test_a_session_active_since_is_reaped_idle_timeout_after_its_last_activity() -> None:
    r = Reaping(100.0)
    session = FakeSession("a")
    r.open(session)
    session.last_active = 60.0
    assert r.at(100.0) == []
    assert r.at(159.0) == []
    assert r.at(160.0) == ["a"]


def test_a_working_session_is_looked_at_again_a_quarter_of_the_time_later() -> None:
    r = Reaping(100.0)
    session = FakeSession("a", idle=False)
    r.open(session)
    assert r.at(100.0) == []
    session.idle = True
    assert r.at(124.0) == []
    assert r.at(125.0) == ["a"]


def test_a_long_idle_time_is_still_looked_at_every_30_seconds() -> None:
    r = Reaping(3600.0)
    session = FakeSession("a", idle=False)
    r.open(session)
    assert r.at(3600.0) == []
    session.idle = True
    assert r.at(3630.0) == ["a"]


def test_a_closed_session_leaves_no_timer() -> None:
    r = Reaping(100.0)
    session = FakeSession("a")
    r.open(session)
    session.state = State.CLOSED
    r.reaper.closed(session, lost=True)  # type: ignore[arg-type]
    assert len(r.timers) == 0
    assert r.at(1000.0) == []


def test_zero_never_reaps() -> None:
    r = Reaping(0.0)
    r.open(FakeSession("a"))
    assert len(r.timers) == 0
    assert r.at(1e9) == []
    assert r.reaper.reaped == 0
