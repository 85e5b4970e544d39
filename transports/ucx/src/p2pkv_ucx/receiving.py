"""The ``ucx`` transport's receiving side: arriving DATA messages into staging or scratch,
completed runs into the region (see "Why staging" in :mod:`p2pkv_ucx.transport`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from p2pkv_ucx import tags
from p2pkv_ucx.reads import Reads
from p2pkv_ucx.records import OK, Read, Receive
from p2pkv_ucx.staging import Bytes
from p2pkv_ucx.state import UcxState

__all__ = ["BATCH", "Receiving"]

BATCH = 256
"""Messages taken from UCX per kind per pump (the rest wait for the next pump)."""


class Receiving:
    """Takes runs for our live reads and lands them; drains whatever else arrives.

    Driver thread only. Owns ``state.receiving``, ``state.drains``, ``state.scratch`` and
    the staging budget; the only writer of our region (a staged run of a live read, after
    UCX completed its receive without error). Never raises for a peer's message: a wrong
    run fails its read (through ``reads``), an unknown one is drained.
    """

    def __init__(self, state: UcxState, reads: Reads) -> None:
        self._s, self._reads = state, reads

    def take(self) -> None:
        """Take arriving runs while staging has room for the largest one."""
        s = self._s
        probe = s.worker.tag_probe
        tag, mask = s.tag(tags.kind_tag(tags.DATA)), s.mask(tags.KIND_MASK)
        staging = s.staging
        for _ in range(BATCH):
            if not staging.room():
                return
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            self._take_run(found)

    def _take_run(self, found: Any) -> None:
        """Receive one probed DATA message into staging if a live read wants exactly it,
        else drain it into scratch (a wrong length fails the read it names)."""
        s = self._s
        sender = found.sender_tag.value
        read = s.live.get(tags.read_key(sender))
        run = tags.run_of(sender)
        if read is not None and run < len(read.lengths) and not read.taken[run]:
            blocks = int(read.lengths[run])
            nbytes = blocks * s.block_len
            if found.length == nbytes:
                buf = s.staging.take(blocks)
                try:
                    req = s.worker.tag_recv_with_handle(s.array(buf), found)
                except Exception as exc:
                    s.staging.release(nbytes)
                    s.staging.recycle(buf)
                    self._reads.fail(read, f"UCX refused a receive ({type(exc).__name__}: {exc})")
                    return
                s.posted += 1
                read.taken[run] = True
                read.staged += nbytes
                s.receiving.append(Receive(read, run, req, buf))
                return
            self._reads.fail(read, f"run {run} arrived with {found.length} bytes, not {nbytes}")
        req = self._discard(found)
        ghost = s.ghosts.get(tags.read_key(sender))
        if ghost is not None and run < len(ghost.taken) and not ghost.taken[run]:
            ghost.taken[run] = True
            ghost.peer.drains.append(req)
            ghost.left -= 1
            if not ghost.left:
                del s.ghosts[tags.read_key(sender)]
                del ghost.peer.ghosts[tags.read_key(sender)]

    def _discard(self, found: Any) -> Any:
        """Drain a probed message nobody wants into scratch (never the region)."""
        s = self._s
        if s.scratch is None:
            s.scratch = np.empty(s.max_run * s.block_len, np.uint8)
        sink = s.scratch[: max(1, min(found.length, len(s.scratch)))]
        req = s.worker.tag_recv_with_handle(s.array(sink), found)
        s.posted += 1
        s.drains.append(req)
        return req

    def land(self) -> None:
        """Copy runs UCX completed into their slots (live reads only); recycle staging."""
        s = self._s
        if not s.receiving:
            return
        staging, still = s.staging, []
        for r in s.receiving:
            req = r.request
            if not req.completed:
                still.append(r)
                continue
            read = r.read
            if not read.ended:
                staging.release(r.buffer.nbytes)
                read.staged -= r.buffer.nbytes
                if req.status != OK:
                    self._reads.fail(read, f"UCX status {req.status} receiving run {r.run}")
                else:
                    self._copy(read, r.run, r.buffer)
            staging.recycle(r.buffer)
        s.receiving = still

    def _copy(self, read: Read, run: int, buf: Bytes) -> None:
        start, n = int(read.dst[run]), int(read.lengths[run])
        self._s.blocks[start:start + n] = buf.reshape(n, self._s.block_len)
        read.landed += 1
        if read.landed == len(read.lengths):
            self._reads.end(read, True)
