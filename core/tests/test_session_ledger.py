"""The job ledger (exactly-once results) and the deadline heap."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.observers import Observers
from p2pkv.session import Deadlines, JobLedger
from p2pkv.types import JobResult, Outcome


def test_each_job_gets_exactly_one_result() -> None:
    ledger = JobLedger(lambda: 0.0, Observers())
    ledger.open(1, True, "r", "p")
    ledger.open(2, False)
    assert ledger.pending == 2
    assert ledger.close(1, Outcome.LOAD_TIMEOUT, "slow")
    assert not ledger.close(1, Outcome.DONE)  # a late completion produces nothing
    assert not ledger.close(99, Outcome.DONE)  # unknown ids produce nothing
    assert ledger.undelivered == 1
    assert ledger.take() == [JobResult(1, Outcome.LOAD_TIMEOUT, "slow")]
    assert ledger.take() == []
    assert ledger.outcomes[Outcome.LOAD_TIMEOUT] == 1 and ledger.open_ids() == [2]


def test_a_job_id_still_in_flight_cannot_be_reused() -> None:
    ledger = JobLedger(lambda: 0.0, Observers())
    ledger.open(1, True)
    with pytest.raises(ValueError, match="already in flight"):
        ledger.open(1, False)
    ledger.close(1, Outcome.DONE)
    ledger.open(1, False)  # finished ids may come back


def test_deadlines_fire_in_order_and_cancel() -> None:
    d = Deadlines()
    fired: list[str] = []
    d.at(5, fired.append, "b")
    a = d.at(1, fired.append, "a")
    c = d.at(9, fired.append, "c")
    d.cancel(c)
    d.cancel(c)  # idempotent
    d.cancel(None)
    assert len(d) == 2 and d.next_due() == 1
    assert d.fire_due(4) == 1 and fired == ["a"]
    d.cancel(a)  # already fired: no-op
    assert d.fire_due(100) == 1 and fired == ["a", "b"] and len(d) == 0
    assert d.next_due() is None


def test_a_cancelled_timer_lets_go_of_its_callback_and_argument() -> None:
    import gc
    import weakref

    class Arg:
        pass

    d = Deadlines()
    arg = Arg()
    gone = weakref.ref(arg)
    timer = d.at(5, lambda _: None, arg)
    del arg
    d.cancel(timer)
    assert gone() is None  # freed at once: nothing waits in the heap for the collector
    gc.collect()
    assert gc.is_tracked(timer) is False  # the entry left behind holds two numbers
    assert d.fire_due(10) == 0 and len(d) == 0


def test_callbacks_may_arm_timers_that_are_already_due() -> None:
    d = Deadlines()
    fired: list[int] = []

    def chain(n: int) -> None:
        fired.append(n)
        if n < 3:
            d.at(0, chain, n + 1)

    d.at(0, chain, 0)
    d.fire_due(0)
    assert fired == [0, 1, 2, 3]


@given(st.lists(st.tuples(st.integers(0, 50), st.booleans()), max_size=300))
def test_heap_stays_proportional_to_live_timers(plan: list[tuple[int, bool]]) -> None:
    d = Deadlines()
    fired: list[int] = []
    live = []
    for when, keep in plan:
        t = d.at(when, fired.append, when)
        if keep:
            live.append(when)
        else:
            d.cancel(t)
    assert len(d) == len(live)
    assert len(d._heap) <= max(64, 4 * len(live) + 1)
    d.fire_due(50)
    assert fired == sorted(live)
