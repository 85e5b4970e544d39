"""One side of ``p2pkv bench --large-region``: a data transport over a large region, in a
spawned process of its own.

The region comes from the transport class's ``allocate_region`` and is never written whole:
only the blocks a measurement fills (the producer) or reads into (the consumer) are touched,
so a region of many GiB costs the memory of those blocks (the side reports its RSS). Both
sides time ``create`` (the registration, with its slices) over the large region and over a
region of one block, so the report can tell the registration from the transport's fixed
setup. The producer side only progresses while a measurement runs (``begin``/``end``): a
two-sided transport (``ucx``) and nixl's staged lane serve reads from there.

Driven over a :class:`~p2pkv_tools.bench.harness.Helper` pipe by the bench process; the pipe
carries the bench's own commands only.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.contracts import DataSettings, DataTransport
from p2pkv.data_base import allocated_region
from p2pkv.errors import TransferBusy
from p2pkv.registry import default_registry

from p2pkv_tools.bench.harness import serve_built
from p2pkv_tools.demo.content import BlockRegion

__all__ = ["COMMANDS", "RegionSide", "run_side"]

COMMANDS = ("build", "add_peer", "fill", "begin", "end", "read", "verify", "rss")
"""What the bench may ask of a side (methods of :class:`RegionSide`)."""


class RegionSide:
    """A data transport named ``transport`` over a region of ``num_blocks`` blocks of
    ``block_len`` (built by :meth:`build`); driver-thread only, like the transport."""

    def __init__(self, transport: str) -> None:
        self._cls: type[DataTransport] = default_registry().transport("data", transport)
        self._transport: DataTransport | None = None
        self._region: BlockRegion | None = None
        self._serving = False

    @property
    def transport(self) -> DataTransport:
        if self._transport is None:
            raise RuntimeError("the side has no transport yet: build it first")
        return self._transport

    def build(self, num_blocks: int, block_len: int, options: Mapping[str, Any]) -> dict[str, Any]:
        """Create the transport over a fresh large region (and, first, twice over a region
        of one block, closed again: the first loads the library, the second is timed):
        ``descriptor``, ``create_s`` and ``create_one_block_s`` (seconds each timed
        ``create`` took) and ``rss`` (bytes, after)."""
        small = allocated_region(self._cls, 1, block_len, options)
        for _ in range(2):
            began = time.perf_counter()
            self._cls.create(DataSettings(small, block_len, dict(options))).close()
            one_block = time.perf_counter() - began
        region = allocated_region(self._cls, num_blocks, block_len, options)
        began = time.perf_counter()
        self._transport = self._cls.create(DataSettings(region, block_len, dict(options)))
        created = time.perf_counter() - began
        self._region = BlockRegion(region, block_len, num_blocks)
        return {
            "descriptor": bytes(self._transport.descriptor()),
            "create_s": created,
            "create_one_block_s": one_block,
            "rss": self.rss(),
        }

    def add_peer(self, peer_id: str, descriptor: bytes) -> float:
        """Add the other side; seconds it took."""
        began = time.perf_counter()
        self.transport.add_peer(peer_id, descriptor)
        return time.perf_counter() - began

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        """Write the content of ``seeds`` into ``slots`` (touching those blocks only)."""
        assert self._region is not None
        self._region.fill_seeds(slots, seeds)

    def begin(self) -> None:
        """Serve reads (progress between commands) until :meth:`end`."""
        self._serving = True

    def end(self) -> int:
        """Stop serving; the failed ids the transport's ``poll`` reported meanwhile."""
        self._serving = False
        return len(self.transport.poll().failed)

    def pump(self) -> bool:
        """Progress the transport while serving; whether it is serving (the helper's idle)."""
        if self._serving:
            self.transport.progress()
        return self._serving

    def read(
        self, peer_id: str, local: Sequence[int], remote: Sequence[int], deadline: float
    ) -> float:
        """Read blocks ``remote`` of the peer into ``local``; seconds from ``read_blocks`` to
        the ``poll`` that reports it done. ``RuntimeError`` when it fails or takes longer
        than ``deadline`` seconds (then it is cancelled)."""
        t = self.transport
        began = time.perf_counter()
        while True:
            try:
                tid = t.read_blocks(peer_id, list(local), list(remote))
                break
            except TransferBusy:  # staging full: wait for it (within the deadline)
                if time.perf_counter() - began > deadline:
                    raise RuntimeError(f"no room to post a read in {deadline} s") from None
                t.progress()
        while True:
            result = t.poll(peer_id)
            if tid in result.done:
                return time.perf_counter() - began
            if tid in result.failed:
                raise RuntimeError(f"read {tid} of {len(local)} blocks failed")
            if time.perf_counter() - began > deadline:
                t.cancel([tid])
                raise RuntimeError(f"read {tid} not done in {deadline} s")

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> int:
        """How many of ``slots`` do not hold their seed's content (the check consumes it)."""
        assert self._region is not None
        return len(self._region.verify_seeds(slots, seeds))

    @staticmethod
    def rss() -> int:
        """This process's resident memory (bytes), from ``/proc/self/status``."""
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def shutdown(self) -> None:
        if self._transport is not None:
            self._transport.close()


def run_side(conn: Connection, transport: str) -> None:
    """Helper entry: serve a :class:`RegionSide` of ``transport`` until the bench is done."""
    serve_built(conn, lambda: RegionSide(transport), COMMANDS, idle="pump")
