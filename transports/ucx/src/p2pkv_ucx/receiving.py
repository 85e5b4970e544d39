"""The ``ucx`` transport's receiving side: arriving DATA messages into staging or scratch,
completed runs into the region (see "Why staging" in :mod:`p2pkv_ucx.transport`).

A run of a live read is received into staging only within its peer's share of the staging
budget (:mod:`p2pkv_ucx.staging`); beyond it the run is *parked*: its probe handle is kept
on the peer's record, in order, and received as soon as that peer's share has room (a
rendezvous run moves no payload until then). A peer frozen with runs half received therefore
holds at most its share, and the other peers' runs keep landing.
"""

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

    Driver thread only. Owns ``state.receiving``, ``state.drains``, ``state.scratch``, the
    staging budget and the peers' parked runs; the only writer of our region (a staged run
    of a live read, after UCX completed its receive without error). Never raises for a peer's
    message: a wrong run fails its read (through ``reads``), an unknown one is drained.
    """

    def __init__(self, state: UcxState, reads: Reads) -> None:
        self._s, self._reads = state, reads

    def take(self) -> None:
        """Take parked runs whose peer's share has room, then arriving runs while staging
        has room for the largest one."""
        s = self._s
        staging = s.staging
        if staging.waiting:
            self._take_parked()
        probe = s.worker.tag_probe
        tag, mask = s.tag(tags.kind_tag(tags.DATA)), s.mask(tags.KIND_MASK)
        for _ in range(BATCH):
            if not staging.room():
                return
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            self._take_run(found)

    def _take_run(self, found: Any) -> None:
        """A probed DATA message: received into staging if a live read wants exactly it and
        its peer's share has room, parked if the share is full, else drained into scratch
        (a wrong length fails the read it names)."""
        read, run = self._wanted(found)
        if read is None:
            self._drain(found)
            return
        peer = read.peer
        if peer.parked or not self._s.staging.admits(peer, found.length):
            peer.parked.append(found)
            self._s.staging.wait(peer, True)
            return
        self._receive(read, run, found)

    def _wanted(self, found: Any) -> tuple[Read | None, int]:
        """The live read a probed message is a run of, and which run, when the read wants
        exactly it (not taken before, of the run's length); else None (a wrong length fails
        the read)."""
        s = self._s
        sender = found.sender_tag.value
        read = s.live.get(tags.read_key(sender))
        run = tags.run_of(sender)
        if read is None or run >= len(read.lengths) or read.taken[run]:
            return None, run
        nbytes = int(read.lengths[run]) * s.block_len
        if found.length != nbytes:
            self._reads.fail(read, f"run {run} arrived with {found.length} bytes, not {nbytes}")
            return None, run
        return read, run

    def _receive(self, read: Read, run: int, found: Any) -> None:
        """Receive run ``run`` of ``read`` into a staging buffer of its peer's share."""
        s = self._s
        blocks = int(read.lengths[run])
        nbytes = blocks * s.block_len
        buf = s.staging.take(read.peer, blocks)
        try:
            req = s.worker.tag_recv_with_handle(s.array(buf), found)
        except Exception as exc:
            s.staging.release(read.peer, nbytes)
            s.staging.recycle(buf)
            self._reads.fail(read, f"UCX refused a receive ({type(exc).__name__}: {exc})")
            return
        s.posted += 1
        read.taken[run] = True
        read.staged += nbytes
        s.receiving.append(Receive(read, run, req, buf))

    def _take_parked(self) -> None:
        """Receive parked runs, each peer's in order, while its share has room; drain those
        whose read ended meanwhile."""
        staging = self._s.staging
        for peer in staging.waiting:
            parked = peer.parked
            while parked:
                read, run = self._wanted(parked[0])
                if read is not None and not staging.admits(peer, parked[0].length):
                    break
                found = parked.popleft()
                if read is None:
                    self._drain(found)
                else:
                    self._receive(read, run, found)
            if not parked:
                staging.wait(peer, False)

    def drop_parked(self) -> None:
        """Drain every parked run into scratch (the transport is closing)."""
        staging = self._s.staging
        for peer in staging.waiting:
            while peer.parked:
                self._drain(peer.parked.popleft())
            staging.wait(peer, False)

    def _drain(self, found: Any) -> None:
        """Drain a probed message no live read wants into scratch (never the region); one of
        an ended read's runs counts toward its ghost."""
        s = self._s
        req = self._discard(found)
        sender = found.sender_tag.value
        key, run = tags.read_key(sender), tags.run_of(sender)
        ghost = s.ghosts.get(key)
        if ghost is not None and run < len(ghost.taken) and not ghost.taken[run]:
            ghost.taken[run] = True
            ghost.peer.drains.append(req)
            ghost.left -= 1
            if not ghost.left:
                del s.ghosts[key]
                del ghost.peer.ghosts[key]

    def _discard(self, found: Any) -> Any:
        """Receive a probed message nobody wants into scratch; returns the request."""
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
                staging.release(read.peer, r.buffer.nbytes)
                read.staged -= r.buffer.nbytes
                if req.status != OK:
                    self._reads.fail(read, f"UCX status {req.status} receiving run {r.run}")
                else:
                    self._copy(read, r.run, r.buffer)
            staging.recycle(r.buffer)
        s.receiving = still

    def _copy(self, read: Read, run: int, buf: Bytes) -> None:
        start, n = int(read.dst[run]), int(read.lengths[run])
        self._s.blocks[start : start + n] = buf.reshape(n, self._s.block_len)
        read.landed += 1
        if read.landed == len(read.lengths):
            self._reads.end(read, True)
