"""The ``ucx`` transport's consumer reads: posting, states, ending, ghosts.

:class:`~p2pkv_ucx.receiving.Receiving` takes their arriving runs; this module decides what a
read is and when it ends.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable

import numpy as np
from p2pkv.contracts import ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import TransferSubmitError
from p2pkv.runs import coalesce

from p2pkv_ucx import tags, wire
from p2pkv_ucx.records import Ghost, Peer, Read
from p2pkv_ucx.state import UcxState, log

__all__ = ["Reads"]

_GHOST_LINGER = 60.0
"""Seconds an ended read's runs are awaited when reads have no deadline (``transfer_timeout``
0); otherwise until the read's own deadline."""


class Reads:
    """Our reads from peers: a READ out, a :class:`~p2pkv_ucx.records.Read` in ``state.live``
    until it ends (done, failed or ended by the base), then possibly a ghost.

    Driver thread only. Owns nothing beyond ``state.live`` and ``state.ghosts`` entries and
    the peers' read counters. ``post`` raises ``TransferSubmitError`` (unreachable peer, too
    many runs, link ids exhausted); nothing else raises: a failure fails the read.
    """

    def __init__(self, state: UcxState) -> None:
        self._s = state

    def post(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        """Send the peer a READ for ``remote`` cut into runs; they land in ``local`` in later
        pumps. ``TransferSubmitError``: the peer is unreachable, or too many runs."""
        s = self._s
        if not peer.dead and peer.unreachable():
            self.mark_dead(peer)
        if peer.dead:
            raise TransferSubmitError(f"peer {peer.peer_id!r} is unreachable (UCX endpoint failed)")
        if len(local) > tags.MAX_RUNS:
            raise TransferSubmitError(f"at most {tags.MAX_RUNS} blocks per read")
        starts, dsts, lengths = coalesce(remote, local, peer.slices, s.slices, peer.max_run)
        link, rid = self._next_rid(peer)
        s.loose.append(s.notify(peer, wire.encode_read(s.instance, link, rid, starts, lengths)))
        read = Read(
            peer,
            time.monotonic() + s.timeout,
            link,
            rid,
            dsts,
            lengths,
            np.zeros(len(lengths), np.bool_),
        )
        s.live[read.key] = read
        peer.live += 1
        return read

    def state(self, read: Read) -> ReadState:
        """A live read past its deadline fails here (finally: its runs go to scratch)."""
        if read.outcome is None and time.monotonic() > read.deadline:
            self.fail(read, "timed out")
        if read.outcome is None:
            return ReadState.PENDING
        return ReadState.DONE if read.outcome else ReadState.FAILED

    def end_reads(self, handles: list[Read], *, closing: bool) -> None:
        """End reads at once, without waiting for UCX: forgotten here, their later runs are
        drained into scratch and runs being received land in staging only. Their producers
        are told to skip what they have not sent (not while ``closing``)."""
        ended = [read for read in handles if not read.ended]
        for read in ended:
            self.end(read, None, coming=not closing)
        if not closing:
            self._tell_cancelled(ended)

    def _next_rid(self, peer: Peer) -> tuple[int, int]:
        """The (link, rid) of a new read from ``peer``; a fresh link before rids wrap."""
        if peer.next_rid >= tags.RID_LIMIT:
            link = next(self._s.links)
            if link > tags.MAX_LINK:
                raise TransferSubmitError("link ids exhausted; recreate the transport")
            peer.link, peer.next_rid = link, 0
        rid = peer.next_rid
        peer.next_rid += 1
        return peer.link, rid

    def end(self, read: Read, outcome: bool | None, *, coming: bool = True) -> None:
        """End a live read (once): its later runs are drained, its runs being received
        land in staging only. ``outcome`` (done / failed) waits for ``poll``; None: ended
        finally by the base, never reported. ``coming``: its producer may still send runs
        (not after a REFUSE, not while closing), so they are awaited as a ghost (drained,
        see ``Ghost``)."""
        if read.ended:
            return
        s = self._s
        read.ended = True
        read.outcome = outcome
        del s.live[read.key]
        peer = read.peer
        peer.live -= 1
        s.staging.release(peer, read.staged)
        read.staged = 0
        left = len(read.taken) - int(np.count_nonzero(read.taken))
        if coming and left and not peer.dead and peer.ep is not None:
            deadline = (
                read.deadline
                if math.isfinite(read.deadline)
                else (time.monotonic() + _GHOST_LINGER)
            )
            ghost = Ghost(peer, read.taken, left, deadline)
            s.ghosts[read.key] = ghost
            peer.ghosts[read.key] = ghost

    def fail(self, read: Read, reason: str, *, coming: bool = True) -> None:
        """Fail a live read (reported by ``poll``) and CANCEL it at its producer."""
        log.info(
            "ucx: read %d:%d from peer %r failed: %s",
            read.link,
            read.rid,
            read.peer.peer_id,
            reason,
        )
        self.end(read, False, coming=coming)
        self._tell_cancelled([read])

    def _tell_cancelled(self, reads: Iterable[Read]) -> None:
        """CANCEL ended reads at their producers (a hint: they skip what they have not sent)."""
        groups: dict[tuple[int, int], list[Read]] = {}
        for read in reads:
            groups.setdefault((id(read.peer), read.link), []).append(read)
        for batch in groups.values():
            peer = batch[0].peer
            if not peer.dead and peer.ep is not None:
                rids = np.array([r.rid for r in batch], np.int64)
                self._s.send_notice(peer, wire.encode_cancel(self._s.instance, batch[0].link, rids))

    def mark_dead(self, peer: Peer) -> None:
        """The peer's endpoint failed: fail its live reads, stop awaiting its runs."""
        peer.dead = True
        if peer.live:
            for read in [r for r in self._s.live.values() if r.peer is peer]:
                self.fail(read, "peer unreachable (UCX endpoint failed)")
        self.drop_ghosts(peer)

    def drop_ghosts(self, peer: Peer) -> None:
        """Stop awaiting a peer's runs (its endpoint failed, or they are overdue)."""
        for key in peer.ghosts:
            del self._s.ghosts[key]
        peer.ghosts.clear()

    def expire_ghosts(self, now: float) -> None:
        """Stop awaiting runs past their read's deadline. Ghosts are kept in order of ending,
        close to deadline order, so the scan stops at the first unexpired one (a ghost may
        outlive its deadline a little, which only keeps an endpoint a little longer)."""
        ghosts = self._s.ghosts
        expired: list[int] = []
        for key, ghost in ghosts.items():
            if ghost.deadline >= now:
                break
            expired.append(key)
        for key in expired:
            ghost = ghosts.pop(key)
            del ghost.peer.ghosts[key]
