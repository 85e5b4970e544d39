"""Producer writes given up at a closed session's drain deadline but still live in the data
transport (docs/protocol.md §4.4, §5.1).

A one-sided write cannot be recalled, and releasing its handle does not stop the bytes. So a
write of a closed session that did not drain within ``timeouts.shutdown_drain`` is not
cancelled: its store jobs get their results (the session is over), and its id moves here,
under the peer address it writes to. The tier keeps polling those peers (``poll(peer)``,
only peers with a retiring write) and reports every terminal id with :meth:`ended`. While a
peer has retiring writes, no ``quiesced`` is sent to it and its data peer is not removed.

A peer's writes are waited for until ``timeouts.fence`` after the latest give-up for that
peer; then (the consumer's fences lift at about the same time) the rest is forgotten with one
warning. Either way ``on_quiet(peer, drained)`` is called once the peer has nothing retiring
(``drained``: every write ended).

Re-adding the peer (a new session after reconnect) is safe while writes retire: every data
transport keeps the transfers of a replaced registration pollable under the same peer id
(``DataTransport.add_peer``), so ids are kept by transfer id and found by ``poll(peer)``.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, KeysView, Sequence

from p2pkv.config import Timeouts
from p2pkv.session.deadlines import Deadlines, Timer

__all__ = ["RetiringWrites"]

log = logging.getLogger(__name__)


class RetiringWrites:
    """Given-up writes per peer address (see the module docstring)."""

    def __init__(self, deadlines: Deadlines, clock: Callable[[], float], timeouts: Timeouts,
                 on_quiet: Callable[[str, bool], None]) -> None:
        self._deadlines = deadlines
        self._clock = clock
        self._timeouts = timeouts
        self._on_quiet = on_quiet
        self._by_peer: dict[str, set[int]] = {}
        self._peer_of: dict[int, str] = {}
        self._timers: dict[str, Timer] = {}
        """Per peer with retiring writes: when we stop waiting for them."""

    def add(self, peer: str, transfer_ids: Sequence[int]) -> None:
        """``transfer_ids`` (writes to ``peer``) were given up and are still live."""
        if not transfer_ids:
            return
        self._by_peer.setdefault(peer, set()).update(transfer_ids)
        self._peer_of.update(dict.fromkeys(transfer_ids, peer))
        self._deadlines.cancel(self._timers.pop(peer, None))
        self._timers[peer] = self._deadlines.at(
            self._clock() + self._timeouts.fence, self._expired, peer
        )

    def ended(self, transfer_id: int) -> None:
        """The data transport reported ``transfer_id`` terminal (unknown ids are ignored)."""
        peer = self._peer_of.pop(transfer_id, None)
        if peer is None:
            return
        tids = self._by_peer[peer]
        tids.discard(transfer_id)
        if not tids:
            log.info("every write to %s given up at a drain deadline has ended", peer)
            self._forget(peer)
            self._on_quiet(peer, True)

    def _expired(self, peer: str) -> None:
        del self._timers[peer]
        log.warning("%d write(s) to %s given up at a drain deadline are still live after "
                    "%.0fs; no longer waiting for them (the consumer's fences lift too); the "
                    "data peer stays registered under them",
                    len(self._by_peer[peer]), peer, self._timeouts.fence)
        self._forget(peer)
        self._on_quiet(peer, False)

    def _forget(self, peer: str) -> None:
        for tid in self._by_peer.pop(peer):
            self._peer_of.pop(tid, None)
        self._deadlines.cancel(self._timers.pop(peer, None))

    def clear(self) -> dict[str, list[int]]:
        """Forget everything (shutdown); returns the ids still live, by peer."""
        live = {peer: sorted(tids) for peer, tids in self._by_peer.items()}
        for peer in list(self._by_peer):
            self._forget(peer)
        return live

    def peers(self) -> KeysView[str]:
        """Peers with a retiring write (the ones to poll)."""
        return self._by_peer.keys()

    def live(self, peer: str) -> bool:
        return peer in self._by_peer

    def __len__(self) -> int:
        return len(self._peer_of)

    def state_sizes(self) -> dict[str, int]:
        return {"gave_up_peers": len(self._by_peer)}
