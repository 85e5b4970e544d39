"""The ``ucx`` transport's source side: serving peers' READs with tagged sends from our region.

Those sends are *internal* transfers: nobody above the transport is told, ``remove_peer`` and
``close`` report the ones that do not drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from p2pkv_ucx import tags, wire
from p2pkv_ucx.peers import Peers
from p2pkv_ucx.records import Peer, Serve
from p2pkv_ucx.state import UcxState, log

__all__ = ["Serving"]


class Serving:
    """Serves the READs queued in ``state.pending`` and settles the sends.

    Driver thread only. Owns ``state.serves``, ``state.pending`` and ``state.orphans`` (sends
    given up at their deadline, kept until UCX lets go of them). Never raises: a READ that
    cannot be served is REFUSEd, a send UCX refuses fails its serve (logged).
    """

    def __init__(self, state: UcxState, peers: Peers) -> None:
        self._s, self._peers = state, peers

    def serve_pending(self, *, closing: bool) -> bool:
        """Serve the READs of the notices just handled; True if any send was posted.
        ``closing``: drop them instead (drain what runs, start nothing new)."""
        s = self._s
        if not s.pending:
            return False
        if closing:
            s.pending.clear()
            return False
        pending, s.pending = s.pending, {}
        served = False
        for peer, notice in pending.values():
            if peer in s.peers and not peer.dead:
                served = self._serve(peer, notice) or served
        return served

    def _serve(self, peer: Peer, notice: wire.Read) -> bool:
        """Send each run of a peer's READ from our region (an internal transfer)."""
        s = self._s
        problem = self._read_problem(notice)
        if problem is not None:
            log.warning("ucx: refusing a read of peer %r: %s", peer.peer_id, problem)
            s.send_notice(peer, wire.encode_refuse(s.instance, notice.link, notice.rid, problem))
            return False
        serve = Serve(next(s.transfer_ids), peer, time.monotonic() + s.timeout)
        s.serves[serve.tid] = serve
        peer.serves[serve.tid] = serve
        send, array, tag, blocks = peer.ep.tag_send, s.array, s.tag, s.blocks
        first = tags.data_tag(notice.link, notice.rid, 0)
        try:
            for run, (start, n) in enumerate(
                zip(notice.starts.tolist(), notice.lengths.tolist(), strict=True)
            ):
                serve.requests.append(send(array(blocks[start : start + n]), tag(first | run)))
                s.posted += 1
        except Exception as exc:  # a failed endpoint refuses new sends
            serve.error = f"UCX refused a send ({type(exc).__name__}: {exc})"
            log.info("ucx: serving a read of peer %r: %s", peer.peer_id, serve.error)
        return True

    def _read_problem(self, notice: wire.Read) -> str | None:
        """Why a READ cannot be served (None: it can)."""
        s = self._s
        if notice.link > tags.MAX_LINK or notice.rid >= tags.RID_LIMIT:
            return "link or read id out of range"
        runs = len(notice.lengths)
        if not 0 < runs <= tags.MAX_RUNS:
            return f"{runs} runs (1..{tags.MAX_RUNS} allowed)"
        if int(notice.lengths.min()) < 1 or int(notice.lengths.max()) > s.max_run:
            return f"a run outside 1..{s.max_run} blocks"
        ends = notice.starts + notice.lengths
        if int(ends.max()) > s.num_blocks:
            return f"blocks outside 0..{s.num_blocks - 1}"
        slice_blocks = s.slice_blocks
        if (
            slice_blocks < s.num_blocks
            and (notice.starts // slice_blocks != (ends - 1) // slice_blocks).any()
        ):
            return f"a run crossing a slice boundary (slices of {slice_blocks} blocks)"
        return None

    def settle(self) -> None:
        """Forget finished sends; give up (orphan) those past their deadline."""
        s = self._s
        if not s.serves:
            return
        now = time.monotonic()
        for serve in list(s.serves.values()):
            if serve.settle():
                if serve.error is not None:
                    log.info(
                        "ucx: a send serving peer %r failed: %s", serve.peer.peer_id, serve.error
                    )
                self._forget(serve)
            elif now > serve.deadline:
                log.info(
                    "ucx: a send serving peer %r did not finish in time; kept until UCX "
                    "releases it",
                    serve.peer.peer_id,
                )
                s.orphans.append(serve)
                self._forget(serve)

    def _forget(self, serve: Serve) -> None:
        del self._s.serves[serve.tid]
        del serve.peer.serves[serve.tid]
        self._peers.release_if_done(serve.peer)

    def let_go(self, serves: list[Serve]) -> list[int]:
        """The sends serving a peer just removed: never waited for (the peer may be stopped).
        Those still live get ``drain_timeout`` from now as their deadline (later pumps settle
        them, or orphan them then); returns their ids."""
        self._s.worker.progress()  # notice what completed since the last pump
        deadline = time.monotonic() + self._s.opts.drain_timeout
        left = [serve for serve in serves if not serve.settle()]
        for serve in left:
            serve.deadline = min(serve.deadline, deadline)
        return sorted(serve.tid for serve in left)

    def drain(self, serves: list[Serve], pump: Callable[[], None], seconds: float) -> list[int]:
        """Call ``pump`` until ``serves`` settle or ``seconds`` pass; return the ids still
        live (``close`` only, with a grace within the driver bound)."""
        deadline = time.monotonic() + seconds
        left = [serve for serve in serves if not serve.settle()]
        while left and time.monotonic() < deadline:
            pump()
            left = [serve for serve in left if not serve.settle()]
        return sorted(serve.tid for serve in left)
