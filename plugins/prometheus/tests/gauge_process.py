"""A process that reports p2pkv gauges and exits once its stdin closes (for test_live_gauges).

``python gauge_process.py SESSIONS plain|fork|spawn``: the reporting process (this one for
``plain``, a ``multiprocessing`` child of that start method otherwise) counts one opened
session and sets the ``sessions`` gauge to SESSIONS through the plugin's hooks, then this
process prints ``ready``; when stdin reaches EOF the reporting process returns normally and
this one exits 0. With ``fork`` this process reports too (sessions 0) before forking, so the
child inherits a process that already watches its own exit.
"""

from __future__ import annotations

import multiprocessing as mp
import sys
from multiprocessing.context import ForkContext, SpawnContext
from multiprocessing.synchronize import Event

DEADLINE = 30.0


def report(sessions: int) -> None:
    from p2pkv_prometheus import plugin

    plugin.p2pkv_session_opened(peer="peer", local="local")
    plugin.p2pkv_tier_state(in_flight_transfers=0, parked_stores=0, sessions=sessions)


def child(sessions: int, ready: Event, done: Event) -> None:
    report(sessions)
    ready.set()
    if not done.wait(DEADLINE):
        raise SystemExit("never told to exit")


def main(sessions: int, how: str) -> None:
    if how == "plain":
        report(sessions)
        print("ready", flush=True)
        sys.stdin.read()
        return
    if how == "fork":
        from p2pkv_prometheus import plugin

        plugin.p2pkv_tier_state(in_flight_transfers=0, parked_stores=0, sessions=0)
    assert how in ("fork", "spawn"), how
    ctx: ForkContext | SpawnContext = (
        mp.get_context("fork") if how == "fork" else mp.get_context("spawn")
    )
    ready, done = ctx.Event(), ctx.Event()
    proc = ctx.Process(target=child, args=(sessions, ready, done))
    proc.start()
    if not ready.wait(DEADLINE):
        raise SystemExit("child did not report")
    print("ready", flush=True)
    sys.stdin.read()
    done.set()
    proc.join(DEADLINE)
    if proc.exitcode != 0:
        raise SystemExit(f"child exit code {proc.exitcode}")


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2])
