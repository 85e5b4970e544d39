"""Where the fleet simulator's processes run: on a host where the bench may use two cores
or more, the tier under test is pinned to a core of its own (the last one) and the peers'
processes to the others. Its CPU then says what the tier's code costs, not how much of a
shared core its own peers left it. Other programs on the host still share every core; the
JSON records the placement (``placement``). Imports only the standard library.
"""

from __future__ import annotations

import os

__all__ = ["pin", "placement"]


def placement() -> dict[str, list[int]] | None:
    """The cores of the tier under test (``tut``: the last one this process may use) and
    of the peers (``peers``: the rest); None with fewer than two (nothing is pinned)."""
    try:
        usable = sorted(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return None
    if len(usable) < 2:
        return None
    return {"tut": usable[-1:], "peers": usable[:-1]}


def pin(role: str, cores: dict[str, list[int]] | None) -> None:
    """Pin this process to the cores of ``role`` ("tut" or "peers") in ``cores`` (from
    :func:`placement`, None: left alone). Call it before any thread starts: threads
    inherit it (zmq's I/O thread too)."""
    if cores is not None:
        os.sched_setaffinity(0, cores[role])
