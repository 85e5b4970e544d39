"""The state every role of the nixl transport shares, and the NIXL calls they all make.

:class:`NixlState` is the one owner of the transport's shared state: the agent and what is
registered with it, the peer records, the staged requests outstanding, the staging pool.
The role classes (:mod:`p2pkv_nixl.peers`, :mod:`p2pkv_nixl.reads`,
:mod:`p2pkv_nixl.serving`, :mod:`p2pkv_nixl.finality`, :mod:`p2pkv_nixl.teardown`) each
receive it and change only the parts their docstrings name; none holds a reference to the
agent or to a buffer of its own, so that dropping them here (a clean ``close``) frees them.
"""

from __future__ import annotations

import itertools
import logging
import os
from typing import Any

import numpy as np
import numpy.typing as npt
from p2pkv.logs import module_logger
from p2pkv.runs import slice_starts

from p2pkv_nixl import library
from p2pkv_nixl.agent import open_agent, register_region
from p2pkv_nixl.locality import cma_usable, host_id
from p2pkv_nixl.open_mark import OpenMark
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.records import Peer, Read, RemoteAgent, Strangers
from p2pkv_nixl.slices import region_slices
from p2pkv_nixl.staging import StagingPool

__all__ = ["WARMUP_BYTES", "NixlState", "log", "quietly"]

log = module_logger("p2pkv_nixl.transport")
"""The logger of every role module: the transport's, as before it was split in roles."""

WARMUP_BYTES = 8
"""Size of a connection warm-up READ (and of the scratch buffer it lands in)."""


class NixlState:
    """The transport's shared state; driver thread only (the transport is driven by one
    thread at a time, and every NIXL call is made on it).

    Owns the agent (``agent``, ``agent_name``), the registered region (``local``: its
    prepared list, ``memory``: its registrations, then the scratch buffer's) and the
    ``scratch`` buffer warm-up READs land in, the open ``mark``, the records (``peers``:
    every peer record not released yet; ``agents``: loaded remote agents by name;
    ``strangers``), ``requests`` (our staged reads by request id awaiting their answer),
    the staging ``pool`` (None until the first staged peer) and ``zombies`` (handles NIXL
    refused to release after they ended). ``ids`` is the base's one id sequence.

    Construction raises what NIXL raises when the agent or region cannot be set up; the
    helpers here never raise for a NIXL failure they can absorb (each says how it fails)."""

    def __init__(
        self, options: NixlOptions, blocks: npt.NDArray[np.uint8], ids: itertools.count[int]
    ) -> None:
        self.options = options
        self.blocks = blocks
        self.num_blocks, self.block_len = (int(n) for n in blocks.shape)
        self.ids = ids
        self.nixl = library.load()
        self.agent, self.agent_name = open_agent(self.nixl, options)
        self.host, self.cma = host_id(), cma_usable()  # UCX read the same environment
        self.scratch = np.zeros(WARMUP_BYTES, dtype=np.uint8)
        """Where warm-up READs land; registered, and kept, exactly as long as the region."""
        self.mark = OpenMark()
        """Holds its token until ``close`` begins (readers on ``cma`` check it after reads)."""
        slices = region_slices(self.num_blocks, self.block_len, options.slice_bytes)
        self.slices = slice_starts(slices)
        """The first block of each of our region's registrations (direct READs cut at them)."""
        region = register_region(
            self.agent,
            self.agent_name,
            blocks.reshape(-1),
            self.block_len,
            extra=(self.scratch,),
            slices=slices,
            identity={
                "host": self.host,
                "cma": self.cma,
                "pid": os.getpid(),
                "mark": self.mark.address,
                "token": self.mark.token,
            },
        )
        self.memory = region.registrations
        """NIXL registrations (the region's slices, then scratch), deregistered last."""
        self.local = region.dlist
        self.base = int(blocks.ctypes.data)
        self.descriptor = region.descriptor
        self.pool: StagingPool | None = None
        self.agents: dict[str, RemoteAgent] = {}
        self.peers: list[Peer] = []
        self.requests: dict[int, Read] = {}
        self.strangers = Strangers()
        self.zombies: dict[int, Any] = {}
        self.closing = False
        """Set once ``close`` began: peers' staged requests are no longer served."""
        self.serves_remote = not self.cma
        """Whether a peer may read from us through our worker (UCX software-emulated GET, e.g.
        over tcp): our UCX lacks ``cma``, or a peer not reachable over ``cma`` was added.
        Decides whether a clean ``close`` may destroy the agent (see the teardown)."""
        self._progress_failed = False

    def current(self, peer_id: str) -> Peer | None:
        """The current (not detached) record of ``peer_id``, if any."""
        for peer in self.peers:
            if peer.current and peer.peer_id == peer_id:
                return peer
        return None

    def disconnected(self, remote: RemoteAgent) -> None:
        """The peer process is gone: UCX has failed the endpoint (its operations complete with
        an error, its connection is closed), so nothing more can land from it. Its reads fail
        at their next check, its quarantines end at the next ``progress``."""
        if not remote.disconnected:
            log.warning("nixl: peer agent %s disconnected; failing its reads", remote.name)
        remote.disconnected = True

    def note_failure(self, remote: RemoteAgent, exc: BaseException) -> bool:
        """Mark ``remote`` disconnected if ``exc`` is NIXL's remote-disconnect error; whether
        it was."""
        if isinstance(exc, self.nixl.remote_disconnect):
            self.disconnected(remote)
            return True
        return False

    def release(self, handle: Any) -> None:
        """Release a handle NIXL reported terminal; one it refuses is kept aside (an internal
        transfer ``close`` reports) and never freed under NIXL."""
        try:
            self.agent.release_xfer_handle(handle)
        except Exception as exc:
            zombie = next(self.ids)
            log.error(
                "nixl: a read ended but NIXL refused to release it (kept as internal "
                "transfer %d): %s",
                zombie,
                exc,
            )
            self.zombies[zombie] = handle

    def ended(self, peer: Peer, handle: Any) -> bool:
        """Whether NIXL reports ``handle`` terminal (``DONE``/``ERR``, or its peer
        disconnected); any other error proves nothing (False)."""
        try:
            return bool(self.agent.check_xfer_state(handle) != "PROC")
        except Exception as exc:
            return self.note_failure(peer.remote, exc)

    def progress_worker(self) -> dict[str, list[bytes]]:
        """Progress NIXL's worker and return the notifications it received; a failure is
        logged (a warning the first time) and returns none: a tick must survive it."""
        try:
            found: dict[str, list[bytes]] = self.agent.get_new_notifs()
        except Exception as exc:
            log.log(
                logging.DEBUG if self._progress_failed else logging.WARNING,
                "nixl: progressing the worker failed: %s",
                exc,
            )
            self._progress_failed = True
            return {}
        return found


def quietly(call: Any, *args: Any) -> None:
    """A best-effort NIXL cleanup call: failures are logged, never raised."""
    try:
        call(*args)
    except Exception as exc:
        log.warning("nixl: %s failed during cleanup: %s", getattr(call, "__name__", call), exc)
