"""The producer side of the nixl transport's staged lane: peers' staged read requests served
by a WRITE into their staging pool, refusals, and the failure notifications that end a
consumer's wait (protocol steps 2 and 3 in :mod:`p2pkv_nixl.transport`)."""

from __future__ import annotations

from typing import Any

from p2pkv.runs import slice_counts

from p2pkv_nixl import wire
from p2pkv_nixl.agent import block_dlist
from p2pkv_nixl.records import Peer, RemoteAgent, Serving
from p2pkv_nixl.state import NixlState, log, quietly

__all__ = ["Server"]


class Server:
    """Serves peers' staged reads: ``serve`` checks a request and posts the WRITE carrying
    its completion notification, ``check`` ends the WRITEs NIXL reports terminal.

    Called on the driver thread only, from ``progress``/``poll`` (and the drains of
    ``remove_peer``/``close``). Owns each record's ``serving`` WRITEs (internal transfers)
    and each remote agent's loaded pool metadata and prepared pool list; adds the agents it
    ignores to ``state.strangers.unknown``. Never raises: a request it cannot serve is
    refused with a failure notification when its id could be read, and logged."""

    def __init__(self, state: NixlState) -> None:
        self._state = state

    def serve(self, sender: str, message: bytes) -> None:
        """A peer's staged read request: WRITE our blocks into its pool, the WRITE carrying
        the completion notification. Only a currently added peer is served (its agent is
        loaded; anyone else is ignored, logged once); a malformed or unservable request is
        refused with a failure notification when its id could be read, and logged."""
        state = self._state
        if state.closing:
            return
        peer = self._serving_peer(sender)
        if peer is None:
            self._not_served(sender, message)
            return
        try:
            request = wire.parse_request(message, state.block_len, state.num_blocks)
            handle = self._serving_write(peer.remote, request)
        except wire.Refused as refusal:
            self._refuse(peer, refusal.request, str(refusal))
            return
        except Exception as exc:
            if not state.note_failure(peer.remote, exc):
                self._refuse(peer, None, f"{type(exc).__name__}: {exc}")
            return
        self._start_serving(peer, handle, request.request)

    def _serving_peer(self, sender: str) -> Peer | None:
        for peer in self._state.peers:
            if peer.current and peer.remote.name == sender and not peer.remote.disconnected:
                return peer
        return None

    def _not_served(self, sender: str, message: bytes) -> None:
        """A request from an agent that is not a current peer: refused explicitly when it is
        a former peer's (its consumer's quarantine then ends), else ignored, logged once."""
        strangers = self._state.strangers
        former = strangers.former.get(sender)
        request = wire.request_id(message)
        if former is not None and request is not None:
            self._notify_failed(
                former,
                request,
                "stale request: the peer was removed here (its session ended); nothing was written",
            )
            return
        if sender not in strangers.unknown:
            strangers.unknown.add(sender)
            log.warning(
                "nixl: ignoring staged read requests from agent %s: not a peer added "
                "here (or disconnected)",
                sender,
            )

    def _serving_write(self, remote: RemoteAgent, request: wire.StagedRequest) -> Any:
        """The WRITE serving ``request`` (not posted yet); ``Refused`` with its id if NIXL
        will not make it (a disconnect is raised as is)."""
        state = self._state
        try:
            target = self._remote_pool(remote, request)
            return state.agent.make_prepped_xfer(
                "WRITE",
                state.local,
                request.src,
                target,
                request.stage,
                notif_msg=wire.DONE + wire.ID.pack(request.request),
            )
        except wire.Refused as refusal:
            raise wire.Refused(str(refusal), request.request) from None
        except Exception as exc:
            if isinstance(exc, state.nixl.remote_disconnect):
                raise
            raise wire.Refused(f"{type(exc).__name__}: {exc}", request.request) from exc

    def _start_serving(self, peer: Peer, handle: Any, request: int) -> None:
        """Post a serving WRITE; one still running is an internal transfer of ``peer``."""
        state = self._state
        try:
            xfer_state = state.agent.transfer(handle)
        except Exception as exc:
            state.note_failure(peer.remote, exc)
            xfer_state = "ERR"
            log.warning(
                "nixl: WRITE serving %s's staged read %d not posted: %s", peer.peer_id, request, exc
            )
        if xfer_state == "PROC":
            peer.serving[next(state.ids)] = Serving(handle, request)
        else:
            self._served(peer, handle, request, xfer_state == "DONE")

    def _remote_pool(self, remote: RemoteAgent, request: wire.StagedRequest) -> Any:
        """The peer's staging pool as a prepared remote list (one row per slice of it), its
        metadata loaded first (once per loaded agent: a re-added agent loads it again)."""
        state = self._state
        agent, metadata = state.agent, request.metadata
        if remote.pool_md != metadata:
            loaded = agent.add_remote_agent(metadata)
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != remote.name:
                if name != state.agent_name and name not in state.agents:
                    quietly(agent.remove_remote_agent, name)
                raise wire.Refused(f"its pool metadata names agent {name!r}")
            remote.pool_md = metadata
        key = (request.base, request.capacity, request.slice_blocks)
        if remote.pool_key != key or remote.pool_dlist is None:
            slices = slice_counts(request.capacity, request.slice_blocks)
            dlist = agent.prep_xfer_dlist(
                remote.name, block_dlist(request.base, slices, state.block_len), "DRAM"
            )
            if remote.pool_dlist is not None:
                quietly(agent.release_dlist_handle, remote.pool_dlist)
            remote.pool_dlist, remote.pool_key = dlist, key
        return remote.pool_dlist

    def _refuse(self, peer: Peer, request: int | None, reason: str) -> None:
        log.warning(
            "nixl: refused staged read request %s of peer %s: %s", request, peer.peer_id, reason
        )
        if request is not None:
            self._notify_failed(peer.remote, request, reason)

    def _notify_failed(self, remote: RemoteAgent, request: int, reason: str) -> None:
        try:
            self._state.agent.send_notif(
                remote.name, wire.FAILED + wire.ID.pack(request) + reason.encode()[:512]
            )
        except Exception as exc:  # a dead or unreachable peer needs no answer
            log.debug("nixl: failure notification to %s not sent: %s", remote.name, exc)

    def check(self, peer: Peer) -> bool:
        """End the peer's serving WRITEs NIXL reports terminal (a failed one is answered with
        a failure notification; a done one carried its completion). Whether all ended."""
        state = self._state
        for internal_id, serving in list(peer.serving.items()):
            try:
                xfer_state = state.agent.check_xfer_state(serving.handle)
            except Exception as exc:
                if not state.note_failure(peer.remote, exc):
                    continue  # proves nothing; checked again next tick
                xfer_state = "ERR"
            if xfer_state != "PROC":
                del peer.serving[internal_id]
                self._served(peer, serving.handle, serving.request, xfer_state == "DONE")
        return not peer.serving

    def _served(self, peer: Peer, handle: Any, request: int, ok: bool) -> None:
        self._state.release(handle)
        if not ok:
            log.warning(
                "nixl: the WRITE serving staged read %d of peer %s failed", request, peer.peer_id
            )
            if not peer.remote.disconnected:
                self._notify_failed(peer.remote, request, "the WRITE failed")
