"""``peers.idle_timeout``: which sessions the tier closes for carrying nothing."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from p2pkv.idle_reaper import IdleReaper


@dataclass
class FakeSession:
    """What the reaper reads of a session."""

    peer: str
    last_active: float = 0.0
    dialed: bool = True
    ready: bool = True
    idle: bool = True


def reap(reaper: IdleReaper, now: float, sessions: list[FakeSession],
         kept: frozenset[str] = frozenset()) -> list[str]:
    chosen: list[Any] = reaper.due(now, sessions, kept)  # type: ignore[arg-type]
    return [s.peer for s in chosen]


def test_only_idle_ready_dialed_sessions_not_kept_are_reaped() -> None:
    reaper = IdleReaper(100.0, now=0.0)
    sessions = [
        FakeSession("idle"),
        FakeSession("recent", last_active=50.0),
        FakeSession("theirs", dialed=False),
        FakeSession("handshaking", ready=False),
        FakeSession("working", idle=False),
        FakeSession("kept"),
    ]
    assert reap(reaper, 120.0, sessions, frozenset({"kept"})) == ["idle"]
    assert reaper.reaped == 1


def test_sessions_are_checked_once_per_sweep_interval() -> None:
    reaper = IdleReaper(100.0, now=0.0)  # sweeps every 25 s
    assert reap(reaper, 24.0, [FakeSession("a", last_active=-200.0)]) == []
    assert reap(reaper, 25.0, [FakeSession("a", last_active=-200.0)]) == ["a"]
    assert reap(reaper, 30.0, [FakeSession("b", last_active=-200.0)]) == []  # next at 50
    assert reap(reaper, 50.0, [FakeSession("b", last_active=-200.0)]) == ["b"]


def test_a_long_idle_time_is_still_checked_every_30_seconds() -> None:
    reaper = IdleReaper(3600.0, now=0.0)
    assert reap(reaper, 30.0, [FakeSession("a", last_active=-3600.0)]) == ["a"]


def test_zero_never_reaps() -> None:
    reaper = IdleReaper(0.0, now=0.0)
    assert reap(reaper, 1e9, [FakeSession("a")]) == []
    assert reaper.reaped == 0
