"""``PollLog``: every ``DataTransport.poll`` of a test goes through one, which checks the
reporting rules on each call.

Rules checked: each id is reported at most once over the transport's lifetime and never in
both ``done`` and ``failed``; only ids the test submitted (reads) are reported, never a
transport's internal transfer; a read that was ended (``cancel``, ``remove_peer`` of its peer,
re-adding its peer, ``close``) is never reported; ``poll(peer_id)`` reports only that peer's
reads; ``cancel`` returns nothing (it is final); ``remove_peer`` and ``close`` return only
internal ids, never a read's, never one already reported.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from p2pkv.contracts import PollResult

__all__ = ["PollLog"]


class PollLog:
    """Bookkeeping of one data transport's reads, as seen through its ``poll``.

    ``poll_fn`` is the transport's (or peer's) ``poll``; ``cancel_fn`` its ``cancel``;
    ``check_done(tid)``, when given, runs for every id the moment a poll reports it done (the
    bytes must be in place then, not one call later).
    """

    def __init__(
        self,
        poll_fn: Callable[[str | None], PollResult],
        cancel_fn: Callable[[Sequence[int]], object] | None = None,
        name: str = "transport",
        check_done: Callable[[int], None] | None = None,
    ) -> None:
        self._poll = poll_fn
        self._cancel = cancel_fn
        self._check_done = check_done
        self.name = name
        self.peer_of: dict[int, str] = {}
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self.forgotten: set[int] = set()
        """Reads that were ended before being reported: never reported afterwards."""

    def submitted(self, transfer_id: object, peer_id: str) -> int:
        """Record a new read id (from ``read_blocks``); checks it is a fresh int."""
        assert isinstance(transfer_id, int) and not isinstance(transfer_id, bool), (
            f"{self.name}: transfer id must be an int, got {transfer_id!r}"
        )
        assert transfer_id not in self.peer_of, (
            f"{self.name}: transfer id {transfer_id} was issued twice"
        )
        self.peer_of[transfer_id] = peer_id
        return transfer_id

    @property
    def pending(self) -> set[int]:
        return set(self.peer_of) - self.done - self.failed - self.forgotten

    def pending_of(self, peer_id: str) -> set[int]:
        return {t for t in self.pending if self.peer_of[t] == peer_id}

    def terminal(self, ids: Iterable[int]) -> bool:
        return all(i in self.done or i in self.failed for i in ids)

    def poll(self, peer_id: str | None = None) -> PollResult:
        """Poll through the transport and check the result against every rule."""
        result = self._poll(peer_id)
        done, failed = list(result.done), list(result.failed)
        both = set(done) & set(failed)
        assert not both, f"{self.name}: ids {sorted(both)} reported both done and failed"
        for ids in (done, failed):
            assert len(set(ids)) == len(ids), f"{self.name}: an id repeated in one poll: {ids}"
        for tid in done + failed:
            self._check_reportable(tid, peer_id)
        self.done.update(done)
        self.failed.update(failed)
        if self._check_done is not None:
            for tid in done:
                self._check_done(tid)
        return PollResult(done, failed)

    def _check_reportable(self, tid: int, peer_id: str | None) -> None:
        assert tid in self.peer_of, (
            f"{self.name}: poll reported transfer id {tid!r}, which is no read of ours "
            f"(unknown, or an internal transfer: poll reports reads only)"
        )
        assert tid not in self.done and tid not in self.failed, (
            f"{self.name}: transfer {tid} reported twice"
        )
        assert tid not in self.forgotten, (
            f"{self.name}: read {tid} was ended (cancel, remove_peer, re-add or close) but "
            f"poll reported it"
        )
        if peer_id is not None:
            assert self.peer_of[tid] == peer_id, (
                f"{self.name}: poll({peer_id!r}) reported transfer {tid} of peer "
                f"{self.peer_of[tid]!r}"
            )

    def undrained(self, ids: Iterable[int], what: str, peer_id: str | None = None) -> set[int]:
        """Check the ids ``what`` (``remove_peer``/``close``) returned as undrained: each is an
        internal transfer of the transport (no caller received it), never a read of ours (reads
        end finally, they are never left in flight) and so never one reported or ended.
        Returns them as a set."""
        left = set(ids)
        reads = sorted(left & set(self.peer_of))
        scope = "" if peer_id is None else f" of peer {peer_id!r}"
        assert not reads, (
            f"{self.name}: {what}{scope} returned read ids {reads}; it must end reads finally "
            f"and return only the transport's internal transfers"
        )
        return left

    def ended(self, ids: Iterable[int]) -> None:
        """Record that the reads ``ids`` were ended: those still pending are never reported."""
        self.forgotten.update(set(ids) & self.pending)

    def ended_peer(self, peer_id: str) -> set[int]:
        """``remove_peer``/re-add of ``peer_id``: its pending reads end. Returns them."""
        gone = self.pending_of(peer_id)
        self.forgotten.update(gone)
        return gone

    def ended_all(self) -> set[int]:
        """``close``: every pending read ends. Returns them."""
        gone = self.pending
        self.forgotten.update(gone)
        return gone

    def cancel(self, ids: Sequence[int]) -> None:
        """Cancel through the transport (final: returns nothing) and record the ended reads."""
        assert self._cancel is not None, "PollLog built without cancel_fn"
        returned = self._cancel(list(ids))
        assert returned is None, (
            f"{self.name}: cancel returned {returned!r}; cancel is final and returns None "
            f"(there is no 'could not stop' list any more)"
        )
        self.ended(ids)
