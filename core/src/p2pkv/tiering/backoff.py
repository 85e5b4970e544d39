"""The negative cache of dials: addresses whose last dial failed wait before the next one.

A dial fails when the session this tier dialed ends before any frame of the peer arrived:
the address refused, never answered (black-holed, or a host that is gone), or a probe's
short deadline passed. The address is then *backed off*: for a while, requests naming it are
refused at once (a dictionary look-up: no socket, no session) and pre-connect skips it. A
failed pre-connect dial only paces pre-connect: the peer may not have been up yet (engines
started together), so requests naming it still dial it (their own failure backs it off). The
wait starts at :data:`FIRST_BACKOFF` and doubles with each failure in a row, up to
``peers.dial_backoff``; each wait is jittered (0.5x to 1.5x), so tiers that saw one peer fail
at the same moment do not all dial it again at the same moment.

An address leaves the cache when a session with it hears from the peer (a dial of ours or
one of theirs), or when ``peers.connect`` resolves to it again after it was gone (on
Kubernetes: the pod is ready again). The cache is bounded (:data:`MEMORY` addresses, the
oldest forgotten), so a flood of distinct names costs bounded memory.

Threading: driver thread only.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from typing import NamedTuple

__all__ = ["FIRST_BACKOFF", "MEMORY", "DialBackoff"]

FIRST_BACKOFF = 1.0
"""Seconds an address waits after its first failed dial (zmq remembers a failure as long)."""
MEMORY = 4096
"""Addresses remembered at most."""


class _Failure(NamedTuple):
    until: float
    wait: float
    reason: str
    pre_connect: bool
    """Only a pre-connect dial failed: requests are not refused."""


class DialBackoff:
    """Failed addresses and when each may be dialed again (see the module docstring)."""

    def __init__(self, longest: float, rng: random.Random | None = None) -> None:
        self.longest = longest
        self._rng = rng if rng is not None else random.Random()
        self._failed: OrderedDict[str, _Failure] = OrderedDict()
        self.refused = 0
        """Dials refused because their address was backed off."""

    def failed(self, peer: str, reason: str, now: float, *, pre_connect: bool = False) -> float:
        """A dial of ``peer`` failed for ``reason``; returns the seconds it now waits.
        ``pre_connect``: the dial was pre-connect's, so the wait paces pre-connect only."""
        last = self._failed.pop(peer, None)
        wait = FIRST_BACKOFF if last is None else min(last.wait * 2, self.longest)
        wait = min(wait, self.longest)
        jittered = wait * self._rng.uniform(0.5, 1.5)
        self._failed[peer] = _Failure(now + jittered, wait, reason, pre_connect)
        while len(self._failed) > MEMORY:
            self._failed.popitem(last=False)
        return jittered

    def heard(self, peer: str) -> None:
        """``peer`` answered (or reappeared in discovery): it is dialed again at once."""
        self._failed.pop(peer, None)

    def refusal(self, peer: str, now: float) -> str | None:
        """Why ``peer`` may not be dialed now (counted), or None. A pre-connect dial's failure
        refuses nothing (:meth:`ready_at` paces pre-connect)."""
        failure = self._failed.get(peer)
        if failure is None or now >= failure.until or failure.pre_connect:
            return None
        self.refused += 1
        return (
            f"its last dial failed ({failure.reason}); dialed again in "
            f"{failure.until - now:.1f}s (peers.dial_backoff)"
        )

    def ready_at(self, peer: str) -> float | None:
        """When ``peer`` may be dialed again, if it is backed off."""
        failure = self._failed.get(peer)
        return None if failure is None else failure.until

    def __len__(self) -> int:
        return len(self._failed)
