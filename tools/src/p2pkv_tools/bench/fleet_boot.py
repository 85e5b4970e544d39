"""The entry of the fleet simulator's tier-under-test process, before anything of p2pkv is
imported: ``--fleet-tut-path`` puts another checkout's packages first on ``sys.path`` (its
``core/src`` and ``transports/zmq/src``), so the tier under test runs that commit's code
against this branch's peers and tool. Imports only the standard library at module level.

Placement: on a host where the bench may use two cores or more, the tier under test is
pinned to a core of its own (the last one) and the peers' processes to the others
(:func:`placement`, :func:`pin`). Its CPU then says what the tier's code costs, not how
much of a shared core its own peers left it. Other programs on the host still share
every core; the JSON records the placement (``placement``).
"""

from __future__ import annotations

import os
import sys
from multiprocessing.connection import Connection
from typing import Any

__all__ = ["pin", "placement", "tut_entry"]


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


def tut_entry(
    conn: Connection, cores: dict[str, list[int]] | None, paths: list[str], *args: Any
) -> None:
    """Pin this process (:func:`pin`), put ``paths`` first on ``sys.path``, then serve the
    tier under test. With ``paths``, the p2pkv modules this process already holds (a
    spawned child imports its parent's main module, the ``p2pkv`` command) are dropped
    first, so every one is imported again from there."""
    pin("tut", cores)
    if paths:
        sys.path[:0] = paths
        for name in [n for n in sys.modules if n.split(".")[0].startswith("p2pkv")]:
            del sys.modules[name]
    from p2pkv_tools.bench.fleet_tut import tut_main

    tut_main(conn, *args)
