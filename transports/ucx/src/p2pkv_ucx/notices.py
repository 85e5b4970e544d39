"""The ``ucx`` transport's NOTICE inbox: READ, CANCEL and REFUSE messages from peers."""

from __future__ import annotations

from collections import deque

import numpy as np

from p2pkv_ucx import tags, wire
from p2pkv_ucx.reads import Reads
from p2pkv_ucx.receiving import BATCH
from p2pkv_ucx.records import OK
from p2pkv_ucx.state import UcxState, log

__all__ = ["Notices"]

_EARLY_LIMIT = 64
"""Notices kept per not-yet-added sender, and senders kept (older ones are dropped)."""


class Notices:
    """Receives peers' NOTICEs and applies them: a READ is queued in ``state.pending`` for
    :class:`~p2pkv_ucx.serving.Serving`, a CANCEL unqueues, a REFUSE fails our read.

    Driver thread only. Owns ``state.inbox`` and ``state.early`` (notices of senders not
    added yet, bounded). Never raises for a peer's message: a malformed or oversized one is
    logged and dropped.
    """

    def __init__(self, state: UcxState, reads: Reads) -> None:
        self._s, self._reads = state, reads

    def take(self) -> None:
        """Post receives for arriving NOTICEs (one batch)."""
        s = self._s
        probe, recv = s.worker.tag_probe, s.worker.tag_recv_with_handle
        tag, mask = s.tag(tags.kind_tag(tags.NOTICE)), s.mask(tags.KIND_MASK)
        limit = s.control_limit
        for _ in range(BATCH):
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            size = found.length
            buf = np.empty(size if size <= limit else 1, np.uint8)  # too big: truncated, dropped
            sender = tags.sender_of(found.sender_tag.value)
            queue = s.inbox.get(sender)
            if queue is None:
                queue = s.inbox[sender] = deque()
            queue.append((recv(s.array(buf), found), buf))

    def handle(self) -> None:
        """Apply the received NOTICEs, each sender's in order of arrival: one that UCX has not
        finished receiving holds up only its own sender's later ones."""
        inbox = self._s.inbox
        for sender, queue in list(inbox.items()):
            while queue and queue[0][0].completed:
                req, buf = queue.popleft()
                try:
                    if req.status != OK:
                        raise ValueError(f"UCX status {req.status}")
                    self.apply(wire.decode_notice(buf.tobytes()))
                except ValueError as exc:
                    log.warning("ucx: dropped a malformed NOTICE: %s", exc)
            if not queue:
                del inbox[sender]

    def apply(self, notice: wire.Notice) -> None:
        """Apply a peer's NOTICE: queue a READ, drop what a CANCEL names, fail a REFUSEd read."""
        s = self._s
        peer = s.by_instance.get(notice.instance)
        if peer is None:  # its add_peer may still come: keep a few, in order
            if not isinstance(notice, wire.Refuse):
                early = s.early.setdefault(notice.instance, [])
                early.append(notice)
                del early[:-_EARLY_LIMIT]
                while len(s.early) > _EARLY_LIMIT:
                    del s.early[next(iter(s.early))]
            return
        if isinstance(notice, wire.Read):
            s.pending[(notice.instance, notice.link, notice.rid)] = (peer, notice)
        elif isinstance(notice, wire.Cancel):
            for rid in notice.rids.tolist():
                s.pending.pop((notice.instance, notice.link, rid), None)
        elif notice.link <= tags.MAX_LINK and notice.rid < tags.RID_LIMIT:
            read = s.live.get(tags.read_key(tags.data_tag(notice.link, notice.rid, 0)))
            if read is not None and read.peer is peer:
                self._reads.fail(read, f"the peer refused it: {notice.reason}", coming=False)
