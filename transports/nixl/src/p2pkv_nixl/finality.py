"""Finality of the nixl transport's reads: ending them (``cancel``, ``remove_peer``, a failed
check, ``close``) so that nothing of them lands in the slots, and the quarantine of those
that may still be written (see :mod:`p2pkv_nixl.transport`, "Finality")."""

from __future__ import annotations

import time

from p2pkv_nixl.records import Peer, Read
from p2pkv_nixl.state import NixlState, log

__all__ = ["Finality"]


class Finality:
    """Ends reads finally: a direct read's handle is released (or, if NIXL refuses, driven
    to its end up to ``drain_timeout``, then kept aside), a staged one's pool blocks are
    quarantined until its answer arrives or its peer is gone; ``reap`` frees what ended.

    Called on the driver thread only. Owns each record's ``quarantined`` reads and the pool
    blocks they hold; drops ended reads from ``state.requests``. Never raises for a NIXL
    failure: one still running past the deadline is logged as an error and kept."""

    def __init__(self, state: NixlState) -> None:
        self._state = state

    def end(self, reads: list[Read]) -> None:
        """End reads finally, within one ``drain_timeout``: a direct one is stopped, a staged
        one quarantined until its answer arrives (or its peer is gone)."""
        state = self._state
        deadline = time.monotonic() + state.options.drain_timeout
        for read in reads:
            if read.stage is None:
                self._stop_direct(read, deadline)
                continue
            pool = state.pool
            assert pool is not None
            if read.ended or read.peer.remote.disconnected:
                state.requests.pop(read.request, None)  # nothing more of it can arrive
                pool.give_back(read.stage)
            else:
                pool.quarantine(read.stage)
                self._keep(read)

    def _stop_direct(self, read: Read, deadline: float) -> None:
        """Release a direct read's handle (on ``cma`` that stops it). If NIXL refuses, our
        worker is driven until the read ends, up to ``deadline``; one still running then is
        kept aside and may still land (see the module docstring of the transport)."""
        state, peer = self._state, read.peer
        if read.handle is None:
            return  # held, or ended already: nothing of it is posted
        try:
            state.agent.release_xfer_handle(read.handle)
            read.handle = None
            return
        except Exception as exc:
            log.warning(
                "nixl: a cancelled read from %s was not released (%s); driving it to its end",
                peer.peer_id,
                exc,
            )
        while not state.ended(peer, read.handle):
            if time.monotonic() >= deadline:
                log.error(
                    "nixl: a cancelled direct read from %s still runs after %.1fs: its bytes may "
                    "still land in slots %s (lane %s; only staged reads are final on any lane)",
                    peer.peer_id,
                    state.options.drain_timeout,
                    read.local[:16].tolist(),
                    peer.lane,
                )
                self._keep(read)
                return
            state.progress_worker()
        state.release(read.handle)
        read.handle = None

    def _keep(self, read: Read) -> None:
        """Hold an ended read that may still be written until NIXL reports it ended."""
        read.peer.quarantined[next(self._state.ids)] = read

    def reap(self, peer: Peer) -> bool:
        """Release the peer's kept reads NIXL now reports ended and free their pool blocks;
        whether none is left."""
        state = self._state
        for internal_id, read in list(peer.quarantined.items()):
            if read.handle is None:  # staged: answered, or the peer is gone
                if not (read.ended or peer.remote.disconnected):
                    continue
                state.requests.pop(read.request, None)
            elif not state.ended(peer, read.handle):
                continue
            else:
                state.release(read.handle)
            del peer.quarantined[internal_id]
            if read.stage is not None:
                assert state.pool is not None
                state.pool.give_back(read.stage, quarantined=True)
        return not peer.quarantined
