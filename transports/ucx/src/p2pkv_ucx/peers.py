"""The ``ucx`` transport's peers: descriptors, endpoints and links, retiring and releasing."""

from __future__ import annotations

from p2pkv.errors import PeerRejected
from p2pkv.runs import region_slice_starts

from p2pkv_ucx import tags, wire
from p2pkv_ucx.reads import Reads
from p2pkv_ucx.records import Peer
from p2pkv_ucx.state import UcxState

__all__ = ["Peers"]


class Peers:
    """Peer records from ``add_peer`` to the release of their endpoint.

    Driver thread only. Owns ``state.peers``, ``state.by_instance`` and ``state.retired``
    (removed peers whose endpoint is still needed: sends serving them, ghosts, receives).
    ``attach`` raises ``PeerRejected``; the rest never raises. A failed endpoint marks its
    peer dead (through ``reads``, which fails its reads).
    """

    def __init__(self, state: UcxState, reads: Reads) -> None:
        self._s, self._reads = state, reads

    def attach(self, peer_id: str, descriptor: bytes) -> Peer:
        """A fresh endpoint and link to the peer (its early notices are the caller's)."""
        s = self._s
        desc = self._check_descriptor(peer_id, descriptor)
        link = next(s.links)
        if link > tags.MAX_LINK:
            raise PeerRejected(f"peer {peer_id!r}: link ids exhausted; recreate the transport")
        api = s.lib.api
        try:
            address = api.UCXAddress.create_from_buffer(desc.address)
            ep = api.UCXEndpoint.create_from_worker_address(
                s.worker, address, s.opts.endpoint_error_handling
            )
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: UCX cannot reach its worker ({type(exc).__name__}: {exc})"
            ) from None
        peer = Peer(
            peer_id,
            desc,
            ep,
            link,
            min(s.max_run, desc.max_run),
            region_slice_starts(desc.num_blocks, desc.slice_blocks),
        )
        s.control_limit = max(s.control_limit, 64 + 12 * desc.num_blocks)
        s.peers.add(peer)
        s.by_instance[desc.instance] = peer
        return peer

    def _check_descriptor(self, peer_id: str, descriptor: bytes) -> wire.Descriptor:
        s = self._s
        try:
            desc = wire.decode_descriptor(descriptor)
        except ValueError as exc:
            raise PeerRejected(f"peer {peer_id!r}: {exc}") from None
        if desc.block_len != s.block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours ({s.block_len})"
            )
        if desc.error_handling != s.opts.endpoint_error_handling:
            raise PeerRejected(
                f"peer {peer_id!r}: endpoint_error_handling is {desc.error_handling} there and "
                f"{s.opts.endpoint_error_handling} here; UCX cannot connect the two modes "
                f"(set the same data option on every peer)"
            )
        return desc

    def forget(self, peer: Peer) -> None:
        """The base removed the peer: no more notices are applied to it nor reads served."""
        s = self._s
        s.peers.discard(peer)
        if s.by_instance.get(peer.desc.instance) is peer:
            del s.by_instance[peer.desc.instance]

    def retire(self, peer: Peer) -> None:
        """Release a forgotten peer's endpoint now if nothing needs it, else keep it retired
        until :meth:`sweep_retired` finds it releasable."""
        if peer.ep is not None:
            if self._releasable(peer):
                self._release(peer)
            else:
                self._s.retired.add(peer)

    def release_if_done(self, peer: Peer) -> None:
        """Release a forgotten peer whose last need just went away."""
        if peer not in self._s.peers and self._releasable(peer):
            self._release(peer)

    def check_endpoints(self) -> None:
        """Mark peers with reads or serves behind a failed endpoint dead."""
        s = self._s
        for peer in s.peers:
            if (peer.live or peer.serves) and not peer.dead and not peer.ep.alive:
                self._reads.mark_dead(peer)

    def sweep_retired(self) -> None:
        """Release removed peers whose endpoints are no longer needed."""
        for peer in [p for p in self._s.retired if self._releasable(p)]:
            self._release(peer)

    def _releasable(self, peer: Peer) -> bool:
        """True when a removed peer's endpoint is no longer needed: none of our sends serve
        it, and none of its runs is still awaited (a ghost), parked or being received."""
        if peer.ep is None:
            return False
        if peer.drains:
            peer.drains = [r for r in peer.drains if not r.completed]
        if not peer.ep.alive:
            self._reads.drop_ghosts(peer)  # nothing more can arrive
        return not (
            peer.serves
            or peer.ghosts
            or peer.drains
            or peer.parked
            or any(r.read.peer is peer and not r.request.completed for r in self._s.receiving)
        )

    def _release(self, peer: Peer) -> None:
        """Drop a removed peer whose sends are all gone (its endpoint closes on release)."""
        self._s.retired.discard(peer)
        peer.ep = None
