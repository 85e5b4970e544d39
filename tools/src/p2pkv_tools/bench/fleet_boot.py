"""The entry of the fleet simulator's tier-under-test process, before anything of p2pkv is
imported: ``--fleet-tut-path`` puts another checkout's packages first on ``sys.path`` (its
``core/src`` and ``transports/zmq/src``), so the tier under test runs that commit's code
against this branch's peers and tool. Imports only the standard library at module level
(and :mod:`~p2pkv_tools.bench.fleet_cores`, which does too). The process is pinned to its
core first.
"""

from __future__ import annotations

import sys
from multiprocessing.connection import Connection
from typing import Any

from p2pkv_tools.bench.fleet_cores import pin

__all__ = ["tut_entry"]


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
