"""Fewer ticks of a quiet tier on vLLM's tier-poll thread (vLLM 0.33 and later).

vLLM 0.33 polls a tier that opts in from a thread of its own every ``tier_poll_interval_s``
(1 ms by default): each round calls ``get_finished_jobs`` and ``serve_external_requests``,
engine steps or not. A tier with nothing pending (no job, no result to hand over, no probe,
round, pin or handshake) only needs those rounds to notice a peer's first frame, so
:class:`QuietPolls` lets it tick once per :data:`QUIET_TICK` instead: a new peer's first
frame waits at most that long, and the idle engine pays for about a fifth of the rounds.
Once anything is pending, and after every engine step (``on_schedule_end``), every round
ticks again.

Threading: called by whichever thread holds vLLM's manager lock (the scheduler's or the
tier-poll thread), one at a time, like the tier itself.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["QUIET_TICK", "QuietPolls"]

QUIET_TICK = 0.005
"""Seconds between two ticks of a tier with nothing pending, on vLLM's tier-poll thread."""


class QuietPolls:
    """Whether a poll round may leave a quiet tier alone (see the module)."""

    __slots__ = ("_clock", "_until")

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._until = 0.0
        """Until when rounds skip the tier (0: none skips)."""

    def skip(self) -> bool:
        """True while the tier was found quiet less than ``QUIET_TICK`` ago."""
        return bool(self._until) and self._clock() < self._until

    def ticked(self, pending: bool) -> None:
        """The tier just ticked and has (``pending``) or has not work outstanding."""
        self._until = 0.0 if pending else self._clock() + QUIET_TICK

    def stirred(self) -> None:
        """The engine stepped: its calls may have left work, so the next round ticks."""
        self._until = 0.0
