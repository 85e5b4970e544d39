"""``PollLog``: every ``DataTransport.poll`` of a test goes through one, which checks the
reporting rules on each call.

Rules checked: each id is reported at most once over the transport's lifetime and never in
both ``done`` and ``failed``; only ids the test submitted are reported; a transfer cancelled
and confirmed stopped (or cancelled ``IMMEDIATE``) is never reported; ``poll(peer_id)``
reports only that peer's transfers.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from p2pkv.contracts import CancelMode, PollResult

__all__ = ["PollLog"]


class PollLog:
    """Bookkeeping of one data transport's transfers, as seen through its ``poll``.

    ``poll_fn`` is the transport's (or peer's) ``poll``; ``cancel_fn`` its ``cancel``.
    """

    def __init__(
        self,
        poll_fn: Callable[[str | None], PollResult],
        cancel_fn: Callable[[Sequence[int], CancelMode], Sequence[int]] | None = None,
        name: str = "transport",
    ) -> None:
        self._poll = poll_fn
        self._cancel = cancel_fn
        self.name = name
        self.peer_of: dict[int, str] = {}
        self.done: set[int] = set()
        self.failed: set[int] = set()
        self.forgotten: set[int] = set()

    def submitted(self, transfer_id: object, peer_id: str) -> int:
        """Record a new id (from ``write_blocks``/``expect_blocks``); checks it is fresh."""
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

    def terminal(self, ids: Iterable[int]) -> bool:
        return all(i in self.done or i in self.failed for i in ids)

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = self._poll(peer_id)
        done, failed = list(result.done), list(result.failed)
        both = set(done) & set(failed)
        assert not both, f"{self.name}: ids {sorted(both)} reported both done and failed"
        for ids in (done, failed):
            assert len(set(ids)) == len(ids), f"{self.name}: an id repeated in one poll: {ids}"
        for tid in done + failed:
            assert tid in self.peer_of, f"{self.name}: poll reported unknown transfer id {tid!r}"
            assert tid not in self.done and tid not in self.failed, (
                f"{self.name}: transfer {tid} reported twice"
            )
            assert tid not in self.forgotten, (
                f"{self.name}: transfer {tid} was cancelled (forgotten) but poll reported it"
            )
            if peer_id is not None:
                assert self.peer_of[tid] == peer_id, (
                    f"{self.name}: poll({peer_id!r}) reported transfer {tid} of peer "
                    f"{self.peer_of[tid]!r}"
                )
        self.done.update(done)
        self.failed.update(failed)
        return PollResult(done, failed)

    def undrained(self, ids: Iterable[int], what: str, peer_id: str | None = None) -> set[int]:
        """Check the ids ``what`` (``remove_peer``/``close``) returned as undrained: each is a
        transfer of ours still pending (of ``peer_id`` when given), or an internal one of the
        transport that no caller received (a connection warm-up); never one already reported
        or forgotten. Returns them as a set."""
        left = set(ids)
        ended = left & (self.done | self.failed | self.forgotten)
        assert not ended, f"{self.name}: {what} returned ids that had ended: {sorted(ended)}"
        if peer_id is not None:
            other = sorted(t for t in left if self.peer_of.get(t, peer_id) != peer_id)
            assert not other, f"{self.name}: {what} returned other peers' ids: {other}"
        return left

    def cancel(self, ids: Sequence[int], mode: CancelMode) -> list[int]:
        """Cancel through the transport and record what it forgot."""
        assert self._cancel is not None, "PollLog built without cancel_fn"
        kept = list(self._cancel(list(ids), mode))
        if mode is CancelMode.IMMEDIATE:
            assert kept == [], f"{self.name}: cancel(IMMEDIATE) must return [], got {kept}"
        unknown = set(kept) - set(ids)
        assert not unknown, f"{self.name}: cancel returned ids it was not given: {unknown}"
        stopped = [i for i in ids if i not in kept and i in self.pending]
        self.forgotten.update(stopped)
        return kept
