"""The ``ucx`` data transport: two-sided UCX tag messaging over ucxx, host memory.

ucxx's Python API has no RMA (no memory map, rkey or put), so a block moves as a tagged
message that the receiver matches into its slot. The round trip per write:

1. The consumer's tier calls ``expect_blocks(producer, slots)`` when it asks for blocks. We
   number the expectation (``gen``, a per-peer round), own the slots, **pre-post one receive
   per slot** straight into it (tag: producer's link, ``gen``, slot), and send the producer an
   EXPECT ``(link, gen, slots)`` over UCX.
2. The producer's ``write_blocks(consumer, src, dst)`` waits (inside the transport, never
   blocking the caller) until an EXPECT covers every ``dst`` slot, takes each slot's ``gen``
   (once: a second write into the same slot waits for a new EXPECT), cuts the write into
   runs contiguous on both sides (:func:`~p2pkv_ucx.runs.plan_runs`), and sends one HEADER
   naming the runs, then each run's payload straight from its source blocks: a one-block run
   with the SLOT tag that matches the pre-posted receive, a longer run as one RUN message.
3. The consumer checks each run of the HEADER against its live expectations (same peer, same
   ``gen``, slots not yet claimed). A one-block run needs nothing more (its receive is already
   posted, and its tag already says peer, round and slot). For a longer run it cancels the
   run's pre-posted receives (confirmed: they cannot have matched) and posts one receive over
   the run's slots. A run that fails the check is drained into a scratch buffer and never
   touches the region. The consumer answers every HEADER with a VERDICT (runs refused); the
   producer reports the write done only when UCX completed every send *and* the consumer
   refused nothing, so ``done`` means landed.
4. An expectation that ends without its data (cancel, deadline, error) sends a RETRACT so the
   producer forgets its round for those slots and a later write for them waits for the next
   EXPECT instead of going out with a dead round.

Tags (:mod:`p2pkv_ucx.tags`) carry a link id the *receiver* assigned to the sender, so
messages from two peers can never match each other's receives even though UCX matches per
worker. ``gen`` makes a write from an abandoned round unable to land in a later round's slot:
the consumer refuses it and the producer reports it failed. What the transport cannot see is
which of the producer *core's* rounds a write belongs to: a producer that writes an aborted
round's blocks after the consumer re-expected the same slots (and after the RETRACT/EXPECT
reached it) would pass. The core's abort handshake rules that out; see the README.

Threading and progress: no progress thread. ``poll``/``progress`` call ``worker.progress()``
on the caller's (driver) thread; ucxx never calls back into Python here. Nothing blocks
except ``remove_peer`` and ``close``, which progress for at most ``drain_timeout``.

Cost of a poll: it looks only at *watched* transfers, the ones something can have happened
to: posted writes, expectations a HEADER has named (or that are stopping), transfers whose
peer failed, and transfers past their deadline (found from the oldest, since transfers are
registered in deadline order). An expectation nobody has written to yet, or a write still
waiting for its EXPECT, costs a poll nothing however many are outstanding (a consumer that
pre-posts thousands of rounds would otherwise pay microseconds per round per poll, which
became milliseconds of latency per block). Such an expectation notices a receive failing
before any HEADER named it only through its peer (a failed endpoint marks the peer dead,
which watches all its transfers) or at its deadline; the protocol fails receives no other way.

Memory safety: a receive is the only request that writes our region; it is terminal only
when UCX says so (completed, failed, or confirmed cancelled). Sends only read our memory, so
a send UCX cannot finish (a vanished peer without endpoint error handling) is failed at its
deadline and kept as an *orphan* until UCX lets go of it; ``close`` reports orphans as
undrained and then leaks the UCX objects rather than freeing memory under them.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import secrets
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
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
from p2pkv.errors import (
    ConfigError,
    PeerRejected,
    TransferSubmitError,
    TransportUnavailable,
)
from p2pkv.logs import module_logger

from p2pkv_ucx import library, tags, wire
from p2pkv_ucx.options import UcxOptions
from p2pkv_ucx.runs import plan_runs

__all__ = ["UcxDataTransport"]

log = module_logger(__name__)

IntArray = npt.NDArray[np.int64]
_OK = 0
_GEN_LIMIT = (1 << 32) - 1
_INBOX_BATCH = 256
"""Control messages taken from UCX per kind per pump (the rest wait for the next pump)."""
_EARLY_LIMIT = 64
"""Notices kept per not-yet-added sender, and senders kept (older ones are dropped)."""
_ALL_RUNS = tags.MAX_RUNS
"""VERDICT count for a HEADER we could not read: every run refused."""


@dataclass(eq=False)
class _Peer:
    peer_id: str
    desc: wire.Descriptor
    ep: Any
    link_in: int
    """Our id for this peer: it tags its SLOT, HEADER and RUN messages to us with it."""
    slot_gen: npt.NDArray[np.uint32]
    """Round of the newest unconsumed EXPECT per slot of the peer's region (0 = none)."""
    link_out: int | None = None
    """The peer's id for us (from its EXPECTs); we cannot write to it before the first one."""
    next_gen: int = 1
    next_seq: int = 0
    dead: bool = False
    transfers: dict[int, _Transfer] = field(default_factory=dict)
    deferred: list[_Write] = field(default_factory=list)
    posts: dict[int, _Write] = field(default_factory=dict)
    """Our posted writes to the peer awaiting its VERDICT, by seq."""


@dataclass(eq=False)
class _Transfer:
    tid: int
    peer: _Peer
    deadline: float
    requests: list[Any] = field(default_factory=list)
    front: int = 0
    """``requests[:front]`` have completed."""
    error: str | None = None
    cancelled: bool = False
    keep: Any = None
    """A payload UCX reads until its send completes (HEADER or EXPECT bytes)."""

    def settle(self) -> bool:
        """Record completions; True when every request has completed."""
        reqs = self.requests
        while self.front < len(reqs) and reqs[self.front].completed:
            status = reqs[self.front].status
            if status != _OK and self.error is None:
                self.error = f"UCX status {status}"
            self.front += 1
        return self.front == len(reqs)


@dataclass(eq=False)
class _Write(_Transfer):
    src: IntArray = field(default_factory=lambda: np.empty(0, np.int64))
    dst: IntArray = field(default_factory=lambda: np.empty(0, np.int64))
    posted: bool = False
    seq: int | None = None
    accepted: bool = False
    """The consumer's VERDICT came back with nothing refused."""


@dataclass(eq=False)
class _Expect(_Transfer):
    """``requests`` holds the receives of coalesced runs (their tags in ``run_tags``)."""

    gen: int = 0
    slots: IntArray = field(default_factory=lambda: np.empty(0, np.int64))
    singles: list[Any] = field(default_factory=list)
    """The receive pre-posted for each slot, in ``slots`` order."""
    replaced: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, np.bool_))
    """Singles cancelled because a coalesced run covers their slot."""
    sfront: int = 0
    run_tags: list[int] = field(default_factory=list)
    unclaimed: int = 0
    """Slots no accepted HEADER has named yet (done needs 0: the VERDICT must be sent)."""
    stopping: bool = False
    notice: Any = None
    """The EXPECT send; it reads ``keep`` only, never the region."""

    def settle(self) -> bool:
        if self.notice is not None and self.notice.completed:
            if self.notice.status != _OK and self.error is None:
                self.error = f"EXPECT to the peer failed (UCX status {self.notice.status})"
            self.notice = None
        singles, replaced = self.singles, self.replaced
        while self.sfront < len(singles):
            req = singles[self.sfront]
            if not replaced[self.sfront]:
                if not req.completed:
                    break
                if req.status != _OK and self.error is None:
                    self.error = f"UCX status {req.status}"
            self.sfront += 1
        return super().settle() and self.sfront == len(singles)


class UcxDataTransport(DataTransport):
    """``DataTransport`` over ucxx tag send/receive (see the module docstring)."""

    name: ClassVar[str] = "ucx"
    capabilities: ClassVar[Capabilities] = Capabilities(
        cross_process=True,
        cross_host=True,
        wait_cancel=True,
        memory_kinds=frozenset({"DRAM"}),
        two_sided=True,
    )

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> UcxDataTransport:
        options = UcxOptions.from_mapping(settings.options)
        region = settings.region
        if settings.block_len < 1:
            raise ConfigError(f"block_len must be positive, got {settings.block_len}")
        if region.readonly or not region.c_contiguous or region.ndim != 1:
            raise ConfigError("the ucx transport needs a writable, 1-D, C-contiguous region")
        if region.nbytes == 0 or region.nbytes % settings.block_len:
            raise ConfigError(
                f"region of {region.nbytes} bytes is not a whole number of "
                f"{settings.block_len}-byte blocks"
            )
        if settings.num_blocks > tags.MAX_SLOTS:
            raise ConfigError(
                f"the ucx transport addresses at most {tags.MAX_SLOTS} blocks, the region has "
                f"{settings.num_blocks}: use larger blocks"
            )
        return cls(settings, options, library.load())

    def __init__(self, settings: DataSettings, options: UcxOptions, lib: library.Ucxx) -> None:
        api = lib.api
        self._opts = options
        self._lib = lib
        self._tag = api.UCXXTag
        self._mask = api.UCXXTagMask
        self._array = lib.array
        self._block_len = settings.block_len
        self._num_blocks = settings.num_blocks
        self._blocks: npt.NDArray[np.uint8] | None = np.frombuffer(
            settings.region.cast("B"), np.uint8
        ).reshape(self._num_blocks, self._block_len)
        config = {k.removeprefix("UCX_"): v for k, v in options.ucx_config.items()}
        try:
            with library.ucx_environment(lib.env):
                self._ctx: Any = api.UCXContext(
                    config_dict=config, feature_flags=(api.Feature.TAG,)
                )
            self._worker: Any = api.UCXWorker(self._ctx)
            address = self._worker.address.tobytes()
        except Exception as exc:
            raise ConfigError(f"UCX refused to start ({type(exc).__name__}: {exc})") from exc
        coalesce = options.coalesce and lib.cancel is not None  # runs replace posted singles
        self._max_run = max(1, options.max_message_bytes // self._block_len) if coalesce else 1
        self._instance = secrets.randbits(62) | 1
        self._descriptor = wire.encode_descriptor(wire.Descriptor(
            address, self._instance, self._num_blocks, self._block_len, self._max_run,
            options.endpoint_error_handling,
        ))
        self._timeout = options.transfer_timeout if options.transfer_timeout > 0 else math.inf
        self._ids = itertools.count(1)
        self._links = itertools.count(1)
        self._peers: dict[str, _Peer] = {}
        self._retired: dict[str, list[_Peer]] = {}
        self._by_link: dict[int, _Peer] = {}
        self._by_instance: dict[int, _Peer] = {}
        self._early: dict[int, list[wire.Notice]] = {}
        self._transfers: dict[int, _Transfer] = {}
        """Every live transfer, in registration order (= deadline order, see ``_expire``)."""
        self._watched: dict[int, _Transfer] = {}
        """Transfers ``poll`` advances (see the module docstring); a subset of ``_transfers``."""
        self._slot_owner = np.zeros(self._num_blocks, np.int64)
        """Id of the expectation owning each slot (0: none)."""
        self._slot_pos = np.zeros(self._num_blocks, np.int64)
        """Position of each owned slot in its expectation's ``slots``."""
        self._claimed = np.zeros(self._num_blocks, np.bool_)
        self._inbox: deque[tuple[int, int, Any, npt.NDArray[np.uint8]]] = deque()
        self._poisoned: dict[tuple[int, int], list[float]] = {}
        """(tag, mask) of refused payload still to drain -> [expiry, messages left (-1: ?)]."""
        self._drains: list[Any] = []
        self._scratch: npt.NDArray[np.uint8] | None = None
        self._orphans: list[_Transfer] = []
        self._loose: list[tuple[Any, Any]] = []
        self._control_limit = 64 + 12 * self._num_blocks
        self._closing = False
        self._closed = False
        self._undrained: list[int] = []

    # -- shape and peers --------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_len(self) -> int:
        return self._block_len

    def descriptor(self) -> bytes:
        return self._descriptor

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        if self._closed:
            raise PeerRejected(f"peer {peer_id!r}: the ucx transport is closed")
        try:
            desc = wire.decode_descriptor(descriptor)
        except ValueError as exc:
            raise PeerRejected(f"peer {peer_id!r}: {exc}") from None
        if desc.block_len != self._block_len:
            raise PeerRejected(
                f"peer {peer_id!r}: block_len {desc.block_len} does not match ours "
                f"({self._block_len})"
            )
        if desc.error_handling != self._opts.endpoint_error_handling:
            raise PeerRejected(
                f"peer {peer_id!r}: endpoint_error_handling is {desc.error_handling} there and "
                f"{self._opts.endpoint_error_handling} here; UCX cannot connect the two modes "
                f"(set the same data option on every peer)"
            )
        known = self._peers.get(peer_id)
        if known is not None:
            if known.desc == desc and not known.dead and known.ep.alive:
                return
            # Another incarnation, or the same one behind a failed endpoint (it was paused or
            # cut off past UCX's keepalive and came back): a fresh endpoint, never the dead one.
            self.remove_peer(peer_id)
        link = next(self._links)
        if link > tags.MAX_LINK:
            raise PeerRejected(f"peer {peer_id!r}: link ids exhausted; recreate the transport")
        api = self._lib.api
        try:
            address = api.UCXAddress.create_from_buffer(desc.address)
            ep = api.UCXEndpoint.create_from_worker_address(
                self._worker, address, self._opts.endpoint_error_handling
            )
        except Exception as exc:
            raise PeerRejected(
                f"peer {peer_id!r}: UCX cannot reach its worker ({type(exc).__name__}: {exc})"
            ) from None
        peer = _Peer(peer_id, desc, ep, link, np.zeros(desc.num_blocks, np.uint32))
        self._control_limit = max(self._control_limit, 64 + 12 * desc.num_blocks)
        self._peers[peer_id] = peer
        self._by_link[link] = peer
        self._by_instance[desc.instance] = peer
        for notice in self._early.pop(desc.instance, []):
            self._on_notice(notice)

    def remove_peer(self, peer_id: str) -> list[int]:
        peer = self._peers.pop(peer_id, None)
        if peer is None:
            return []
        if self._by_instance.get(peer.desc.instance) is peer:
            del self._by_instance[peer.desc.instance]
        kept = self._drain(list(peer.transfers))
        if peer.transfers:
            self._retired.setdefault(peer_id, []).append(peer)
        else:
            self._release(peer)
        return kept

    # -- submit -----------------------------------------------------------------------------

    def write_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        peer = self._active(peer_id)
        src = _indexes(local_idxs, self._num_blocks, "local")
        dst = _indexes(remote_idxs, peer.desc.num_blocks, "remote")
        if len(src) != len(dst):
            raise TransferSubmitError(
                f"{len(src)} local but {len(dst)} remote block indexes"
            )
        if len(dst) > tags.MAX_RUNS:
            raise TransferSubmitError(f"at most {tags.MAX_RUNS} blocks per write")
        if _has_duplicates(dst):
            raise TransferSubmitError("a remote block index appears twice in one write")
        write = _Write(next(self._ids), peer, time.monotonic() + self._timeout, src=src, dst=dst)
        self._register(write)
        if len(dst) == 0:
            write.posted = write.accepted = True
            self._watch(write)
        else:
            peer.deferred.append(write)
            self._pump()  # take EXPECTs and RETRACTs that already arrived first
            self._post_deferred(peer)
        return write.tid

    def expect_blocks(self, peer_id: str, local_idxs: Sequence[int]) -> int | None:
        peer = self._active(peer_id)
        slots = _indexes(local_idxs, self._num_blocks, "local")
        if _has_duplicates(slots):
            raise TransferSubmitError("a local block index appears twice in one expectation")
        busy = slots[self._slot_owner[slots] != 0]
        if len(busy):
            raise TransferSubmitError(
                f"local block {int(busy[0])} already expects a write (cancel that one first)"
            )
        gen = peer.next_gen
        expect = _Expect(
            next(self._ids), peer, time.monotonic() + self._timeout,
            gen=gen, slots=slots, unclaimed=len(slots), replaced=np.zeros(len(slots), np.bool_),
        )
        if len(slots):
            assert self._blocks is not None
            recv, array, tag, blocks = peer.ep.tag_recv, self._array, self._tag, self._blocks
            base = tags.slot_tag(peer.link_in, gen, 0)
            try:
                for s in slots.tolist():
                    expect.singles.append(recv(array(blocks[s]), tag(base | s)))
                expect.notice, expect.keep = self._notify(
                    peer, wire.encode_expect(self._instance, peer.link_in, gen, slots)
                )
            except Exception as exc:
                self._unpost(expect)
                raise TransferSubmitError(
                    f"peer {peer_id!r}: UCX refused to post ({type(exc).__name__}: {exc})"
                ) from None
            peer.next_gen = gen % _GEN_LIMIT + 1
            self._slot_owner[slots] = expect.tid
            self._slot_pos[slots] = np.arange(len(slots))
        self._register(expect)
        if not len(slots):
            self._watch(expect)
        return expect.tid

    # -- progress and completion ------------------------------------------------------------

    def progress(self) -> None:
        if not self._closed:
            self._pump()

    def poll(self, peer_id: str | None = None) -> PollResult:
        if self._closed:
            return EMPTY_POLL
        self._pump()
        now = time.monotonic()
        self._expire(now)
        if peer_id is None:
            scope = list(self._watched.values())
        else:
            peers = [*self._retired.get(peer_id, ()), self._peers.get(peer_id)]
            scope = [t for t in self._watched.values() if any(t.peer is p for p in peers)]
        if not scope:
            return EMPTY_POLL
        done: list[int] = []
        failed: list[int] = []
        for t in scope:
            outcome = self._advance(t, now)
            if outcome is not None:
                (done if outcome else failed).append(t.tid)
                self._forget(t)
        return PollResult(done, failed)

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode) -> list[int]:
        kept: list[int] = []
        for tid in transfer_ids:
            t = self._transfers.get(tid)
            if t is None:
                continue
            if isinstance(t, _Expect):
                self._stop(t, "cancelled")
            if mode is CancelMode.IMMEDIATE or self._stopped(t):
                self._forget(t)
            else:
                t.cancelled = True
                kept.append(tid)
        return kept

    def close(self) -> list[int]:
        if self._closed:
            return list(self._undrained)
        self._closing = True  # no RETRACTs: they would outlive us
        kept = self._drain(list(self._transfers))
        self._closed = True
        self._prune_orphans()
        undrained = sorted({*kept, *(t.tid for t in self._orphans)})
        self._undrained = undrained
        if undrained:
            log.warning(
                "ucx transport closed with %d transfers UCX has not released; keeping its "
                "region and UCX objects alive on purpose", len(undrained)
            )
            _leak(self)
        else:
            self._teardown()
        return list(undrained)

    # -- internals: submit side -------------------------------------------------------------

    def _active(self, peer_id: str) -> _Peer:
        if self._closed:
            raise TransferSubmitError("the ucx transport is closed")
        peer = self._peers.get(peer_id)
        if peer is None:
            raise TransferSubmitError(f"unknown peer {peer_id!r}")
        if peer.dead:
            raise TransferSubmitError(f"peer {peer_id!r} is unreachable (UCX endpoint failed)")
        return peer

    def _register(self, t: _Transfer) -> None:
        self._transfers[t.tid] = t
        t.peer.transfers[t.tid] = t

    def _watch(self, t: _Transfer) -> None:
        """Have ``poll`` advance ``t`` until it is forgotten."""
        self._watched[t.tid] = t

    def _expire(self, now: float) -> None:
        """Watch every transfer past its deadline. Transfers are registered in deadline order
        (one timeout for all) and only watched ones get an earlier deadline (``_drain``), so
        the scan stops at the first unexpired one: O(1) per poll plus what expired."""
        for t in self._transfers.values():
            if t.deadline >= now:
                return
            self._watched[t.tid] = t

    def _post_deferred(self, peer: _Peer) -> None:
        """Post the peer's waiting writes whose slots all have an unconsumed EXPECT round.

        Writes go in submit order per slot: one still waiting holds its slots for later ones.
        """
        if peer.link_out is None or not peer.deferred:
            return
        waiting: list[_Write] = []
        held: set[int] = set()
        for write in peer.deferred:
            gens = peer.slot_gen[write.dst]
            if gens.all() and not (held and held.intersection(write.dst.tolist())):
                peer.slot_gen[write.dst] = 0
                self._post(peer, write, gens.astype(np.int64))
            else:
                waiting.append(write)
                held.update(write.dst.tolist())
        peer.deferred = waiting

    def _post(self, peer: _Peer, write: _Write, gens: IntArray) -> None:
        assert peer.link_out is not None and self._blocks is not None
        starts, dsts, lengths, run_gens = plan_runs(
            write.src, write.dst, gens, min(self._max_run, peer.desc.max_run)
        )
        seq = peer.next_seq
        peer.next_seq = (seq + 1) & tags.SEQ_MASK
        header = np.frombuffer(
            wire.encode_header(self._instance, dsts, lengths, run_gens), np.uint8
        )
        write.keep = header
        write.posted = True
        write.seq = seq
        peer.posts[seq] = write
        self._watch(write)
        tag, array, blocks, send = self._tag, self._array, self._blocks, peer.ep.tag_send
        link = peer.link_out
        try:
            write.requests.append(send(array(header), tag(tags.header_tag(link, seq))))
            first = tags.run_tag(link, seq, 0)
            for run, (s, d, n, g) in enumerate(zip(
                starts.tolist(), dsts.tolist(), lengths.tolist(), run_gens.tolist(), strict=True
            )):
                to = tags.slot_tag(link, g, d) if n == 1 else first + run
                write.requests.append(send(array(blocks[s:s + n]), tag(to)))
        except Exception as exc:  # a failed endpoint refuses new sends
            write.error = f"UCX refused a send ({type(exc).__name__}: {exc})"

    # -- internals: progress ----------------------------------------------------------------

    def _pump(self) -> None:
        """All I/O: progress UCX, take inbound control messages, drain rejected payload."""
        worker = self._worker
        worker.progress()
        self._take_control(tags.NOTICE)
        self._take_control(tags.HEADER)
        self._drain_poisoned()
        worker.progress()
        self._handle_inbox()
        for peer in self._peers.values():
            if peer.transfers and not peer.dead and not peer.ep.alive:
                peer.dead = True
                self._watched.update(peer.transfers)
        if self._orphans:
            self._prune_orphans()
        if self._drains:
            self._drains = [r for r in self._drains if not r.completed]
        if self._loose:
            self._loose = [(r, keep) for r, keep in self._loose if not r.completed]

    def _take_control(self, kind: int) -> None:
        probe = self._worker.tag_probe
        tag, mask = self._tag(tags.kind_tag(kind)), self._mask(tags.KIND_MASK)
        limit = self._control_limit
        for _ in range(_INBOX_BATCH):
            found = probe(tag, mask, remove=True)
            if not found.matched:
                return
            size = found.length
            buf = np.empty(size if size <= limit else 1, np.uint8)  # too big: truncated, dropped
            req = self._worker.tag_recv_with_handle(self._array(buf), found)
            self._inbox.append((kind, found.sender_tag.value, req, buf))

    def _handle_inbox(self) -> None:
        """Handle arrived control messages in arrival order; post writes they unblock after
        the whole batch (a RETRACT or newer EXPECT right behind an EXPECT must count)."""
        inbox = self._inbox
        unblocked: dict[int, _Peer] = {}
        while inbox and inbox[0][2].completed:
            kind, tag, req, buf = inbox.popleft()
            _, link, seq, _ = tags.split(tag)
            try:
                if req.status != _OK:
                    raise ValueError(f"UCX status {req.status}")
                if kind == tags.NOTICE:
                    peer = self._on_notice(wire.decode_notice(buf.tobytes()))
                    if peer is not None:
                        unblocked[id(peer)] = peer
                else:
                    self._on_header(link, seq, wire.decode_header(buf.tobytes()))
            except ValueError as exc:
                log.warning("ucx: dropped a malformed %s message: %s",
                            "NOTICE" if kind == tags.NOTICE else "HEADER", exc)
                if kind == tags.HEADER:  # runs we can still name; singles go unmatched
                    self._poison(tags.run_tag(link, seq, 0), tags.WRITE_MASK, -1)
                    self._verdict(link, seq, _ALL_RUNS, self._by_link.get(link))
        for peer in unblocked.values():
            if self._peers.get(peer.peer_id) is peer:
                self._post_deferred(peer)

    def _on_notice(self, notice: wire.Notice) -> _Peer | None:
        """Apply a consumer's NOTICE; returns the peer when it was an EXPECT."""
        peer = self._by_instance.get(notice.instance)
        if peer is None:  # its add_peer may still come: keep a few, in order
            if not isinstance(notice, wire.Verdict):
                early = self._early.setdefault(notice.instance, [])
                early.append(notice)
                del early[:-_EARLY_LIMIT]
                while len(self._early) > _EARLY_LIMIT:
                    del self._early[next(iter(self._early))]
            return None
        if isinstance(notice, wire.Verdict):
            write = peer.posts.pop(notice.seq, None)
            if write is not None:
                if notice.refused:
                    write.error = f"the peer discarded {notice.refused} run(s): no live round"
                else:
                    write.accepted = True
            return None
        slots = notice.slots
        if len(slots) and slots.max() >= peer.desc.num_blocks:
            raise ValueError(f"notice from peer {peer.peer_id!r} names slots outside its region")
        if isinstance(notice, wire.Retract):
            slots = slots[peer.slot_gen[slots] == notice.gen]
            peer.slot_gen[slots] = 0
            return None
        if notice.link > tags.MAX_LINK:
            raise ValueError(f"EXPECT from peer {peer.peer_id!r} has link {notice.link}")
        if peer.link_out != notice.link:  # the peer (re-)registered us: older rounds are gone
            peer.slot_gen[:] = 0
            peer.link_out = notice.link
        peer.slot_gen[slots] = notice.gen
        return peer

    def _on_header(self, link: int, seq: int, header: wire.Header) -> None:
        peer = self._by_link.get(link)
        blocks = self._blocks
        if peer is None or self._peers.get(peer.peer_id) is not peer or blocks is None:
            # an old link of a peer we re-registered, or one we removed: refuse all of it
            self._refuse(link, seq, header, np.ones(len(header.starts), np.bool_),
                         self._by_instance.get(header.instance))
            return
        owner, claimed, transfers = self._slot_owner, self._claimed, self._transfers
        refused = np.zeros(len(header.starts), np.bool_)
        for run, (s, n, gen) in enumerate(zip(
            header.starts.tolist(), header.lengths.tolist(), header.gens.tolist(), strict=True
        )):
            fits = 0 < n <= self._max_run and s + n <= len(owner)
            t = transfers.get(int(owner[s])) if fits else None
            if isinstance(t, _Expect) and t.peer is peer:
                self._watch(t)  # claimed now, or broken by _take_run
            if (
                not isinstance(t, _Expect) or t.peer is not peer or t.gen != gen or t.stopping
                or (owner[s:s + n] != t.tid).any() or claimed[s:s + n].any()
                or (n > 1 and not self._take_run(t, link, seq, run, s, n))
            ):
                refused[run] = True
                continue
            claimed[s:s + n] = True
            t.unclaimed -= n
        self._refuse(link, seq, header, refused, peer)

    def _take_run(self, t: _Expect, link: int, seq: int, run: int, start: int, n: int) -> bool:
        """Swap the pre-posted receives of ``n`` slots for one receive over the whole run.

        False (the run is refused) when one of them has already matched a SLOT message."""
        assert self._blocks is not None and self._lib.cancel is not None
        positions = self._slot_pos[start:start + n].tolist()
        singles = [t.singles[p] for p in positions]
        if any(req.completed for req in singles):
            return False
        for req in singles:
            self._lib.cancel(req)
        t.replaced[positions] = [req.completed for req in singles]
        if not t.replaced[positions].all():  # a single matched meanwhile: the write is broken
            t.error = "the producer sent a block both alone and in a run"
            return False
        tag = tags.run_tag(link, seq, run)
        try:
            t.requests.append(t.peer.ep.tag_recv(
                self._array(self._blocks[start:start + n]), self._tag(tag)
            ))
        except Exception as exc:
            t.error = f"UCX refused a receive ({type(exc).__name__}: {exc})"
            return False
        t.run_tags.append(tag)
        return True

    def _refuse(self, link: int, seq: int, header: wire.Header,
                refused: npt.NDArray[np.bool_], sender: _Peer | None) -> None:
        """Answer the HEADER of write (link, seq) with a VERDICT; drain what we refused."""
        count = int(refused.sum())
        if count:
            log.info("ucx: discarding %d run(s) of write %d on link %d: no live round wants "
                     "them", count, seq, link)
            for run in np.flatnonzero(refused).tolist():
                n = int(header.lengths[run])
                self._poison(
                    tags.slot_tag(link, int(header.gens[run]), int(header.starts[run]))
                    if n == 1 else tags.run_tag(link, seq, run)
                )
        self._verdict(link, seq, count, sender)

    def _verdict(self, link: int, seq: int, refused: int, sender: _Peer | None) -> None:
        if sender is not None and sender.ep is not None:
            self._send_notice(sender, wire.encode_verdict(self._instance, seq, refused))

    def _send_notice(self, peer: _Peer, payload: bytes) -> None:
        """Send a NOTICE nobody waits for (its payload is kept until UCX is done with it)."""
        try:
            self._loose.append(self._notify(peer, payload))
        except Exception as exc:  # a failed endpoint: the peer learns nothing, deadlines rule
            log.info("ucx: notice to peer %r not sent: %s", peer.peer_id, exc)

    def _notify(self, peer: _Peer, payload: bytes) -> tuple[Any, npt.NDArray[np.uint8]]:
        data = np.frombuffer(payload, np.uint8)
        return peer.ep.tag_send(self._array(data), self._tag(tags.kind_tag(tags.NOTICE))), data

    def _poison(self, tag: int, mask: int = (1 << 64) - 1, count: int = 1) -> None:
        """Drain ``count`` (-1: any number, until expiry) not-yet-received messages matching
        ``tag``/``mask`` into scratch."""
        self._poisoned[(tag, mask)] = [time.monotonic() + min(self._timeout, 300.0), count]

    def _drain_poisoned(self) -> None:
        if not self._poisoned:
            return
        if self._scratch is None:
            self._scratch = np.empty(self._max_run * self._block_len, np.uint8)
        now = time.monotonic()
        for key, entry in list(self._poisoned.items()):
            tag, mask = self._tag(key[0]), self._mask(key[1])
            while entry[1] != 0:
                found = self._worker.tag_probe(tag, mask, remove=True)
                if not found.matched:
                    break
                sink = self._array(self._scratch[: min(found.length, len(self._scratch))])
                self._drains.append(self._worker.tag_recv_with_handle(sink, found))
                entry[1] -= 1
            if entry[1] == 0 or now > entry[0]:
                del self._poisoned[key]

    def _advance(self, t: _Transfer, now: float) -> bool | None:
        """True done, False failed, None still in flight (never reports a live receive)."""
        if isinstance(t, _Write):
            if not t.posted:
                if now > t.deadline or t.peer.dead:
                    t.peer.deferred.remove(t)
                    return False
                return None
            if t.settle() and t.accepted and t.error is None:
                return True
            if t.error is not None or now > t.deadline:
                return False  # the sends only read our memory: orphaned by _forget
            return None
        assert isinstance(t, _Expect)
        finished = t.settle()
        if not t.stopping:
            if t.error is None and finished and t.unclaimed == 0:
                return True
            if t.error is not None or now > t.deadline or t.peer.dead:
                self._stop(t, t.error or ("peer unreachable" if t.peer.dead else "timed out"))
                finished = t.settle()
        return False if t.stopping and finished else None

    def _stop(self, t: _Expect, reason: str) -> None:
        """Cancel the expectation's receives and give back its unclaimed slots (once).

        Payload the producer already announced for a receive we cancelled will still come:
        it is drained. A RETRACT tells the producer about slots it has not written yet."""
        if t.stopping:
            return
        t.stopping = True
        t.error = t.error or reason
        self._watch(t)
        cancel, claimed = self._lib.cancel, self._claimed
        if cancel is not None:
            base = tags.slot_tag(t.peer.link_in, t.gen, 0)
            for i, (slot, req) in enumerate(zip(t.slots.tolist(), t.singles, strict=True)):
                if not t.replaced[i] and not req.completed:
                    cancel(req)
                    if req.completed and claimed[slot]:
                        self._poison(base | slot)
            for tag, req in zip(t.run_tags, t.requests, strict=True):
                if not req.completed:
                    cancel(req)
                    if req.completed:
                        self._poison(tag)
        unclaimed = t.slots[(self._slot_owner[t.slots] == t.tid) & ~claimed[t.slots]]
        self._slot_owner[unclaimed] = 0
        peer = t.peer
        if len(unclaimed) and not self._closing and self._peers.get(peer.peer_id) is peer \
                and not peer.dead:
            self._send_notice(peer, wire.encode_retract(self._instance, t.gen, unclaimed))

    def _unpost(self, t: _Expect) -> None:
        """Undo a half-posted expectation (its EXPECT never left: nothing can match)."""
        cancel = self._lib.cancel
        for req in t.singles:
            if cancel is not None and not req.completed:
                cancel(req)
        if not all(req.completed for req in t.singles):
            self._orphans.append(t)

    def _stopped(self, t: _Transfer) -> bool:
        """True when nothing of ``t`` can still touch memory we give back by forgetting it."""
        if isinstance(t, _Write) and not t.posted:
            t.peer.deferred.remove(t)
            return True
        return t.settle()

    def _forget(self, t: _Transfer) -> None:
        del self._transfers[t.tid]
        self._watched.pop(t.tid, None)
        del t.peer.transfers[t.tid]
        if isinstance(t, _Write):
            if not t.posted and t in t.peer.deferred:
                t.peer.deferred.remove(t)
            if t.seq is not None and t.peer.posts.get(t.seq) is t:
                del t.peer.posts[t.seq]
        if isinstance(t, _Expect):
            mine = t.slots[self._slot_owner[t.slots] == t.tid]
            self._slot_owner[mine] = 0
            self._claimed[mine] = False
        if not t.settle():
            self._orphans.append(t)
        if isinstance(t, _Expect) and t.notice is not None:
            self._loose.append((t.notice, t.keep))
        peer = t.peer
        if not peer.transfers and self._peers.get(peer.peer_id) is not peer:
            self._release(peer)

    def _prune_orphans(self) -> None:
        self._orphans = [t for t in self._orphans if not t.settle()]

    def _drain(self, ids: list[int]) -> list[int]:
        """Wait-cancel ``ids`` and progress up to ``drain_timeout``; forget what drained.

        Sends still running when the drain ends are given the drain deadline as their
        deadline: they only read our memory, so the next poll fails (and orphans) them.
        """
        kept = set(self.cancel(ids, CancelMode.WAIT))
        deadline = time.monotonic() + self._opts.drain_timeout
        while kept:
            self._pump()
            for tid in list(kept):
                t = self._transfers.get(tid)
                if t is None or self._stopped(t):
                    if t is not None:
                        self._forget(t)
                    kept.discard(tid)
            if time.monotonic() >= deadline:
                break
        for tid in kept:
            t = self._transfers[tid]
            t.deadline = min(t.deadline, deadline)
            self._watch(t)  # out of deadline order now
        return sorted(kept)

    def _release(self, peer: _Peer) -> None:
        """Drop a removed peer whose transfers are all gone (its endpoint closes on release)."""
        retired = self._retired.get(peer.peer_id)
        if retired is not None and peer in retired:
            retired.remove(peer)
            if not retired:
                del self._retired[peer.peer_id]
        if self._by_link.get(peer.link_in) is peer:
            del self._by_link[peer.link_in]
        peer.ep = None

    def _teardown(self) -> None:
        """Close with nothing in flight: cancel our own control receives, drop UCX objects.

        A control receive UCX will not confirm cancelled keeps the worker alive (leaked)."""
        cancel = self._lib.cancel
        receives = [req for _, _, req, _ in self._inbox] + self._drains
        if cancel is not None:
            for req in receives:
                if not req.completed:
                    cancel(req)
        self._worker.progress()
        sends = [(r, keep) for r, keep in self._loose if not r.completed]
        if sends or not all(req.completed for req in receives):
            _leak((self._worker, self._ctx, receives, list(self._inbox), self._scratch, sends))
        for peer in [*self._peers.values(), *(p for ps in self._retired.values() for p in ps)]:
            peer.ep = None
        self._peers.clear()
        self._retired.clear()
        self._by_link.clear()
        self._by_instance.clear()
        self._inbox.clear()
        self._drains.clear()
        self._orphans.clear()
        self._loose.clear()
        self._transfers.clear()
        self._watched.clear()
        self._scratch = None
        self._blocks = None
        self._worker = None
        self._ctx = None


def _indexes(values: Sequence[int], bound: int, what: str) -> IntArray:
    arr = np.asarray(values)
    if arr.size == 0:
        return np.empty(0, np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise TransferSubmitError(f"{what} block indexes must be a flat sequence of integers")
    arr = arr.astype(np.int64, copy=False)
    bad = (arr < 0) | (arr >= bound)
    if bad.any():
        raise TransferSubmitError(
            f"{what} block index {int(arr[bad][0])} is outside 0..{bound - 1}"
        )
    return arr


def _has_duplicates(arr: IntArray) -> bool:
    return len(arr) > 1 and len(np.unique(arr)) != len(arr)


def _leak(obj: object) -> None:
    """Keep ``obj`` alive for the life of the process (UCX may still touch its memory)."""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(obj))
