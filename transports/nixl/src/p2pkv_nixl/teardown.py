"""Teardown of the nixl transport: letting a removed peer go, the drain of ``close``, the
release of everything registered, and the transports a ``close`` left undrained (leaked) or
whose agent it could not destroy (retained); see :mod:`p2pkv_nixl.transport`."""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from p2pkv.contracts import DRAIN_GRACE

from p2pkv_nixl.peers import PeerTable
from p2pkv_nixl.records import Peer
from p2pkv_nixl.state import NixlState, log, quietly

__all__ = ["Teardown", "drain_leaked"]

_LEAKED: list[Teardown] = []
"""Teardowns whose ``close`` could not drain: kept alive until they drain (see
:func:`drain_leaked`), else for the process lifetime."""

_RETAINED: list[tuple[Any, ...]] = []
"""Agents a clean ``close`` did not destroy because a remote peer may still be reading from
us through our own UCX worker (see :meth:`Teardown.shutdown`): each with the buffers it was
registered over, kept for the process lifetime and never progressed again."""


def drain_leaked() -> None:
    """One drain step of every transport that a ``close`` on this thread left undrained (NIXL
    calls stay on the thread that used the agent); called by each open transport's tick."""
    if not _LEAKED:
        return
    thread = threading.get_ident()
    for leaked in list(_LEAKED):
        if leaked.closing_thread == thread:
            leaked.drain_step()


class Teardown:
    """Drains and releases: ``detach`` lets a removed peer's records go (released by a later
    tick once quiescent), ``shutdown`` drains everything and releases it (or leaves the
    transport leaked, drained further by :func:`drain_leaked`), deciding whether the agent may
    be destroyed or is retained.

    Called on the driver thread only (a leaked one: on the thread that closed it). ``step``
    is the transport's tick (:class:`~p2pkv_nixl.progress.Ticker`), driven while draining.
    Owns ``state.zombies`` retries and the release of ``state``'s agent, lists and memory
    (dropped from ``state`` once released). Never raises: NIXL cleanup failures are logged,
    and what does not drain within the grace is returned as internal transfer ids."""

    def __init__(self, state: NixlState, peers: PeerTable, step: Callable[[], None]) -> None:
        self._state = state
        self._peers = peers
        self._step = step
        self.closing_thread = 0
        """``threading.get_ident()`` of the ``close`` that left this transport undrained."""

    @property
    def leaked(self) -> bool:
        """Whether a ``close`` left this transport undrained and it is not released yet."""
        return self in _LEAKED

    def detach(self, peer: Peer) -> list[int]:
        """A removed peer: return the warm-ups and serving WRITEs of every record of it
        still running, without waiting for them (the peer may be stopped: see the driver
        bound, :data:`p2pkv.contracts.DRIVER_BOUND`). Its records stay until they are
        quiescent, released by a later tick. A replaced one (the base attached its new record
        first) reports nothing: it goes once quiescent too."""
        peer.current = False
        records = self._peers.records(peer.peer_id)
        undrained = (
            []
            if any(p.current for p in records)
            else sorted(i for p in records for i in p.running(False))
        )
        self._peers.retire_idle()
        return undrained

    def _drain(self, peers: Iterable[Peer], quarantine: bool) -> list[int]:
        """Progress until the warm-ups and serving WRITEs (and, with ``quarantine``, the kept
        reads) of ``peers`` ended, for ``DRAIN_GRACE`` at most (``drain_timeout`` if
        shorter). Returns the ids still running."""
        peers = list(peers)
        grace = min(self._state.options.drain_timeout, DRAIN_GRACE)

        def running() -> list[int]:
            return sorted(i for p in peers for i in p.running(quarantine))

        deadline = time.monotonic() + grace
        while running() and time.monotonic() < deadline:
            self._step()
        undrained = running()
        if undrained:
            log.warning(
                "nixl: %d internal transfer(s) still running after the %.2fs close grace "
                "(%s); their memory stays registered until they end",
                len(undrained),
                grace,
                undrained,
            )
        return undrained

    def shutdown(self) -> list[int]:
        """Drain every record (warm-ups, serving WRITEs, kept reads) for ``DRAIN_GRACE`` at
        most (never waiting for a stopped peer longer),
        then release everything, unless something still runs: then the transport is leaked
        (everything stays registered, see the transport's module docstring) and those ids
        returned.

        Only cancelled staged reads left unanswered can land in the pool alone, never in the
        region: the pool (and the agent) are then kept for good and the rest is released.

        A clean close releases the peers, descriptor lists and memory registrations, and then
        destroys the agent (with its UCX worker) only if no peer can be reading from us through
        that worker. Over a lane other than ``cma`` (tcp) a peer's transfers with us are UCX
        software emulation: a warm-up READ's GET requests, or the WRITEs it serves our staged
        reads with, are handled by *our* worker, which sends the replies (GET data, PUT
        acknowledgements) as internal requests. NIXL exposes nothing about those (no count,
        no way to flush or cancel them), and a peer's cancelled reads keep running on the
        wire, so at any moment some may be queued on our endpoints; destroying the worker then
        frees them under UCX (``... was not returned to mpool ucp_requests``, then a SIGSEGV
        in ``close``). So when a peer might read us that way (our UCX has no ``cma``, or a
        peer not reachable over ``cma`` was ever added), the agent is *retained*, logged: it
        and the buffers it was registered over (region, scratch, pool) are kept alive for the
        process lifetime (:data:`_RETAINED`, with an extra reference so not even interpreter
        shutdown frees them) and it is never progressed again, so no UCX code runs for it
        and nothing it serves can touch freed memory. Its peers then see its endpoints go
        silent rather than disconnect, until this process exits (the kernel closes its
        sockets; they fail their reads by heartbeat or lease before that). With only ``cma``
        peers, each reader's own process executes its reads and the agent is destroyed, so
        its peers see a disconnect. A reader that read us over tcp but was never added here
        is not seen; in p2pkv both sides add each other."""
        state = self._state
        state.mark.clear()  # from now on, no peer's read of our region completes
        state.closing = True
        for peer in state.peers:
            peer.current = False  # the base has ended every read
        undrained = self._drain(state.peers, quarantine=True)
        kept = {q for p in state.peers for q in p.quarantined}
        if undrained and not state.zombies and set(undrained) <= kept:
            log.info(
                "nixl: %d cancelled staged read(s) still unanswered at close; their "
                "staging pool is kept, with the agent, until the process exits",
                len(undrained),
            )
            state.serves_remote = True
            self._release_everything()
            return []
        left = self._release_if_drained()
        if left:
            self.closing_thread = threading.get_ident()
            _LEAKED.append(self)
        return left

    def _release_if_drained(self) -> list[int]:
        """Retry the handles NIXL refused to release; then, if nothing runs any more, release
        everything. Returns the internal ids still running (or kept) otherwise."""
        state = self._state
        for zombie, handle in list(state.zombies.items()):
            try:
                state.agent.release_xfer_handle(handle)
            except Exception:
                continue
            del state.zombies[zombie]
        left = sorted({*(i for p in state.peers for i in p.running(True)), *state.zombies})
        if not left:
            self._release_everything()
        return left

    def drain_step(self) -> None:
        """One non-blocking drain pass of a leaked transport; releases it once nothing runs."""
        self._step()
        self._release_if_drained()

    def _release_everything(self) -> None:
        """Peers, descriptor lists, then memory (pool, scratch, region); drop the agent."""
        self._peers.retire_idle()
        state = self._state
        agent = state.agent
        for former in state.strangers.former.values():
            quietly(agent.remove_remote_agent, former.name)
        state.strangers.former.clear()
        quietly(agent.release_dlist_handle, state.local)
        if state.pool is not None:
            quietly(agent.release_dlist_handle, state.pool.dlist)
            quietly(agent.deregister_memory, state.pool.registration)
        for registration in reversed(state.memory):
            quietly(agent.deregister_memory, registration)
        state.memory.clear()
        if self in _LEAKED:
            _LEAKED.remove(self)
        if state.serves_remote:
            self._retain()
        # Every NIXL handle object holds the agent: with the last one gone, the agent and its
        # UCX worker are destroyed, so peers see a disconnect instead of a silent endpoint;
        # and the region is its caller's again.
        del agent, state.agent, state.local, state.scratch, state.blocks
        state.pool = None

    def _retain(self) -> None:
        """Keep the agent and every buffer it was registered over alive for the process
        lifetime, never progressed again (see :meth:`shutdown`)."""
        state = self._state
        kept = (state.agent, state.local, state.blocks, state.scratch, state.pool)
        _RETAINED.append(kept)
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(kept))  # survives interpreter shutdown
        log.info(
            "nixl: agent %s closed but not destroyed: a peer may still be reading from us over "
            "a lane other than cma, served by this agent's UCX worker, and destroying it then "
            "crashes UCX; it is kept, idle, until the process exits (%d kept)",
            state.agent_name,
            len(_RETAINED),
        )
