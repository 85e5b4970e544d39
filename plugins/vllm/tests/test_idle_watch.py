"""``IdleWatch`` with a recording tier: who drives, how long each tick may wait, who is woken.

No vLLM and no transport: the tier records each tick's wait and reports work for the engine
as the test says. Counts only, never time (the waits recorded are the arguments given).
"""

from __future__ import annotations

import threading

from p2pkv.testing.waiting import wait_until
from p2pkv_vllm.idle import LENT_PACE, IdleWatch

IDLE_WAIT = 0.25


class RecordingTier:
    """The calls ``IdleWatch`` makes on a tier, with ``needs_engine`` set by the test."""

    def __init__(self) -> None:
        self.waits: list[float] = []
        self.needed = False
        self.interrupts = 0
        self.inside = threading.Lock()

    def tick(self, timeout: float) -> None:
        assert self.inside.acquire(False), "two threads inside the tier"
        self.waits.append(timeout)
        self.inside.release()

    def needs_engine(self) -> bool:
        return self.needed

    def interrupt(self) -> None:
        self.interrupts += 1


def test_lent_to_a_computing_engine_it_paces_work_in_flight_and_never_wakes() -> None:
    tier = RecordingTier()
    woken: list[int] = []
    watch = IdleWatch(tier, lambda: woken.append(1), IDLE_WAIT)
    try:
        tier.needed = True
        watch.lend()  # the engine ended its schedule and computes
        wait_until(
            lambda: tier.waits.count(LENT_PACE) >= 3,
            timeout=30,
            what="the lent watcher pacing the tier's work in flight",
        )
        assert woken == [] and watch.wakeups == 0
        with watch.engine():  # the step's end: the engine takes the tier back
            taken = len(tier.waits)
            assert tier.interrupts >= 1
        assert len(tier.waits) == taken  # nobody ticked while the engine held it

        tier.needed = False
        watch.lend()
        wait_until(
            lambda: tier.waits[-1] == IDLE_WAIT,
            timeout=30,
            what="the lent watcher waiting long once nothing is in flight",
        )
        assert woken == []
        with watch.engine():
            pass
    finally:
        watch.close(5.0)


def test_asleep_it_waits_long_and_wakes_the_engine_for_its_work() -> None:
    tier = RecordingTier()
    woken = threading.Event()
    watch = IdleWatch(tier, woken.set, IDLE_WAIT)
    try:
        tier.needed = True
        watch.sleep()  # the engine blocks on its input queue
        assert woken.wait(30), "the sleeping engine was never woken"
        assert watch.wakeups == 1
        assert set(tier.waits) == {IDLE_WAIT}  # asleep: no pace, the engine steps instead
    finally:
        watch.close(5.0)
