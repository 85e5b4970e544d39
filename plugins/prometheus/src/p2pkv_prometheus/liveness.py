"""Live gauges in multi-process mode: a process's gauges leave the scrape when it exits.

In multi-process mode (``PROMETHEUS_MULTIPROC_DIR`` set before the processes start) each
process writes its samples to files of its own in that directory, and a scrape merges them
(``prometheus_client.multiprocess.MultiProcessCollector``). Counters and histograms of a
process that exited stay in the sums, as they should; its gauges must not: the gauges use
``livesum``, and a process that sets one removes its gauge files when it exits
(``prometheus_client.multiprocess.mark_process_dead``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from multiprocessing.util import Finalize

from prometheus_client import multiprocess

__all__ = ["MULTIPROC_ENV", "watch_exit"]

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

_watched_pid = 0

_mark_process_dead: Callable[[int, str], None] = multiprocess.mark_process_dead
"""``prometheus_client``'s own, which is not annotated: removes ``pid``'s live gauge files."""


def watch_exit() -> None:
    """Have this process's live gauges removed when it exits (multi-process mode only).

    Called before every gauge update: once per process it registers the removal (a forked
    child, which inherits the parent's state, registers its own); after that it is one pid
    comparison. The removal runs at interpreter exit and when a ``multiprocessing`` child
    returns, including forked ones, which leave through ``os._exit`` and skip ``atexit``
    (``multiprocessing.util.Finalize`` runs in both). A process killed by a signal cannot
    clean up after itself: whoever supervises it calls ``mark_process_dead(pid)`` once it is
    gone (``p2pkv demo --metrics`` does for its role processes)."""
    global _watched_pid
    pid = os.getpid()
    if pid == _watched_pid:
        return
    _watched_pid = pid
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        Finalize(None, _forget, args=(pid, path), exitpriority=0)


def _forget(pid: int, path: str) -> None:
    """Remove ``pid``'s live gauge files, unless this is a plain ``os.fork`` child exiting
    with its parent's finalizers (it must not remove the parent's gauges)."""
    if os.getpid() == pid:
        _mark_process_dead(pid, path)
