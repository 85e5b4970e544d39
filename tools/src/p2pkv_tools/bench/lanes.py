"""Lanes: one series' way of moving a request's blocks, behind one submit/poll interface.

A lane is opened per block size and then timed by :mod:`p2pkv_tools.bench.runner`. Every lane
*reads* (wire 2.0: the consumer owns every write into its region): the peer side's *source*
slots are filled with key-derived content (:meth:`Lane.fill`, untimed), a request copies
source blocks into the initiator's own *destination* slots, and the runner checks the
destination bytes after each repetition, in the initiator's process.

- :class:`EndpointLane`: a p2pkv ``DataTransport`` or a raw baseline posting ``read_blocks``
  against a :class:`Target` (a child process for cross-process series, this process for
  ``memory``), which only progresses while a repetition runs.
- :class:`MemcpyLane`: ``np.copyto`` block by block between two regions of this process, the
  physical limit on this host for the same scattered bytes.

Driver-thread only; a lane is not shared between threads.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from p2pkv.registry import Registry

from p2pkv_tools.bench.endpoints import SeriesSpec, make_endpoint
from p2pkv_tools.bench.target import TARGET
from p2pkv_tools.demo.content import BlockRegion

__all__ = ["EndpointLane", "Lane", "MemcpyLane", "Target"]


class Target(Protocol):
    """The source side (``p2pkv_tools.bench.target``); endpoints are named by series label."""

    def open(self, spec: SeriesSpec, block_len: int) -> bytes: ...
    def add_peer(self, label: str, descriptor: bytes) -> None: ...
    def fill(self, label: str, slots: Sequence[int], seeds: Sequence[int]) -> None: ...
    def begin(self, label: str) -> None: ...
    def end(self, label: str) -> int: ...
    def close_endpoint(self, label: str) -> list[int]: ...
    def pump(self) -> None: ...


class Lane(ABC):
    """Reads blocks of the source region into the destination region (``dest``, ours)."""

    spec: SeriesSpec
    dest: BlockRegion

    @abstractmethod
    def open(self, block_len: int) -> None:
        """Set up for ``block_len`` (register regions, exchange descriptors)."""

    @abstractmethod
    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        """Write the content of ``seeds`` into the source ``slots`` (untimed)."""

    @abstractmethod
    def submit(self, local: list[int], remote: list[int]) -> int:
        """Start one request: source ``remote[i]`` into destination ``local[i]``; its id."""

    @abstractmethod
    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        """(done ids, failed ids) since the last call; drives I/O."""

    def cancel(self, ids: Sequence[int]) -> None:
        """End requests still in flight, finally (none of their bytes lands afterwards);
        unknown ids are ignored. Default: nothing is ever left in flight."""
        return None

    @abstractmethod
    def begin_rep(self) -> None:
        """A repetition starts (the source side progresses until :meth:`end_rep`)."""

    @abstractmethod
    def end_rep(self) -> int:
        """The repetition's requests are all reported; the failures the source side saw.

        Raises when the source side broke during the repetition."""

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> list[int]:
        """Check and consume destination slots; returns the mismatching ones."""
        return self.dest.verify_seeds(slots, seeds)

    @property
    def num_blocks(self) -> int:
        """Blocks per region (source and destination regions are the same size)."""
        return self.dest.num_blocks

    @abstractmethod
    def close(self) -> None:
        """Tear down what ``open`` set up."""


class EndpointLane(Lane):
    """A p2pkv transport (with ``options``, its ``data_options``) or raw baseline reading from
    a :class:`Target` into ``dest``, a region of whole blocks of the size it is opened for
    (for a p2pkv transport: from its ``allocate_region``)."""

    def __init__(
        self,
        spec: SeriesSpec,
        registry: Registry,
        dest: memoryview,
        target: Target,
        options: Mapping[str, Any] | None = None,
    ) -> None:
        self.spec = spec
        self._registry = registry
        self._region = dest
        self._target = target
        self._options = dict(options or {})
        self._endpoint: Any = None

    def open(self, block_len: int) -> None:
        self.dest = BlockRegion(self._region, block_len)
        self._endpoint = make_endpoint(
            self.spec, self._registry, self._region, block_len, self._options
        )
        try:
            self._endpoint.add_peer(TARGET, self._target.open(self.spec, block_len))
            self._target.add_peer(self.spec.label, bytes(self._endpoint.descriptor()))
        except Exception:
            self.close()
            raise

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self._target.fill(self.spec.label, slots, seeds)

    def submit(self, local: list[int], remote: list[int]) -> int:
        return int(self._endpoint.read_blocks(TARGET, local, remote))

    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        self._target.pump()
        result = self._endpoint.poll(TARGET)
        return result[0], result[1]

    def cancel(self, ids: Sequence[int]) -> None:
        """The endpoint's ``cancel`` (a raw baseline without one cannot cancel: nothing)."""
        cancel = getattr(self._endpoint, "cancel", None)
        if ids and cancel is not None:
            cancel(list(ids))

    def begin_rep(self) -> None:
        self._target.begin(self.spec.label)

    def end_rep(self) -> int:
        return self._target.end(self.spec.label)

    def close(self) -> None:
        if self._endpoint is not None:
            endpoint, self._endpoint = self._endpoint, None
            endpoint.close()
        self._target.close_endpoint(self.spec.label)


class MemcpyLane(Lane):
    """Block-by-block ``np.copyto`` in this process; a request completes inside ``submit``."""

    def __init__(
        self, dest_buf: memoryview | np.ndarray, source_buf: memoryview | np.ndarray
    ) -> None:
        self.spec = SeriesSpec("memcpy", "memcpy", cross_process=False)
        self._dst_buf = dest_buf
        self._src_buf = source_buf
        self._ids = itertools.count(1)
        self._done: list[int] = []

    def open(self, block_len: int) -> None:
        self.dest = BlockRegion(self._dst_buf, block_len)
        self.source = BlockRegion(self._src_buf, block_len)

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self.source.fill_seeds(slots, seeds)

    def submit(self, local: list[int], remote: list[int]) -> int:
        src, dst = self.source.words, self.dest.words
        for i, j in zip(local, remote, strict=True):
            np.copyto(dst[i], src[j])
        tid = next(self._ids)
        self._done.append(tid)
        return tid

    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        done, self._done = self._done, []
        return done, ()

    def begin_rep(self) -> None:
        """Nothing to start: copies complete inside ``submit``."""

    def end_rep(self) -> int:
        """Nothing on a source side can fail."""
        return 0

    def close(self) -> None:
        self._done.clear()
