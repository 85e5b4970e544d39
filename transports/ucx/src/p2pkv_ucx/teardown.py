"""The ``ucx`` transport's end: releasing UCX after ``close``, or keeping it on purpose."""

from __future__ import annotations

import ctypes

import numpy as np

from p2pkv_ucx.state import UcxState, log

__all__ = ["Teardown"]


class Teardown:
    """Ends a closing transport whose reads ended and whose serving sends were drained.

    Driver thread only, once (from ``_shutdown``). Owns nothing until then; afterwards the
    state's tables are empty and its UCX objects gone, or (something UCX still holds) leaked
    for the life of the process, never freed under UCX. Never raises.
    """

    def __init__(self, state: UcxState) -> None:
        self._s = state
        self.leaked = False
        """Whether ``finish`` kept the region and UCX objects (something UCX still held)."""

    def finish(self, kept: list[int]) -> list[int]:
        """Settle orphans; with ``kept`` (undrained serve ids) or orphans left, leak the state
        (region and UCX objects) and return their ids, else release everything."""
        s = self._s
        s.orphans = [serve for serve in s.orphans if not serve.settle()]
        undrained = sorted({*kept, *(serve.tid for serve in s.orphans)})
        if undrained:
            log.warning(
                "ucx transport closed with %d sends UCX has not released; keeping its "
                "region and UCX objects alive on purpose",
                len(undrained),
            )
            _leak(s)
            self.leaked = True
        else:
            self._release()
        return undrained

    def _release(self) -> None:
        """Close with no send in flight: cancel our own receives, drop UCX and the region.

        Receives UCX will not confirm ended (a run half-received from a paused peer) keep the
        worker, their staging and scratch alive (leaked); they never touch the region."""
        s = self._s
        cancel = s.lib.cancel
        inbox = [entry for queue in s.inbox.values() for entry in queue]
        receives = [req for req, _ in inbox] + s.drains
        receives += [r.request for r in s.receiving]
        if cancel is not None:
            for req in receives:
                if not req.completed:
                    cancel(req)
        s.worker.progress()
        sends = [(r, keep) for r, keep in s.loose if not r.completed]
        if sends or not all(req.completed for req in receives):
            _leak((s.worker, s.ctx, receives, inbox, s.scratch, list(s.receiving), sends))
        for peer in [*s.peers, *s.retired]:
            peer.ep = None
        for table in (
            s.peers,
            s.retired,
            s.by_instance,
            s.early,
            s.serves,
            s.live,
            s.ghosts,
            s.inbox,
            s.drains,
            s.receiving,
            s.orphans,
            s.loose,
        ):
            table.clear()
        s.scratch = None
        s.worker = None
        s.ctx = None
        s.blocks = np.empty((0, s.block_len), np.uint8)


def _leak(obj: object) -> None:
    """Keep ``obj`` alive for the life of the process (UCX may still touch its memory)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
