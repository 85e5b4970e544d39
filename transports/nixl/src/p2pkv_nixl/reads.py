"""The nixl transport's consumer reads on both lanes: posting them (a direct READ into our
slots, held until the peer is wired; a staged read's request to the producer), checking
their state, and taking the producers' answers (see :mod:`p2pkv_nixl.transport`)."""

from __future__ import annotations

import numpy as np
from p2pkv.contracts import ReadState
from p2pkv.data_base import Indexes
from p2pkv.errors import TransferSubmitError
from p2pkv.runs import count_runs

from p2pkv_nixl import wire
from p2pkv_nixl.finality import Finality
from p2pkv_nixl.peers import PeerTable
from p2pkv_nixl.records import Peer, Read
from p2pkv_nixl.state import NixlState, log

__all__ = ["Reads"]


class Reads:
    """Our reads: ``post`` makes the base's handle (a :class:`~p2pkv_nixl.records.Read`),
    ``state`` checks it, ``answered`` takes a producer's completion or failure of a staged
    one. ``descriptors_posted`` counts the NIXL descriptors of our reads (the transport's
    public counter, see there).

    Called on the driver thread only. Owns ``state.requests`` entries it adds and the pool
    blocks a live staged read holds. ``post`` raises ``TransferSubmitError`` with nothing of
    the read able to land (a failed direct post is ended through :class:`Finality`);
    ``state`` fails a read whose peer disconnected and lets any other NIXL error propagate
    (the base then ends the read)."""

    def __init__(self, state: NixlState, peers: PeerTable, finality: Finality) -> None:
        self._state = state
        self._peers = peers
        self._finality = finality
        self.descriptors_posted = 0

    def post(self, peer: Peer, local: Indexes, remote: Indexes) -> Read:
        """A direct READ into our slots, or a staged read's request to the producer. A staged
        read also takes ``len(local)`` pool blocks, refused (``TransferSubmitError`` naming
        ``staging_blocks``) when too few are free; nothing is posted then.

        A direct read to a peer not ``wired`` yet is *held*, not posted: UCX queues a GET on
        an endpoint still wiring up and executes it once the wire-up completes, and NIXL
        cannot take it back (releasing its handle does not dequeue it), so a read cancelled
        in that window would land later, in slots given to something else. The held read is
        posted by the ``poll`` that first sees the warm-up ``DONE`` (started here if
        ``add_peer`` did not, data option ``warmup``), and fails if the warm-up fails; ending
        it before that is final at once (nothing was posted)."""
        if peer.remote.disconnected:
            raise TransferSubmitError(
                f"peer {peer.peer_id!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT); add it "
                f"again with a fresh descriptor"
            )
        if peer.lane == "staged":
            pool = self._state.pool
            assert pool is not None  # a staged peer made it
            read = Read(peer, local, pool.take(len(local)))
            self._request(read, remote)
        else:
            read = Read(peer, local, None)
            if not peer.wired and peer.warmup is None:
                self._peers.start_warmup(peer)
            if peer.wired:
                self._post_direct(read, remote)
            else:
                read.remote = remote
        return read

    def _request(self, read: Read, remote: Indexes) -> None:
        """Ask the peer to WRITE its blocks ``remote`` into our pool blocks ``read.stage``;
        ``TransferSubmitError`` (pool blocks given back) if NIXL does not send it."""
        state, peer = self._state, read.peer
        pool = state.pool
        assert pool is not None and read.stage is not None
        read.request = next(state.ids)
        message = wire.request_message(
            read.request,
            pool.base,
            pool.capacity,
            pool.slice_blocks,
            state.block_len,
            remote,
            read.stage,
            pool.metadata,
        )
        try:
            state.agent.send_notif(peer.remote.name, message)
        except Exception as exc:
            state.note_failure(peer.remote, exc)
            pool.give_back(read.stage)
            raise TransferSubmitError(
                f"peer {peer.peer_id!r}: NIXL could not send the staged read request "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        state.requests[read.request] = read
        stage = read.stage.astype(np.int64)
        self.descriptors_posted += count_runs(stage, remote, pool.slice_starts, peer.slices)

    def _post_direct(self, read: Read, remote: Indexes) -> None:
        """Make and post the READ into our slots from the prepared lists of both regions
        (ours, and the peer's made by ``add_peer``): NIXL merges the blocks consecutive on
        both sides within one slice into one descriptor, as :func:`p2pkv.runs.count_runs`
        counts them. ``TransferSubmitError`` if NIXL refuses, with nothing of it left able
        to land."""
        state, peer = self._state, read.peer
        agent = state.agent
        try:
            read.handle = agent.make_prepped_xfer(
                "READ",
                state.local,
                read.local.astype(np.int32),
                peer.dlist,
                remote.astype(np.int32),
            )
            self.descriptors_posted += count_runs(read.local, remote, state.slices, peer.slices)
            xfer_state = agent.transfer(read.handle)
        except Exception as exc:
            state.note_failure(peer.remote, exc)
            if read.handle is not None:
                self._finality.end([read])
            raise TransferSubmitError(
                f"peer {peer.peer_id!r}: NIXL could not post the read ({type(exc).__name__}: {exc})"
            ) from exc
        if xfer_state == "ERR":
            self._finality.end([read])
            raise TransferSubmitError(f"peer {peer.peer_id!r}: NIXL failed the read at submit")

    def state(self, read: Read) -> ReadState:
        """A terminal read is released (a staged one copied out of the pool first when it
        succeeded). A disconnect fails it; any other error is the base's (it ends the read)."""
        if read.stage is not None:
            return self._staged_state(read)
        if read.handle is None:
            return self._held_state(read)
        state, peer = self._state, read.peer
        if not peer.remote.disconnected:
            try:
                xfer_state = state.agent.check_xfer_state(read.handle)
            except Exception as exc:
                if not state.note_failure(peer.remote, exc):
                    raise
                xfer_state = "ERR"
            if xfer_state == "PROC":
                return ReadState.PENDING
        else:
            xfer_state = "ERR"
        state.release(read.handle)
        if xfer_state == "DONE" and peer.mark is not None and not peer.mark.holds():
            log.info(
                "nixl: a read from %s failed: the peer closed its region (its open mark "
                "is cleared), so the bytes read may be its caller's again",
                peer.peer_id,
            )
            return ReadState.FAILED
        return ReadState.DONE if xfer_state == "DONE" else ReadState.FAILED

    def _held_state(self, read: Read) -> ReadState:
        """A read held for its peer's wire-up: posted (then checked) once the peer is wired,
        failed once its warm-up ended otherwise or the peer is gone, else pending. A post
        NIXL refuses raises ``TransferSubmitError`` (the base fails the read)."""
        peer = read.peer
        if peer.remote.disconnected or not (peer.wired or peer.warmup is not None):
            log.info("nixl: a read from %s failed: its connection never wired up", peer.peer_id)
            return ReadState.FAILED
        if not peer.wired:
            return ReadState.PENDING
        remote, read.remote = read.remote, None
        assert remote is not None  # held reads keep their peer's indexes
        self._post_direct(read, remote)
        return self.state(read)

    def _staged_state(self, read: Read) -> ReadState:
        """Answered: copied into the slots (if ok); peer gone: failed; else pending."""
        state = self._state
        pool = state.pool
        assert pool is not None and read.stage is not None
        if not read.ended:
            if not read.peer.remote.disconnected:
                return ReadState.PENDING
            state.requests.pop(read.request, None)  # nothing more of it can arrive
        elif read.ok:
            pool.copy_out(read.stage, state.blocks, read.local)
        pool.give_back(read.stage)
        return ReadState.DONE if read.ended and read.ok else ReadState.FAILED

    def answered(self, sender: str, answer: wire.Outcome) -> None:
        """The producer's completion or failure of our staged read: a live one is copied and
        reported by ``poll``, a cancelled one leaves quarantine. Nothing of its WRITE
        arrives after this."""
        if not answer.ok:
            log.warning(
                "nixl: agent %s failed staged read %d: %s", sender, answer.request, answer.reason
            )
        requests = self._state.requests
        read = requests.get(answer.request)
        if read is None or read.peer.remote.name != sender:
            log.debug(
                "nixl: completion of unknown staged read %d from %s ignored", answer.request, sender
            )
            return
        del requests[answer.request]
        read.ended, read.ok = True, answer.ok
