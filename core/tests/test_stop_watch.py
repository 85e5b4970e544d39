"""Telling a stopped process from a slow tick (issue 46): the watchdog's own gaps
(``p2pkv.session.stop_watch``), the pause detector that asks it, and a tier whose data
transport blocks in a call: a slow tick of its own, never taken for a pause."""

from __future__ import annotations

import gc
import logging
import threading
import time
from typing import Any

import pytest
from p2pkv.reference.control import MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.session.pause import PauseDetector
from p2pkv.session.stop_watch import StopWatch, watch_period
from p2pkv.testing import harness as h
from p2pkv.testing.tier_machine import TierNode
from p2pkv.types import Outcome

SILENCE = 0.5
"""The silence timeout of the tier test's control transport (real seconds)."""


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_the_watchdog_wakes_often_enough_for_any_silence_timeout() -> None:
    assert watch_period(1.0) == pytest.approx(0.1)
    assert watch_period(10.0) == pytest.approx(0.1)
    assert watch_period(0.2) == pytest.approx(0.02)
    assert watch_period(0.01) == pytest.approx(0.005)


def test_a_gap_of_the_watchdog_itself_is_a_stop() -> None:
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False)
    clock.now += 3.0  # nothing ran, the watchdog neither
    watch.beat()
    assert watch.stopped(since=100.0, now=clock.now)
    assert not watch.stopped(since=clock.now, now=clock.now), "a stop before `since` counts not"


def test_a_watchdog_that_kept_beating_saw_no_stop() -> None:
    """A slow tick: the tier's clock moved 3 s, but the watchdog ran all along."""
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False)
    for _ in range(30):
        clock.now += 0.1
        watch.beat()
    assert not watch.stopped(since=100.0, now=clock.now)


def test_a_silent_watchdog_is_a_stop_it_has_not_noticed_yet() -> None:
    """Resumed, and the tier ticks before the watchdog woke: its silence is the stop."""
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False)
    clock.now += 2.5
    assert watch.stopped(since=100.0, now=clock.now)


class Runnable:
    """A fake ``/proc`` reading: nanoseconds the driver thread ran or waited for a CPU."""

    def __init__(self) -> None:
        self.ns = 0

    def __call__(self, tid: int) -> int:
        return self.ns


def test_a_driver_starved_of_cpu_is_no_stop_though_the_watchdog_waited() -> None:
    """A host short of CPU: the watchdog could not run for 3 s, but the driver thread was on a
    CPU or waiting for one all that time (a stopped thread is neither)."""
    clock, runnable = Clock(), Runnable()
    watch = StopWatch(clock, 2.0, start=False, runnable=runnable)
    watch.driver = 7
    watch.beat()
    clock.now += 3.0
    runnable.ns += 2_900_000_000
    assert not watch.stopped(since=100.0, now=clock.now), "silent watchdog, busy driver"
    watch.beat()
    assert not watch.stopped(since=100.0, now=clock.now), "the watchdog's own gap"
    clock.now += 3.0  # now stopped: the driver's times stand still
    assert watch.stopped(since=103.0, now=clock.now)
    watch.beat()
    assert watch.stopped(since=103.0, now=clock.now)


class DriverWithinTheWakeUp(Runnable):
    """A ``/proc`` reading during which the driver thread asks the watch: what happens when
    the watchdog lets go of the GIL inside a wake-up, as both threads start after a resume."""

    def __init__(self, clock: Clock) -> None:
        super().__init__()
        self.clock = clock
        self.watch: StopWatch | None = None
        self.answers: list[bool] = []

    def __call__(self, tid: int) -> int:
        watch, self.watch = self.watch, None  # once: ``stopped`` reads /proc too
        if watch is not None:
            self.answers.append(watch.stopped(since=100.0, now=self.clock.now))
        return self.ns


def test_a_driver_that_asks_within_the_watchdogs_first_wake_up_after_a_stop_sees_it() -> None:
    """The defect behind one missed pause in ten (chaos, "consumer resumed", every lane): the
    watchdog published its wake-up's time before judging the gap, and a driver that asked in
    between took the 3 s stop for a slow tick."""
    clock = Clock()
    runnable = DriverWithinTheWakeUp(clock)
    watch = StopWatch(clock, 1.0, start=False, runnable=runnable)
    watch.driver = 7
    watch.beat()
    clock.now += 3.0  # stopped: the driver's times stand still
    runnable.watch = watch
    watch.beat()  # the driver asks while the watchdog reads /proc
    assert runnable.answers == [True]
    assert watch.stopped(since=100.0, now=clock.now), "and after the wake-up"


def test_without_the_drivers_cpu_times_the_watchdog_alone_decides() -> None:
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False, runnable=lambda tid: None)
    watch.driver = 7
    watch.beat()
    clock.now += 3.0
    assert watch.stopped(since=100.0, now=clock.now)


def test_the_pause_detector_tells_the_watchdog_its_driver_thread() -> None:
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False)
    detector = PauseDetector(clock, 2.0, watch=watch)
    detector.gap()
    assert watch.driver == threading.get_native_id()


def test_the_pause_detector_asks_the_watchdog() -> None:
    clock = Clock()
    watch = StopWatch(clock, 2.0, start=False)
    detector = PauseDetector(clock, 2.0, watch=watch)
    for _ in range(30):  # a 3 s tick, the process running
        clock.now += 0.1
        watch.beat()
    assert detector.gap() is None
    assert detector.slow_ticks == 1
    clock.now += 3.0  # stopped: the watchdog too
    assert detector.gap() == pytest.approx(3.0)
    assert PauseDetector(clock, None).gap() is None


def test_the_watchdog_thread_ends_on_close_and_with_its_watch() -> None:
    closed = StopWatch(time.monotonic, 1.0)
    thread = closed._thread
    assert thread is not None and thread.is_alive()
    closed.close()
    thread.join(10)
    assert not thread.is_alive()

    dropped = StopWatch(time.monotonic, 1.0)
    thread = dropped._thread
    assert thread is not None
    del dropped
    gc.collect()
    thread.join(10)
    assert not thread.is_alive(), "a watch nobody holds must not keep its thread"


def test_the_watchdog_thread_beats_on_its_own() -> None:
    watch = StopWatch(time.monotonic, 1.0)
    try:
        first = watch._latest[0]
        deadline = time.monotonic() + 10
        while watch._latest[0] == first and time.monotonic() < deadline:
            threading.Event().wait(watch.period)
        assert watch._latest[0] > first
    finally:
        watch.close()


class _SilentMemoryControl(MemoryControlTransport):
    """Memory control whose peers drop us after ``SILENCE`` s without I/O (as zmq's)."""

    @property
    def silence_timeout(self) -> float:
        return SILENCE


class _StallingMemoryData(MemoryDataTransport):
    """Memory data whose next ``progress`` blocks for ``stall`` seconds when set: a transport
    call that keeps the tier's driver thread (the defect the driver bound forbids)."""

    stall = 0.0

    def progress(self) -> None:
        if self.stall:
            seconds, self.stall = self.stall, 0.0
            threading.Event().wait(seconds)  # blocked in a call, the process running
        super().progress()


def test_a_slow_transport_call_is_not_taken_for_a_pause(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A consumer with a load open; its data transport blocks one tick for twice the silence
    timeout. The tick after it sees the gap, but the process ran: its sessions stay, the call
    is logged as over the driver bound (both counted in the tier's stats), and the load
    completes once its producer stores."""
    clock: Any = time.monotonic  # real time: the stall is a real one
    made = [
        TierNode(
            clock,
            control=_SilentMemoryControl,
            data=_StallingMemoryData,
            registry=h.REGISTRY,
            seed=i,
        )
        for i in range(2)
    ]
    p, c = made
    try:
        pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
        c.tier.on_new_request(cctx)
        p.tier.on_new_request(pctx)
        c.load(1, h.keys("r", 2), [0, 1], cctx)
        h.pump([p, c], 4)
        assert c.outcome(1) is None
        c.data.stall = 2 * SILENCE
        with caplog.at_level(logging.INFO, logger="p2pkv"):
            c.collect()  # the tick that blocks
            c.collect()  # the tick after it: a gap past the silence timeout
        assert c.outcome(1) is None, f"the slow tick was taken for a pause: {c.results}"
        assert "a slow tick, not a pause" in caplog.text
        assert "progress took" in caplog.text and "over the driver bound" in caplog.text
        assert "process paused?" not in caplog.text
        stats = c.tier.stats()
        assert stats["slow_ticks"] == 1 and stats["data_calls_over_bound"] >= 1
        assert stats["data_held"] == 0, "the memory transport holds nothing for removed peers"
        p.store(2, h.keys("r", 2), [4, 5], pctx)
        h.pump_until([p, c], lambda: c.outcome(1) is not None)
        assert c.outcome(1) is Outcome.DONE
    finally:
        for node in made:
            node.shutdown()
