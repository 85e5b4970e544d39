"""Throughput of raw NIXL, of the p2pkv ``nixl`` transport alone, and of memcpy, comparably.

- :class:`RawNixl` drives NIXL with no p2pkv in the timed path: the same agent setup and the
  same prepared (strided) descriptor lists as the transport, progress thread off, then
  ``make_prepped_xfer("READ", ...)`` + ``transfer`` per read and ``check_xfer_state`` per
  poll. It is duck-typed like a ``DataTransport`` (``create``, ``descriptor``, ``add_peer``,
  ``read_blocks``, ``progress``, ``poll``, ``close``; the ``p2pkv_bench_baselines`` hook
  offers it to ``p2pkv bench`` as ``raw nixl``), so one loop times both.
- :class:`RawNixlWrite` (``raw nixl write``, offered as RawNixl's ``write`` variant) moves
  the same blocks the other way round, as the transport's staged lane does: the reader asks
  with one NIXL notification, the *source* posts a WRITE straight into the reader's slots
  carrying a completion notification, and the reader's ``poll`` reports the read done when
  that notification arrives (no staging pool, no copy, no checks). Over ``tcp`` UCX emulates
  a READ in software, served by the target's worker, while a WRITE is the source's own
  request: this is the ceiling for the staged lane.
- :func:`measure` reads ``num_blocks`` blocks of a child's region into scattered slots of this
  process (a fixed random permutation; wire 2.0: the consumer posts the reads), once per
  repetition and endpoint kind, the kinds back to back within a repetition (in alternating
  order) so they see the same machine. A repetition is timed from ``read_blocks`` to the
  ``poll`` that reports it done. Every repetition is verified here: the child stamps each
  source block afresh (untimed), and each destination slot must hold its stamp; the first
  and last repetition compare every byte. On one host the p2pkv transport reads directly
  (UCX ``cma``), as raw NIXL does; it stages only for peers it cannot read from that way.
- :func:`run_raw`, :func:`run_transport` and :func:`run_memcpy` (the same scattered blocks
  copied block by block with numpy in one process) return seconds per repetition.

``python -m p2pkv_nixl.baseline`` prints GB/s (10^9 bytes/s) of the three for 256 blocks of
64 KiB, 256 KiB, 1 MiB and 2 MiB, and the ratios, twice: by wall time, and by the reading
thread's CPU time (on one host the reader does the copy itself, over UCX ``cma``), which stays
steady when other processes compete for the cores. Set ``UCX_NET_DEVICES=lo`` on one host.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import struct
import sys
import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any, ClassVar

import numpy as np
import numpy.typing as npt
from p2pkv.child import Child
from p2pkv.contracts import DataSettings, PollResult
from p2pkv.errors import TransferSubmitError, TransportUnavailable

from p2pkv_nixl import library
from p2pkv_nixl.agent import block_dlist, open_agent, region_array, register_region
from p2pkv_nixl.descriptor import RegionDescriptor
from p2pkv_nixl.options import NixlOptions
from p2pkv_nixl.transport import NixlDataTransport

__all__ = [
    "RawNixl",
    "RawNixlWrite",
    "main",
    "measure",
    "run_memcpy",
    "run_raw",
    "run_transport",
]

KiB = 1024
MiB = 1024 * KiB
SIZES = (64 * KiB, 256 * KiB, 1 * MiB, 2 * MiB)
_PEER = "target"


class RawNixl:
    """NIXL without p2pkv (no validation, no bookkeeping beyond an id -> handle map).

    Same agent setup and descriptor lists as ``NixlDataTransport``; ``enable_prog_thread``
    off. Driver-thread only. Not for production: it checks nothing.
    """

    name = "nixl"
    variants: ClassVar[Mapping[str, type[Any]]] = {}
    """Further baselines of the library the bench measures beside this one, as series
    ``raw nixl <variant>``: ``write`` (:class:`RawNixlWrite`, set below)."""

    @classmethod
    def availability(cls) -> TransportUnavailable | None:
        return library.problem()

    @classmethod
    def create(cls, settings: DataSettings) -> RawNixl:
        return cls(settings)

    def __init__(self, settings: DataSettings) -> None:
        self._array = region_array(settings)
        self._agent, name = open_agent(library.load(), NixlOptions())
        region = register_region(self._agent, name, self._array, settings.block_len)
        self._registrations, self._local = region.registrations, region.dlist
        self._descriptor = region.descriptor
        self._peers: dict[str, tuple[Any, Any]] = {}
        self._inflight: dict[int, tuple[str, Any]] = {}
        self._ids = itertools.count(1)

    def descriptor(self) -> bytes:
        return self._descriptor

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        desc = RegionDescriptor.decode(descriptor, peer_id)
        name = self._agent.add_remote_agent(desc.metadata)
        dlist = self._agent.prep_xfer_dlist(
            name, block_dlist(desc.base, desc.slices, desc.block_len), "DRAM"
        )
        self._peers[peer_id] = (name, dlist)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """The peer's blocks ``remote_idxs[i]`` into ours ``local_idxs[i]``, straight into
        the slots (no staging, no checks)."""
        handle = self._agent.make_prepped_xfer(
            "READ",
            self._local,
            np.asarray(local_idxs, dtype=np.int32),
            self._peers[peer_id][1],
            np.asarray(remote_idxs, dtype=np.int32),
        )
        if self._agent.transfer(handle) == "ERR":
            handle.release()
            raise TransferSubmitError("raw nixl: read failed at submit")
        transfer_id = next(self._ids)
        self._inflight[transfer_id] = (peer_id, handle)
        return transfer_id

    def progress(self) -> None:
        self._agent.get_new_notifs()

    def poll(self, peer_id: str | None = None) -> PollResult:
        done: list[int] = []
        failed: list[int] = []
        for transfer_id, (peer, handle) in list(self._inflight.items()):
            if peer_id is not None and peer != peer_id:
                continue
            state = self._agent.check_xfer_state(handle)
            if state != "PROC":
                handle.release()
                del self._inflight[transfer_id]
                (done if state == "DONE" else failed).append(transfer_id)
        return PollResult(done, failed)

    def close(self) -> list[int]:
        for _, handle in self._inflight.values():
            handle.release()
        self._inflight.clear()
        for name, dlist in self._peers.values():
            dlist.release()
            self._agent.remove_remote_agent(name)
        self._peers.clear()
        self._local.release()
        for registration in self._registrations:
            self._agent.deregister_memory(registration)
        return []


_ASK = struct.Struct("<6sQI")
"""Reader -> source: prefix, request id, block count; then the source's block indexes and the
reader's slot indexes, ``count`` little-endian uint32 each."""
_ASK_PREFIX, _DONE, _FAILED = b"p2kvBA", b"p2kvBD", b"p2kvBF"
_ID = struct.Struct("<Q")
_DRAIN_SECONDS = 5.0
"""How long ``close`` progresses the source's WRITEs still running before releasing them."""


def _agent_name(name: str | bytes) -> str:
    return name.decode() if isinstance(name, bytes) else str(name)


class RawNixlWrite(RawNixl):
    """Raw NIXL WRITEs posted by the source into the reader's slots, asked for by the reader.

    The same agent setup and prepared descriptor lists as :class:`RawNixl`; both sides are an
    instance of this class and must add each other. ``read_blocks`` (reader) sends the
    source's agent one notification: a request id and both index lists. The source's
    ``progress`` (or ``poll``) posts ``make_prepped_xfer("WRITE", its blocks, the reader's
    slots, notif_msg=<id>)`` and releases its WRITEs once NIXL reports them ended. The reader's
    ``poll`` reports the request done once that notification arrives (NIXL sends it after the
    WRITE's data), failed if the source answers that it could not post the WRITE. Nothing is
    checked; not for production. Driver-thread only.
    """

    variants: ClassVar[Mapping[str, type[Any]]] = {}

    def __init__(self, settings: DataSettings) -> None:
        super().__init__(settings)
        self._regions: dict[str, Any] = {}
        """A peer's agent name -> its region's prepared list (where our WRITEs land)."""
        self._asked: dict[int, str] = {}
        """Our request id -> its peer, until ``poll`` reports it."""
        self._ended: dict[int, bool] = {}
        """Our request id -> whether it succeeded, once its answer arrived."""
        self._serving: list[Any] = []
        """Handles of the WRITEs we posted for a peer's requests, until NIXL ends them."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        super().add_peer(peer_id, descriptor)
        name, dlist = self._peers[peer_id]
        self._regions[_agent_name(name)] = dlist

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        """Ask the peer to WRITE its blocks ``remote_idxs[i]`` into ours ``local_idxs[i]``."""
        request = next(self._ids)
        message = b"".join(
            (
                _ASK.pack(_ASK_PREFIX, request, len(local_idxs)),
                np.asarray(remote_idxs, dtype="<u4").tobytes(),
                np.asarray(local_idxs, dtype="<u4").tobytes(),
            )
        )
        self._agent.send_notif(_agent_name(self._peers[peer_id][0]), message)
        self._asked[request] = peer_id
        return request

    def progress(self) -> None:
        """Take notifications (serve requests, note answers); release ended WRITEs."""
        for sender, messages in self._agent.get_new_notifs().items():
            for raw in messages:
                message = bytes(raw)
                if message.startswith(_ASK_PREFIX):
                    self._serve(_agent_name(sender), message)
                elif message[:6] in (_DONE, _FAILED):
                    self._ended[_ID.unpack_from(message, 6)[0]] = message.startswith(_DONE)
        self._serving = [handle for handle in self._serving if not self._released(handle)]

    def _serve(self, sender: str, message: bytes) -> None:
        """Post the WRITE a request asks for; answer a failure if NIXL refuses it."""
        _, request, count = _ASK.unpack_from(message)
        idxs = np.frombuffer(message, "<u4", 2 * count, _ASK.size).astype(np.int32)
        handle = self._agent.make_prepped_xfer(
            "WRITE",
            self._local,
            idxs[:count],
            self._regions[sender],
            idxs[count:],
            notif_msg=_DONE + _ID.pack(request),
        )
        if self._agent.transfer(handle) == "ERR":
            handle.release()
            self._agent.send_notif(sender, _FAILED + _ID.pack(request))
            return
        self._serving.append(handle)

    def _released(self, handle: Any) -> bool:
        if self._agent.check_xfer_state(handle) == "PROC":
            return False
        handle.release()
        return True

    def poll(self, peer_id: str | None = None) -> PollResult:
        self.progress()
        done: list[int] = []
        failed: list[int] = []
        for request, ok in list(self._ended.items()):
            peer = self._asked.get(request)
            if peer is None:  # not a request of ours: nothing to report
                del self._ended[request]
                continue
            if peer_id is not None and peer != peer_id:
                continue
            del self._ended[request], self._asked[request]
            (done if ok else failed).append(request)
        return PollResult(done, failed)

    def close(self) -> list[int]:
        """Progress our WRITEs still running for up to :data:`_DRAIN_SECONDS`, release them,
        then everything else (requests still unanswered are dropped)."""
        deadline = time.monotonic() + _DRAIN_SECONDS
        while self._serving and time.monotonic() < deadline:
            self.progress()
        for handle in self._serving:
            try:
                handle.release()
            except Exception:  # NIXL could not cancel it: it goes with the agent
                pass
        self._serving.clear()
        self._asked.clear()
        self._ended.clear()
        return super().close()


RawNixl.variants = {"write": RawNixlWrite}


# -- block contents ----------------------------------------------------------------------


def _block(seed: int, index: int, block_len: int) -> npt.NDArray[np.uint8]:
    return np.frombuffer(np.random.default_rng([seed, index]).bytes(block_len), dtype=np.uint8)


def _fill(blocks: npt.NDArray[np.uint8], seed: int) -> None:
    for i in range(blocks.shape[0]):
        blocks[i] = _block(seed, i, blocks.shape[1])


def _stamp(blocks: npt.NDArray[np.uint8], tag: int) -> None:
    """Write ``tag << 32 | i`` into the first 8 bytes of block ``i`` (a fresh mark per rep)."""
    marks = (np.uint64(tag) << np.uint64(32)) + np.arange(blocks.shape[0], dtype=np.uint64)
    blocks[:, :8] = marks.view(np.uint8).reshape(-1, 8)


def _verify(
    dest: npt.NDArray[np.uint8], slots: npt.NDArray[np.int64], seed: int, tag: int, every_byte: bool
) -> str:
    """'' if ``dest[slots[i]]`` holds source block ``i`` stamped ``tag``; else what is wrong."""
    expected = (np.uint64(tag) << np.uint64(32)) + np.arange(len(slots), dtype=np.uint64)
    marks = np.ascontiguousarray(dest[slots, :8]).view(np.uint64).ravel()
    wrong = np.flatnonzero(marks != expected)
    if len(wrong):
        return f"{len(wrong)} block(s) without this repetition's stamp, first: source {wrong[0]}"
    if every_byte:
        for i, slot in enumerate(slots):
            if not np.array_equal(dest[slot, 8:], _block(seed, i, dest.shape[1])[8:]):
                return f"source block {i} differs in slot {slot}"
    return ""


def _slots(seed: int, num_blocks: int) -> npt.NDArray[np.int64]:
    return np.random.default_rng(seed).permutation(num_blocks)


# -- the source process ------------------------------------------------------------------


def _serve(
    conn: Connection, classes: Sequence[type[Any]], block_len: int, num_blocks: int, seed: int
) -> None:
    """Child: one source region, one endpoint of each class over it, progressed between
    requests (over ``tcp`` its worker serves the reads). ``("stamp", tag)`` stamps every
    source block afresh and answers ``"ok"``; ``None`` ends it."""
    region = np.empty(num_blocks * block_len, dtype=np.uint8)
    blocks = region.reshape(num_blocks, block_len)
    _fill(blocks, seed)
    endpoints = [cls.create(DataSettings(region.data, block_len)) for cls in classes]
    conn.send([endpoint.descriptor() for endpoint in endpoints])
    while True:
        for endpoint in endpoints:
            endpoint.progress()
        if conn.poll(0):
            request = conn.recv()
            if request is None:
                break
            _stamp(blocks, request[1])
            conn.send("ok")
    for endpoint in endpoints:
        endpoint.close()


# -- measurements ------------------------------------------------------------------------


def _wait_done(endpoint: Any, transfer_id: int, deadline: float) -> None:
    while True:
        result = endpoint.poll(_PEER)
        if transfer_id in result.done:
            return
        if transfer_id in result.failed:
            raise RuntimeError(f"transfer {transfer_id} failed")
        if time.monotonic() > deadline:
            raise TimeoutError(f"transfer {transfer_id} not done in time")


def measure(
    kinds: Mapping[str, type[Any]],
    block_len: int,
    num_blocks: int,
    repeats: int,
    warmup: int,
    *,
    seed: int = 0,
    timeout: float = 60.0,
    cpu: dict[str, list[float]] | None = None,
) -> dict[str, list[float]]:
    """Seconds per repetition for each endpoint kind (label -> class), measured side by side.

    ``cpu``, if given, receives per label this thread's CPU seconds (user + system) per
    repetition: on one host the reader's own thread does the copy (UCX ``cma``), so this is
    the cost of the read with the waiting for a core left out (steady on a shared machine).
    Raises ``RuntimeError`` if a read fails or a byte is wrong, ``TimeoutError`` past
    ``timeout`` seconds for any one step.
    """
    dest = np.zeros(num_blocks * block_len, dtype=np.uint8)  # pages faulted in, untimed
    blocks = dest.reshape(num_blocks, block_len)
    slots = _slots(seed, num_blocks)
    local, remote = slots.tolist(), list(range(num_blocks))
    classes = list(kinds.values())
    with Child(_serve, classes, block_len, num_blocks, seed, name="p2pkv-nixl-baseline") as child:
        descriptors = child.recv(timeout, "endpoint descriptors")
        endpoints = [cls.create(DataSettings(dest.data, block_len)) for cls in classes]
        try:
            for endpoint, descriptor in zip(endpoints, descriptors, strict=True):
                endpoint.add_peer(_PEER, descriptor)
            times: dict[str, list[float]] = {label: [] for label in kinds}
            tags = itertools.count(1)
            total = warmup + repeats
            pairs = list(zip(kinds, endpoints, strict=True))
            for rep in range(total):
                for label, endpoint in pairs if rep % 2 == 0 else reversed(pairs):
                    tag = next(tags)
                    child.request(("stamp", tag), timeout, "the source blocks stamped")
                    start, start_cpu = time.perf_counter(), time.thread_time()
                    transfer_id = endpoint.read_blocks(_PEER, local, remote)
                    _wait_done(endpoint, transfer_id, time.monotonic() + timeout)
                    elapsed, used = time.perf_counter() - start, time.thread_time() - start_cpu
                    problem = _verify(blocks, slots, seed, tag, rep in (0, total - 1))
                    if problem:
                        raise RuntimeError(f"{label}, {block_len} B blocks: {problem}")
                    if rep >= warmup:
                        times[label].append(elapsed)
                        if cpu is not None:
                            cpu.setdefault(label, []).append(used)
        finally:
            for endpoint in endpoints:
                endpoint.close()
            child.send(None)
    return times


def run_raw(block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    """Seconds per repetition of raw NIXL reading ``num_blocks`` blocks of a child into
    scattered slots here."""
    return measure({"raw": RawNixl}, block_len, num_blocks, repeats, warmup)["raw"]


def run_transport(block_len: int, num_blocks: int, repeats: int, warmup: int) -> list[float]:
    """The same as :func:`run_raw` through the p2pkv ``nixl`` transport."""
    return measure({"p2pkv": NixlDataTransport}, block_len, num_blocks, repeats, warmup)["p2pkv"]


def run_memcpy(
    block_len: int,
    num_blocks: int,
    repeats: int,
    warmup: int,
    *,
    seed: int = 0,
    cpu: list[float] | None = None,
) -> list[float]:
    """Seconds per repetition copying the same scattered blocks with numpy in one process
    (``cpu`` receives thread CPU seconds per repetition, as in :func:`measure`)."""
    source = np.empty((num_blocks, block_len), dtype=np.uint8)
    _fill(source, seed)
    dest = np.empty_like(source)
    dest.fill(0)
    pairs = list(enumerate(_slots(seed, num_blocks).tolist()))
    times: list[float] = []
    for rep in range(warmup + repeats):
        start, start_cpu = time.perf_counter(), time.thread_time()
        for i, slot in pairs:
            dest[slot] = source[i]
        elapsed, used = time.perf_counter() - start, time.thread_time() - start_cpu
        if rep >= warmup:
            times.append(elapsed)
            if cpu is not None:
                cpu.append(used)
    if not np.array_equal(dest[_slots(seed, num_blocks)], source):
        raise RuntimeError("memcpy baseline copied wrong bytes")
    return times


# -- command line ------------------------------------------------------------------------


def _gbps(nbytes: int, seconds: Sequence[float]) -> float:
    return nbytes / statistics.median(seconds) / 1e9


def paired_ratio(slow: Sequence[float], fast: Sequence[float]) -> float:
    """Median over repetitions of ``slow[i] / fast[i]``: throughput of the ``fast`` series
    relative to ``slow``'s, pair by pair, so load that drifts between repetitions (a shared
    machine) cancels out instead of landing on one series."""
    return statistics.median(s / f for s, f in zip(slow, fast, strict=True))


def compare(
    sizes: Sequence[int], num_blocks: int, repeats: int, warmup: int
) -> list[dict[str, Any]]:
    """One row per block size: GB/s of raw nixl, p2pkv nixl and memcpy by wall time and by
    initiator CPU time, and the ratios (p2pkv/raw paired repetition by repetition)."""
    rows = []
    for block_len in sizes:
        nbytes = block_len * num_blocks
        cpu: dict[str, list[float]] = {"memcpy": []}
        wall = measure(
            {"raw nixl": RawNixl, "p2pkv nixl": NixlDataTransport},
            block_len,
            num_blocks,
            repeats,
            warmup,
            cpu=cpu,
        )
        wall["memcpy"] = run_memcpy(block_len, num_blocks, repeats, warmup, cpu=cpu["memcpy"])
        row: dict[str, Any] = {"block_bytes": block_len, "blocks": num_blocks}
        for basis, seconds in (("", wall), ("_cpu", cpu)):
            raw, p2pkv, memcpy = (
                _gbps(nbytes, seconds[k]) for k in ("raw nixl", "p2pkv nixl", "memcpy")
            )
            row.update(
                {
                    f"raw_nixl{basis}_gbps": raw,
                    f"p2pkv_nixl{basis}_gbps": p2pkv,
                    f"memcpy{basis}_gbps": memcpy,
                    f"p2pkv_over_raw{basis}": paired_ratio(
                        seconds["raw nixl"], seconds["p2pkv nixl"]
                    ),
                    f"raw_over_memcpy{basis}": raw / memcpy,
                    f"p2pkv_over_memcpy{basis}": p2pkv / memcpy,
                }
            )
        rows.append(row)
    return rows


def _size(text: str) -> int:
    units = {"k": KiB, "m": MiB}
    text = text.strip().lower().removesuffix("ib").removesuffix("b")
    if text and text[-1] in units:
        return int(float(text[:-1]) * units[text[-1]])
    return int(text)


def _label(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes % MiB == 0 else f"{nbytes // KiB} KiB"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m p2pkv_nixl.baseline",
        description="GB/s of raw NIXL, the p2pkv nixl transport and memcpy, side by side.",
    )
    parser.add_argument(
        "--sizes", default="64K,256K,1M,2M", help="block sizes (default %(default)s)"
    )
    parser.add_argument("--blocks", type=int, default=256, help="blocks per transfer (default 256)")
    parser.add_argument("--repeats", type=int, default=15, help="timed repetitions (default 15)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed repetitions (default 3)")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    args = parser.parse_args(argv)
    problem = library.problem()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 1
    sizes = [_size(s) for s in args.sizes.split(",") if s.strip()]
    rows = compare(sizes, args.blocks, args.repeats, args.warmup)
    if args.json:
        json.dump(rows, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0
    print(
        f"{args.blocks} scattered blocks per transfer, median of {args.repeats} repetitions; "
        f"GB/s = 1e9 B/s; p2pkv/raw is the median of per-repetition ratios (the two run back "
        f"to back). 'cpu' divides by the initiator thread's CPU time (it does the copy), "
        f"which waiting for a core on a busy machine does not inflate."
    )
    header = (
        "block",
        "basis",
        "raw nixl",
        "p2pkv nixl",
        "memcpy",
        "p2pkv/raw",
        "raw/memcpy",
        "p2pkv/memcpy",
    )
    print("  ".join(f"{h:>11}" for h in header))
    for row in rows:
        for basis, name in (("", "wall"), ("_cpu", "cpu")):
            cells = (
                _label(row["block_bytes"]),
                name,
                f"{row[f'raw_nixl{basis}_gbps']:.2f}",
                f"{row[f'p2pkv_nixl{basis}_gbps']:.2f}",
                f"{row[f'memcpy{basis}_gbps']:.2f}",
                f"{row[f'p2pkv_over_raw{basis}']:.3f}",
                f"{row[f'raw_over_memcpy{basis}']:.3f}",
                f"{row[f'p2pkv_over_memcpy{basis}']:.3f}",
            )
            print("  ".join(f"{c:>11}" for c in cells))
    return 0


if __name__ == "__main__":
    # run the imported module's main so the child pickles p2pkv_nixl.baseline._serve, not
    # __main__._serve
    from p2pkv_nixl.baseline import main as _main

    sys.exit(_main())
