"""QuietPolls: how often a quiet tier ticks on vLLM's tier-poll thread (vLLM 0.33)."""

from __future__ import annotations

import pytest
from p2pkv_vllm.quiet import QUIET_TICK, QuietPolls


@pytest.fixture
def clock() -> list[float]:
    """A clock set by hand (``clock[0]``)."""
    return [100.0]


def test_a_quiet_tier_skips_rounds_for_one_quiet_tick(clock: list[float]) -> None:
    polls = QuietPolls(lambda: clock[0])
    assert not polls.skip()  # never ticked: the first round ticks
    polls.ticked(pending=False)
    assert polls.skip()
    clock[0] += QUIET_TICK / 2
    assert polls.skip()
    clock[0] += QUIET_TICK
    assert not polls.skip()  # a quiet tick later: the round ticks


def test_pending_work_and_engine_steps_make_every_round_tick(clock: list[float]) -> None:
    polls = QuietPolls(lambda: clock[0])
    polls.ticked(pending=True)
    assert not polls.skip()
    polls.ticked(pending=False)
    polls.stirred()  # an engine step may have left work
    assert not polls.skip()
