"""The ``nixl`` data transport: one-sided NIXL WRITEs from our region into peers' regions.

Layout: one NIXL agent per transport, named by a fresh uuid; the caller's region registered
once as DRAM; one prepared descriptor list for it (``NIXL_INIT_AGENT``) and one per peer
registration, both in NIXL's strided form (one row however many blocks), so a write is a
``make_prepped_xfer`` over two int32 index arrays plus ``transfer``. NIXL merges contiguous
index runs into larger descriptors itself.

Threading: every NIXL call is made on the caller's (driver) thread; this module starts no
thread. With ``enable_prog_thread`` off (the default) nothing progresses NIXL's worker except
``progress()``/``poll()``: a target that stops calling them stalls its peers' writes into it
(the UCX endpoint wire-up and the completion of each write need the target's worker).

Failure: a peer whose process died makes NIXL raise ``nixlRemoteDisconnectError``, at submit
or when a transfer's state is checked; every transfer of that peer then fails at once and the
peer must be added again (with a fresh descriptor: agent names are never reused). An error
while checking a transfer fails that transfer; it is never left in flight.

Memory safety: NIXL cannot stop a posted write. Releasing the handle of one in progress makes
the UCX backend "cancel" it and report success, but UCX's request cancel does nothing to a
posted RMA operation: the bytes still move. So a transfer handle is released only once NIXL
reports the transfer terminal (or its peer dead, or the caller cancels ``IMMEDIATE``), and a
``WAIT`` cancel keeps every transfer still in progress. ``remove_peer`` and ``close`` poll up
to ``drain_timeout``; what never drains is reported and its resources kept: a peer's
descriptor list stays prepared, and after ``close`` the agent and region stay registered (held
in a module-level list so that not even garbage collection frees them under a transfer). Such
a leaked transport is drained further by the ``progress`` of any open transport on the same
thread, and released once nothing runs. A clean ``close`` destroys the agent, so its peers see
a disconnect rather than a silent endpoint.

The connection warm-up READ (``add_peer``) follows the same rule: it lands in the transport's
scratch buffer, which stays registered and referenced while any warm-up may still run. A
warm-up takes an id from the transfer id sequence; ``poll`` never reports it and ``cancel``
ignores it, but ``remove_peer``/``close`` drain it like a transfer and return its id if it
never ended.
"""

from __future__ import annotations

import array
import itertools
import logging
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from p2pkv.contracts import (
    EMPTY_POLL,
    CancelMode,
    Capabilities,
    DataSettings,
    DataTransport,
    PollResult,
)
from p2pkv.errors import PeerRejected, TransferSubmitError, TransportUnavailable
from p2pkv.logs import module_logger

from p2pkv_nixl import library
from p2pkv_nixl.agent import block_dlist, open_agent, region_array, register_region
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.options import NixlOptions

__all__ = ["NixlDataTransport"]

log = module_logger(__name__)

_LEAKED: list[NixlDataTransport] = []
"""Transports whose ``close`` could not drain: kept alive until they drain (see ``progress``),
else for the process lifetime."""

_WARMUP_BYTES = 8
"""Size of a connection warm-up READ (and of the scratch buffer it lands in)."""


class _RemoteAgent:
    """A peer's NIXL agent, loaded once however many registrations use it."""

    __slots__ = ("disconnected", "metadata", "name", "users")

    def __init__(self, name: str, metadata: bytes) -> None:
        self.name = name
        self.metadata = metadata
        self.users = 0
        self.disconnected = False


class _Registration:
    """One ``add_peer``: the peer's prepared descriptor list and the transfers posted on it.

    A registration replaced by a newer ``add_peer`` or removed while transfers were still
    running stays in its peer's list until it is quiescent; its ids stay pollable.
    """

    __slots__ = (
        "dlist", "finished", "inflight", "num_blocks", "peer_id", "remote", "warmup", "warmup_id",
    )

    def __init__(self, peer_id: str, remote: _RemoteAgent, dlist: Any, num_blocks: int) -> None:
        self.peer_id = peer_id
        self.remote = remote
        self.dlist = dlist
        self.num_blocks = num_blocks
        self.inflight: dict[int, Any] = {}
        """id -> NIXL transfer handle, not yet terminal."""
        self.finished: dict[int, bool] = {}
        """id -> success, terminal (handle released) and not yet reported."""
        self.warmup: Any = None
        """The connection warm-up READ's handle until it ended and was released."""
        self.warmup_id = 0
        """The warm-up's id (reported only by a ``remove_peer``/``close`` it outlives)."""

    @property
    def quiescent(self) -> bool:
        return not self.inflight and self.warmup is None


class NixlDataTransport(DataTransport):
    """NIXL data transport; see the module docstring and the README for the options."""

    name: ClassVar[str] = "nixl"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True, cross_host=True, wait_cancel=True, memory_kinds=frozenset({"DRAM"})
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> NixlDataTransport:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        self._options = NixlOptions.parse(settings.options)
        self._array = region_array(settings)
        self._block_len = settings.block_len
        self._num_blocks = self._array.size // settings.block_len
        self._nixl = library.load()
        self._agent, self._agent_name = open_agent(self._nixl, self._options)
        self._scratch = np.zeros(_WARMUP_BYTES, dtype=np.uint8)
        """Where warm-up READs land; registered, and kept, exactly as long as the region."""
        region = register_region(
            self._agent, self._agent_name, self._array, self._block_len,
            extra=(self._scratch,) if self._options.warmup else (),
        )
        self._memory = region.registrations
        """NIXL registrations (region, then scratch), deregistered last."""
        self._local = region.dlist
        self._descriptor = region.descriptor
        self._agents: dict[str, _RemoteAgent] = {}
        self._current: dict[str, _Registration] = {}
        self._by_peer: dict[str, list[_Registration]] = {}
        self._owner: dict[int, _Registration] = {}
        self._warming: list[_Registration] = []
        self._zombies: dict[int, Any] = {}
        """Handles whose release NIXL refused after they ended: never freed under them."""
        self._ids = itertools.count(1)
        self._closed = False
        self._closing_thread = 0
        """``threading.get_ident()`` of the ``close`` that left this transport undrained."""
        self._released = False
        self._progress_failed = False

    # -- shape ----------------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    @property
    def agent_name(self) -> str:
        """Our NIXL agent's name (a fresh uuid per transport)."""
        return self._agent_name

    def descriptor(self) -> bytes:
        return self._descriptor

    # -- peers ----------------------------------------------------------------------------

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the nixl transport is closed")
        desc = RegionDescriptor.decode(descriptor, peer_id)
        if desc.block_len != self._block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self._block_len})"
            )
        if desc.agent == self._agent_name:
            raise PeerRejected(f"peer {peer_id!r}: the descriptor is our own")
        remote = self._load_agent(peer_id, desc)
        try:
            dlist = self._agent.prep_xfer_dlist(
                desc.agent, block_dlist(desc.base, desc.num_blocks, desc.block_len), "DRAM"
            )
        except Exception as exc:
            self._unload_agent(remote)
            raise PeerRejected(
                f"peer {peer_id!r}: NIXL refused its region ({type(exc).__name__}: {exc})"
            ) from exc
        registration = _Registration(peer_id, remote, dlist, desc.num_blocks)
        old = self._current.pop(peer_id, None)
        self._current[peer_id] = registration
        self._by_peer.setdefault(peer_id, []).append(registration)
        if old is not None:
            self._retire_quiescent(peer_id)
        if self._options.warmup:
            self._start_warmup(registration, desc.base)

    def remove_peer(self, peer_id: str) -> list[int]:
        self._current.pop(peer_id, None)
        registrations = list(self._by_peer.get(peer_id, ()))
        if self._closed or not registrations:
            return []
        undrained = self._quiesce(registrations)
        self._retire_quiescent(peer_id)
        return undrained

    def _load_agent(self, peer_id: str, desc: RegionDescriptor) -> _RemoteAgent:
        remote = self._agents.get(desc.agent)
        if remote is not None:
            if remote.disconnected:
                raise PeerRejected(
                    f"peer {peer_id!r}: NIXL agent {desc.agent} disconnected earlier; a restarted "
                    f"peer has a new agent name"
                )
            if remote.metadata != desc.metadata:
                raise PeerRejected(
                    f"peer {peer_id!r}: agent {desc.agent} is already known with other metadata"
                )
        else:
            try:
                loaded = self._agent.add_remote_agent(desc.metadata)
            except Exception as exc:
                raise PeerRejected(
                    f"peer {peer_id!r}: NIXL cannot load its agent metadata (is it alive and "
                    f"reachable?): {type(exc).__name__}: {exc}"
                ) from exc
            name = loaded.decode() if isinstance(loaded, bytes) else str(loaded)
            if name != desc.agent:
                if name != self._agent_name and name not in self._agents:
                    self._quietly(self._agent.remove_remote_agent, loaded)  # only ours to undo
                raise PeerRejected(
                    f"peer {peer_id!r}: its metadata names agent {name!r}, its descriptor "
                    f"{desc.agent!r}"
                )
            remote = self._agents[name] = _RemoteAgent(name, desc.metadata)
        remote.users += 1
        return remote

    def _unload_agent(self, remote: _RemoteAgent) -> None:
        remote.users -= 1
        if remote.users == 0:
            del self._agents[remote.name]
            self._quietly(self._agent.remove_remote_agent, remote.name)

    def _start_warmup(self, registration: _Registration, remote_base: int) -> None:
        """Post an 8-byte READ from the peer's region into our scratch: it wires the
        connection up while both sides progress, and touches neither region's contents.
        Like a write, it is released only once NIXL reports it ended."""
        length = min(_WARMUP_BYTES, self._block_len)
        try:
            handle = self._agent.initialize_xfer(
                "READ",
                self._agent.get_xfer_descs([(int(self._scratch.ctypes.data), length, 0)], "DRAM"),
                self._agent.get_xfer_descs([(remote_base, length, 0)], "DRAM"),
                registration.remote.name,
            )
        except Exception as exc:
            log.warning("nixl: connection warm-up to %s not posted: %s", registration.peer_id, exc)
            return
        registration.warmup = handle
        registration.warmup_id = next(self._ids)
        self._warming.append(registration)
        try:
            state = self._agent.transfer(handle)
        except Exception as exc:
            self._warmup_ended(registration, exc)
            return
        if state != "PROC":
            self._warmup_ended(registration, None)

    def _check_warmups(self) -> None:
        """End the warm-ups NIXL reports terminal; a replaced or removed registration that is
        idle then goes at once (nothing else may poll its peer again)."""
        for registration in list(self._warming):
            try:
                state = self._agent.check_xfer_state(registration.warmup)
            except Exception as exc:
                self._warmup_ended(registration, exc)
            else:
                if state == "PROC":
                    continue
                self._warmup_ended(registration, None)
            if (registration.quiescent and not registration.finished
                    and self._current.get(registration.peer_id) is not registration):
                self._retire_quiescent(registration.peer_id)

    def _warmup_ended(self, registration: _Registration, exc: BaseException | None) -> None:
        if isinstance(exc, self._nixl.remote_disconnect):
            self._disconnected(registration.remote)
        elif exc is not None:
            log.info("nixl: connection warm-up to %s failed: %s", registration.peer_id, exc)
        try:
            self._agent.release_xfer_handle(registration.warmup)
        except Exception as release_exc:
            log.warning("nixl: warm-up handle of %s not released yet: %s",
                        registration.peer_id, release_exc)
            return
        registration.warmup = None
        self._warming.remove(registration)

    # -- transfers ------------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        if self._closed:
            raise TransferSubmitError("the nixl transport is closed")
        registration = self._current.get(peer_id)
        if registration is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        if registration.remote.disconnected:
            raise TransferSubmitError(
                f"peer {peer_id!r} disconnected (NIXL_ERR_REMOTE_DISCONNECT); add it again with "
                f"a fresh descriptor"
            )
        try:
            local = _indexes(local_idxs, self._num_blocks)
        except ValueError as exc:
            raise TransferSubmitError(f"local block {exc}") from None
        try:
            remote = _indexes(remote_idxs, registration.num_blocks)
            _refuse_repeats(remote, remote_idxs)
        except ValueError as exc:
            raise TransferSubmitError(f"remote (peer {peer_id!r}) block {exc}") from None
        if len(local) != len(remote):
            raise TransferSubmitError(f"{len(local)} local but {len(remote)} remote block indexes")
        transfer_id = next(self._ids)
        if len(local) == 0:
            registration.finished[transfer_id] = True
            self._owner[transfer_id] = registration
            return transfer_id
        agent = self._agent
        try:
            handle = agent.make_prepped_xfer(
                "WRITE", self._local, local, registration.dlist, remote
            )
        except Exception as exc:
            raise TransferSubmitError(
                f"peer {peer_id!r}: NIXL refused the transfer ({type(exc).__name__}: {exc})"
            ) from exc
        try:
            state = agent.transfer(handle)
        except Exception as exc:
            self._quietly(agent.release_xfer_handle, handle)
            if isinstance(exc, self._nixl.remote_disconnect):
                self._disconnected(registration.remote)
            raise TransferSubmitError(
                f"peer {peer_id!r}: NIXL could not post the transfer ({type(exc).__name__}: {exc})"
            ) from exc
        if state == "ERR":
            self._quietly(agent.release_xfer_handle, handle)
            raise TransferSubmitError(f"peer {peer_id!r}: NIXL failed the transfer at submit")
        self._owner[transfer_id] = registration
        if state == "DONE":
            self._release(transfer_id, handle)
            registration.finished[transfer_id] = True
        else:
            registration.inflight[transfer_id] = handle
        return transfer_id

    def progress(self) -> None:
        """Drive NIXL's worker: ``get_new_notifs`` is the cheapest call that progresses it
        (a few microseconds; we send no notifications, so it returns nothing we keep).

        An open transport also takes one drain step for each transport that a ``close`` on
        this same thread left undrained (NIXL calls stay on the thread that used the agent):
        what it still runs may need a peer in this process, and a peer that keeps polling ends
        it, so the leaked transport is then released after all, and its peers see it go."""
        if self._released:
            return
        if _LEAKED and not self._closed:
            thread = threading.get_ident()
            for leaked in list(_LEAKED):
                if leaked._closing_thread == thread:
                    leaked._drain_step()
        try:
            self._agent.get_new_notifs()
        except Exception as exc:  # a tick must survive a backend hiccup; transfers report theirs
            log.log(
                logging.DEBUG if self._progress_failed else logging.WARNING,
                "nixl: progressing the worker failed: %s", exc,
            )
            self._progress_failed = True
        if self._warming:
            self._check_warmups()

    def poll(self, peer_id: str | None = None) -> PollResult:
        if self._closed:
            return EMPTY_POLL
        self.progress()
        if peer_id is None:
            registrations: Iterable[_Registration] = list(self._all_registrations())
        else:
            found = self._by_peer.get(peer_id)
            if not found:
                return EMPTY_POLL
            registrations = found
        done: list[int] = []
        failed: list[int] = []
        retire = False
        for registration in registrations:
            if registration.inflight:
                self._check(registration)
            if registration.finished:
                for transfer_id, ok in registration.finished.items():
                    (done if ok else failed).append(transfer_id)
                    del self._owner[transfer_id]
                registration.finished.clear()
            retire = retire or (
                registration.quiescent
                and self._current.get(registration.peer_id) is not registration
            )
        if retire:
            for peer in [peer_id] if peer_id is not None else list(self._by_peer):
                self._retire_quiescent(peer)
        if not done and not failed:
            return EMPTY_POLL
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode) -> list[int]:
        kept: list[int] = []
        touched: set[str] = set()
        for transfer_id in transfer_ids:
            registration = self._owner.get(transfer_id)
            if registration is None:
                continue
            touched.add(registration.peer_id)
            if registration.finished.pop(transfer_id, None) is not None:
                del self._owner[transfer_id]
                continue
            handle = registration.inflight[transfer_id]
            if mode is CancelMode.WAIT and self._still_running(registration, handle):
                kept.append(transfer_id)  # NIXL cannot stop it: it stays pollable
                continue
            self._release(transfer_id, handle)
            del registration.inflight[transfer_id]
            del self._owner[transfer_id]
        for peer_id in touched:
            self._retire_quiescent(peer_id)
        return kept

    def _still_running(self, registration: _Registration, handle: Any) -> bool:
        """True while NIXL reports the transfer in progress (it cannot be stopped then, see
        the module docstring). An error ends it; a disconnect also marks the peer dead."""
        try:
            return bool(self._agent.check_xfer_state(handle) == "PROC")
        except Exception as exc:
            if isinstance(exc, self._nixl.remote_disconnect):
                registration.remote.disconnected = True
            return False

    def _check(self, registration: _Registration) -> None:
        agent = self._agent
        for transfer_id, handle in list(registration.inflight.items()):
            try:
                state = agent.check_xfer_state(handle)
            except Exception as exc:
                if isinstance(exc, self._nixl.remote_disconnect):
                    self._disconnected(registration.remote)
                    return  # every transfer of that agent has just been failed
                log.warning("nixl: checking transfer %d failed; failing it: %s", transfer_id, exc)
                state = "ERR"
            if state == "PROC":
                continue
            del registration.inflight[transfer_id]
            self._release(transfer_id, handle)
            registration.finished[transfer_id] = state == "DONE"

    def _disconnected(self, remote: _RemoteAgent) -> None:
        """The peer process is gone: fail every transfer of every registration using it."""
        if not remote.disconnected:
            log.warning("nixl: peer agent %s disconnected; failing its transfers", remote.name)
        remote.disconnected = True
        for registration in self._all_registrations():
            if registration.remote is not remote:
                continue
            for transfer_id, handle in registration.inflight.items():
                self._release(transfer_id, handle)
                registration.finished[transfer_id] = False
            registration.inflight.clear()

    def _release(self, transfer_id: int, handle: Any) -> None:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception as exc:
            log.error(
                "nixl: transfer %d ended but NIXL refused to release it: %s", transfer_id, exc
            )
            self._zombies[transfer_id] = handle

    # -- quiescence -----------------------------------------------------------------------

    def _all_registrations(self) -> Iterator[_Registration]:
        for registrations in self._by_peer.values():
            yield from registrations

    def _quiesce(self, registrations: Sequence[_Registration]) -> list[int]:
        """Wait-cancel every transfer of ``registrations``, then poll what still runs (warm-ups
        included) up to ``drain_timeout``; forget what ended. Returns the ids still running."""
        for registration in registrations:
            for transfer_id in registration.finished:
                del self._owner[transfer_id]
            registration.finished.clear()
        ids = [t for registration in registrations for t in registration.inflight]
        self.cancel(ids, CancelMode.WAIT)
        deadline = time.monotonic() + self._options.drain_timeout
        while any(not r.quiescent for r in registrations) and time.monotonic() < deadline:
            self._settle(registrations)
        undrained = sorted(
            [t for registration in registrations for t in registration.inflight]
            + [r.warmup_id for r in registrations if r.warmup is not None]
        )
        if undrained:
            log.error(
                "nixl: %d transfer(s) still running after %.1fs drain (%s); their memory stays "
                "registered", len(undrained), self._options.drain_timeout, undrained,
            )
        return undrained

    def _settle(self, registrations: Sequence[_Registration]) -> None:
        """Progress once, then forget the transfers of ``registrations`` that ended."""
        self.progress()
        for registration in registrations:
            self._check(registration)
            for transfer_id in registration.finished:
                del self._owner[transfer_id]
            registration.finished.clear()

    def _drain_step(self) -> None:
        """One non-blocking drain pass of a leaked transport; finishes its ``close`` once
        nothing runs any more."""
        registrations = list(self._all_registrations())
        self._settle(registrations)
        if all(r.quiescent for r in registrations):
            self.close()

    def _retire_quiescent(self, peer_id: str) -> None:
        """Release the registrations of ``peer_id`` that are replaced or removed and idle."""
        registrations = self._by_peer.get(peer_id)
        if not registrations:
            return
        current = self._current.get(peer_id)
        keep = []
        for registration in registrations:
            if registration is current or not registration.quiescent or registration.finished:
                keep.append(registration)
                continue
            self._quietly(self._agent.release_dlist_handle, registration.dlist)
            self._unload_agent(registration.remote)
        if keep:
            self._by_peer[peer_id] = keep
        else:
            del self._by_peer[peer_id]

    # -- close ----------------------------------------------------------------------------

    def close(self) -> list[int]:
        """See ``DataTransport.close``. Calling it again after it returned ids retries the drain
        and releases everything once nothing runs any more."""
        if self._released:
            return []
        self._closed = True
        self._current.clear()
        undrained = self._quiesce(list(self._all_registrations()))
        for transfer_id, handle in list(self._zombies.items()):
            try:
                self._agent.release_xfer_handle(handle)
            except Exception:
                continue
            del self._zombies[transfer_id]
        if undrained or self._zombies or any(
            not r.quiescent for r in self._all_registrations()
        ):
            leftover = sorted({*undrained, *self._zombies})
            self._closing_thread = threading.get_ident()
            if self not in _LEAKED:
                _LEAKED.append(self)
            return leftover
        for peer_id in list(self._by_peer):
            self._retire_quiescent(peer_id)
        agent = self._agent
        self._quietly(agent.release_dlist_handle, self._local)
        for registration in reversed(self._memory):
            self._quietly(agent.deregister_memory, registration)
        self._memory.clear()
        self._released = True
        if self in _LEAKED:
            _LEAKED.remove(self)
        # Every NIXL handle object holds the agent: with the last one gone, the agent and its
        # UCX worker are destroyed, so peers see a disconnect instead of a silent endpoint.
        del self._agent, self._local, self._array, self._scratch
        return []

    @staticmethod
    def _quietly(call: Any, *args: Any) -> None:
        """A best-effort NIXL cleanup call: failures are logged, never raised."""
        try:
            call(*args)
        except Exception as exc:
            log.warning("nixl: %s failed during cleanup: %s", getattr(call, "__name__", call), exc)


_SMALL = 64
"""Up to this many indexes, Python's C builtins (min, max, set) beat numpy's per-call cost."""


def _indexes(idxs: Sequence[int], limit: int) -> npt.NDArray[np.int32]:
    """``idxs`` as a contiguous int32 array with every index in ``0..limit-1``, else
    ``ValueError`` saying which index is wrong (the caller names the side).

    A list goes through ``array.array("i")``: C speed, straight to int32, and it refuses
    floats, strings and nested lists (``np.asarray`` with an int dtype would silently truncate
    or parse them). An ndarray must already have an integer dtype. This is the hot path of
    ``write_blocks``: at most one numpy reduction, none for short lists.
    """
    if isinstance(idxs, np.ndarray):
        if idxs.ndim != 1 or (idxs.size and idxs.dtype.kind not in "iu"):
            raise ValueError("indexes must be a flat list of integers")
        wide = idxs.astype(np.int64, copy=False)
        if wide.size and int(wide.view(np.uint64).max()) >= limit:  # negatives wrap high
            _raise_outside(wide.tolist(), limit)
        return np.ascontiguousarray(wide, dtype=np.int32)
    try:
        packed = array.array("i", idxs)
    except OverflowError:
        raise ValueError(f"index outside 0..{limit - 1} (beyond int32)") from None
    except (TypeError, ValueError):
        raise ValueError("indexes must be a flat list of integers") from None
    if len(packed) <= _SMALL:
        if packed and (min(packed) < 0 or max(packed) >= limit):
            _raise_outside(packed, limit)
    elif int(np.frombuffer(packed, dtype=np.uint32).max()) >= limit:  # negatives wrap high
        _raise_outside(packed, limit)
    return np.frombuffer(packed, dtype=np.int32)


def _raise_outside(values: Iterable[int], limit: int) -> None:
    bad = next(v for v in values if not 0 <= v < limit)
    raise ValueError(f"index {bad} is outside 0..{limit - 1}")


def _refuse_repeats(remote: npt.NDArray[np.int32], given: Sequence[int]) -> None:
    """``ValueError`` if one destination block appears twice (the bytes landing there would
    depend on the order the backend happens to use)."""
    if len(remote) <= _SMALL:
        values = given if isinstance(given, (list, tuple)) else remote.tolist()
        if len(set(values)) == len(values):
            return
    else:
        ordered = np.sort(remote)
        if not (ordered[1:] == ordered[:-1]).any():
            return
    seen: set[int] = set()
    for value in remote.tolist():
        if value in seen:
            raise ValueError(f"index {value} is written twice in one transfer")
        seen.add(value)
