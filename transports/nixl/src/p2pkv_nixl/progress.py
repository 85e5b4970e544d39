"""The nixl transport's tick: what every ``progress``/``poll`` (and every drain) does."""

from __future__ import annotations

from p2pkv_nixl import wire
from p2pkv_nixl.finality import Finality
from p2pkv_nixl.peers import PeerTable
from p2pkv_nixl.reads import Reads
from p2pkv_nixl.serving import Server
from p2pkv_nixl.state import NixlState
from p2pkv_nixl.teardown import drain_leaked

__all__ = ["Ticker"]


class Ticker:
    """Drives NIXL's worker and routes what it brings to the roles: peers' staged requests
    to the :class:`~p2pkv_nixl.serving.Server`, the answers to ours to
    :class:`~p2pkv_nixl.reads.Reads`; then lets each role end what ended.

    Called on the driver thread only (a leaked transport's: on the thread that closed it).
    Owns nothing; never raises for a NIXL failure (each role absorbs its own)."""

    def __init__(
        self, state: NixlState, peers: PeerTable, reads: Reads, server: Server, finality: Finality
    ) -> None:
        self._state = state
        self._peers = peers
        self._reads = reads
        self._server = server
        self._finality = finality

    def tick(self) -> None:
        """Drive NIXL's worker: ``get_new_notifs`` is the cheapest call that progresses it (a
        few microseconds), and it returns the notifications of staged reads: peers' requests
        (served here with a WRITE) and the answers to ours (a live read is then copied by
        ``poll``). Then end warm-ups, serving WRITEs and quarantines that ended, release
        detached records left idle, and probe peers our requests wait for.

        An open transport also takes one drain step for each transport that a ``close`` on
        this same thread left undrained (NIXL calls stay on the thread that used the agent):
        what it still runs may need a peer in this process, and a peer that keeps polling ends
        it, so the leaked transport is then released after all, and its peers see it go."""
        state = self._state
        if not state.closing:
            drain_leaked()
        notifications = state.progress_worker()
        if notifications:
            self._notified(notifications)
        ended = False
        for peer in state.peers:
            if peer.warmup is not None:
                ended = self._peers.check_warmup(peer) or ended
            if peer.serving:
                ended = self._server.check(peer) or ended
            if peer.quarantined:
                ended = self._finality.reap(peer) or ended
        if ended:
            self._peers.retire_idle()
        if state.requests:
            self._peers.probe()

    def _notified(self, notifications: dict[str, list[bytes]]) -> None:
        """Dispatch notifications by prefix: requests to the server, answers to our reads;
        anything else (pings, foreign ones) is ignored."""
        for sender, messages in notifications.items():
            name = sender.decode() if isinstance(sender, bytes) else str(sender)
            for raw in messages:
                message = bytes(raw)
                if message.startswith(wire.REQUEST):
                    self._server.serve(name, message)
                    continue
                answer = wire.outcome(message)
                if answer is not None:
                    self._reads.answered(name, answer)
