"""The nixl transport's peer table: adding peers (their agents, lanes, warm-ups), pinging
them, and releasing detached records once quiescent (see :mod:`p2pkv_nixl.transport`)."""

from __future__ import annotations

import time

from p2pkv.errors import PeerRejected
from p2pkv.runs import per_slice, slice_starts

from p2pkv_nixl import wire
from p2pkv_nixl.agent import block_dlist
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.open_mark import MarkReader
from p2pkv_nixl.records import Lane, Peer, RemoteAgent
from p2pkv_nixl.staging import StagingPool
from p2pkv_nixl.state import WARMUP_BYTES, NixlState, log, quietly

__all__ = ["FORMER_AGENTS", "PING_INTERVAL", "PeerTable"]

FORMER_AGENTS = 64
"""Agents of removed peers kept loaded, so that a staged request of theirs arriving after the
removal (a consumer resumed from a pause, a healed partition) is answered "failed" and its
quarantine ends at once, instead of being ignored and quarantining pool blocks for ever."""
PING_INTERVAL = 0.25
"""Seconds between probes of a peer with staged requests outstanding (see ``probe``)."""


class PeerTable:
    """Peers: attaching a peer (decode, lane, remote agent, staging pool, warm-up), the
    warm-up READs and pings that wire connections up and probe them, and the release of
    detached records once quiescent.

    Called on the driver thread only. Owns ``state.peers``, ``state.agents``,
    ``state.strangers.former``, the creation of ``state.pool`` and each record's warm-up.
    ``attach`` raises ``PeerRejected`` with nothing of the peer left loaded; everything else
    absorbs NIXL failures (a disconnect marks the peer's agent, others are logged)."""

    def __init__(self, state: NixlState) -> None:
        self._state = state
        self._last_probe = 0.0

    def attach(self, peer_id: str, descriptor: bytes) -> Peer:
        """Decode and load the peer (its agent, its region's list), choose its lane, make the
        staging pool if it is the first staged peer, and start its connection warm-up."""
        state = self._state
        desc = RegionDescriptor.decode(descriptor, peer_id)
        if desc.block_len != state.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({state.block_len})"
            )
        if desc.agent == state.agent_name:
            raise PeerRejected(f"peer {peer_id!r}: the descriptor is our own")
        lane = self._lane_for(desc)
        if not self._cma_peer(desc):
            state.serves_remote = True  # its reads of us run on our worker
        if lane == "staged":
            self._ensure_pool(peer_id)
        remote = self._load_agent(peer_id, desc)
        try:
            dlist = state.agent.prep_xfer_dlist(
                desc.agent, block_dlist(desc.base, desc.slices, desc.block_len), "DRAM"
            )
        except Exception as exc:
            self._unload_agent(remote)
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL refused its region ({type(exc).__name__}: {exc})"
            ) from exc
        peer = Peer(
            peer_id, remote, dlist, desc.num_blocks, lane, desc.base, slice_starts(desc.slices)
        )
        if lane == "direct" and desc.mark and self._cma_peer(desc):
            peer.mark = MarkReader(desc.pid, desc.mark, desc.token)
        state.peers.append(peer)
        if state.options.warmup:
            if lane == "staged":
                self.ping(remote, "connection warm-up")
            else:
                self.start_warmup(peer)
        return peer

    def records(self, peer_id: str) -> list[Peer]:
        """Every record of ``peer_id`` not released yet (current or detached)."""
        return [p for p in self._state.peers if p.peer_id == peer_id]

    def _lane_for(self, desc: RegionDescriptor) -> Lane:
        """The ``staging`` option's choice; ``auto``: direct exactly when our own process
        executes the READ (same host and PID namespace, ``cma`` on both sides) and the peer
        has an open mark to check after it (:mod:`p2pkv_nixl.open_mark`)."""
        mode = self._state.options.staging
        if mode != "auto":
            return "staged" if mode == "always" else "direct"
        return "direct" if self._cma_peer(desc) and desc.mark else "staged"

    def _cma_peer(self, desc: RegionDescriptor) -> bool:
        """Whether reads between us and this peer go over UCX ``cma`` (same host and PID
        namespace, ``cma`` on both sides): each side's own process then executes its reads."""
        state = self._state
        return bool(state.host) and desc.host == state.host and state.cma and desc.cma

    def _ensure_pool(self, peer_id: str) -> None:
        state = self._state
        if state.pool is not None:
            return
        options, block_len = state.options, state.block_len
        capacity = min(options.staging_blocks, state.num_blocks)
        try:
            state.pool = StagingPool(
                state.agent, block_len, capacity, per_slice(options.slice_bytes, block_len)
            )
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r} needs staged reads, but NIXL could not register the staging "
                f"pool ({capacity} blocks of {block_len} B, nixl data option "
                f"'staging_blocks'): {type(exc).__name__}: {exc}"
            ) from exc
        log.info(
            "nixl: staging pool of %d blocks (%.1f MiB) registered for staged reads",
            capacity,
            capacity * block_len / 2**20,
        )

    def _load_agent(self, peer_id: str, desc: RegionDescriptor) -> RemoteAgent:
        state = self._state
        remote = state.agents.get(desc.agent)
        if remote is None:
            remote = state.strangers.former.pop(desc.agent, None)
            if remote is not None and remote.metadata == desc.metadata:
                state.agents[desc.agent] = remote  # still loaded: a re-added peer
            elif remote is not None:
                quietly(state.agent.remove_remote_agent, remote.name)
                remote = None
        if remote is None:
            remote = state.agents[desc.agent] = self._new_agent(peer_id, desc)
        elif remote.disconnected:
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL agent {desc.agent} disconnected earlier; a restarted "
                f"peer has a new agent name"
            )
        elif remote.metadata != desc.metadata:
            raise PeerRejected(
                f"peer {peer_id!r}: agent {desc.agent} is already known with other metadata"
            )
        remote.users += 1
        return remote

    def _new_agent(self, peer_id: str, desc: RegionDescriptor) -> RemoteAgent:
        """Load an agent we do not know yet from the descriptor's metadata."""
        state = self._state
        try:
            loaded = state.agent.add_remote_agent(desc.metadata)
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL cannot load its agent metadata (is it alive and "
                f"reachable?): {type(exc).__name__}: {exc}"
            ) from exc
        name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
        if name != desc.agent:
            if name != state.agent_name and name not in state.agents:
                quietly(state.agent.remove_remote_agent, loaded)  # only ours to undo
            raise PeerRejected(
                f"peer {peer_id!r}: its metadata names agent {name!r}, its descriptor "
                f"{desc.agent!r}"
            )
        return RemoteAgent(name, desc.metadata)

    def _unload_agent(self, remote: RemoteAgent) -> None:
        """One user fewer; the last one releases the agent's pool list and moves it to the
        former agents (a disconnected one, or one beyond ``FORMER_AGENTS``, is removed)."""
        state = self._state
        remote.users -= 1
        if remote.users:
            return
        del state.agents[remote.name]
        if remote.pool_dlist is not None:
            quietly(state.agent.release_dlist_handle, remote.pool_dlist)
            remote.pool_dlist = None
        if remote.disconnected:
            quietly(state.agent.remove_remote_agent, remote.name)
            return
        former = state.strangers.former
        former[remote.name] = remote
        while len(former) > FORMER_AGENTS:
            oldest = former.pop(next(iter(former)))
            quietly(state.agent.remove_remote_agent, oldest.name)

    def ping(self, remote: RemoteAgent, why: str) -> None:
        """Send ``remote`` a notification its transport ignores: it wires the connection up
        (a staged peer's warm-up: no READ, so no GET its worker would serve) or probes it
        (NIXL raises ``nixlRemoteDisconnectError`` once UCX failed the endpoint)."""
        try:
            self._state.agent.send_notif(remote.name, wire.PING)
        except Exception as exc:
            if not self._state.note_failure(remote, exc):
                log.debug("nixl: %s of agent %s not sent: %s", why, remote.name, exc)

    def probe(self) -> None:
        """Every ``PING_INTERVAL``, ping each peer our staged requests wait for: a dead one
        is then seen as disconnected (its reads fail, its quarantines end) without a READ."""
        now = time.monotonic()
        if now - self._last_probe < PING_INTERVAL:
            return
        self._last_probe = now
        requests = self._state.requests.values()
        remotes = {id(read.peer.remote): read.peer.remote for read in requests}
        for remote in remotes.values():
            if not remote.disconnected:
                self.ping(remote, "probe")

    def start_warmup(self, peer: Peer) -> None:
        """Post an 8-byte READ from the peer's region into our scratch: it wires the
        connection up while both sides progress, and touches neither region's contents.
        It is released only once NIXL reports it ended; ending ``DONE`` marks the peer
        ``wired``, which direct reads wait for (see :meth:`p2pkv_nixl.reads.Reads.post`)."""
        state = self._state
        agent, length = state.agent, min(WARMUP_BYTES, state.block_len)
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs([(int(state.scratch.ctypes.data), length, 0)], "DRAM"),
                agent.get_xfer_descs([(peer.base, length, 0)], "DRAM"),
                peer.remote.name,
            )
        except Exception as exc:
            log.warning("nixl: connection warm-up to %s not posted: %s", peer.peer_id, exc)
            return
        peer.warmup = handle
        peer.warmup_id = next(state.ids)
        try:
            xfer_state = agent.transfer(handle)
        except Exception as exc:
            self._warmup_ended(peer, exc)
            return
        if xfer_state != "PROC":
            self._warmup_ended(peer, None, xfer_state)

    def check_warmup(self, peer: Peer) -> bool:
        """End the peer's warm-up if NIXL reports it terminal; whether it ended."""
        try:
            xfer_state = self._state.agent.check_xfer_state(peer.warmup)
        except Exception as exc:
            return self._warmup_ended(peer, exc)
        return xfer_state != "PROC" and self._warmup_ended(peer, None, xfer_state)

    def _warmup_ended(self, peer: Peer, exc: BaseException | None, xfer_state: str = "ERR") -> bool:
        """Release an ended warm-up (``DONE``: the peer is ``wired``); False if NIXL refused
        (it is tried again next tick)."""
        if exc is None and xfer_state == "DONE":
            peer.wired = True
        elif exc is None or not self._state.note_failure(peer.remote, exc):
            log.info("nixl: connection warm-up to %s failed: %s", peer.peer_id, exc or xfer_state)
        try:
            self._state.agent.release_xfer_handle(peer.warmup)
        except Exception as release_exc:
            log.warning(
                "nixl: warm-up handle of %s not released yet: %s", peer.peer_id, release_exc
            )
            return False
        peer.warmup = None
        return True

    def retire_idle(self) -> None:
        """Release the detached peer records that are quiescent."""
        state = self._state
        for peer in [p for p in state.peers if not p.current and p.quiescent]:
            state.peers.remove(peer)
            quietly(state.agent.release_dlist_handle, peer.dlist)
            self._unload_agent(peer.remote)
