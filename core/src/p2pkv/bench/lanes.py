"""Lanes: one series' way of moving a request's blocks, behind one submit/poll interface.

A lane is opened per block size and then timed by :mod:`p2pkv.bench.runner`. Every lane
writes the initiator's *source* blocks into the target's *destination* slots and lets the
runner check the destination bytes after each repetition.

- :class:`EndpointLane`: a p2pkv ``DataTransport`` or a raw baseline; its target is a child
  process (cross-process series) or this process (``memory``).
- :class:`MemcpyLane`: ``np.copyto`` block by block between two regions of this process, the
  physical limit on this host for the same scattered bytes.

Driver-thread only; a lane is not shared between threads.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, Protocol

import numpy as np

from p2pkv.bench.endpoints import SeriesSpec, make_endpoint
from p2pkv.bench.target import TARGET
from p2pkv.demo.content import BlockRegion
from p2pkv.registry import Registry

__all__ = ["EndpointLane", "Lane", "MemcpyLane", "Target"]


class Target(Protocol):
    """The receiving side (``p2pkv.bench.target``); endpoints are named by series label."""

    def open(self, spec: SeriesSpec, block_len: int) -> bytes: ...
    def add_peer(self, label: str, descriptor: bytes) -> None: ...
    def expect(
        self, label: str, groups: Sequence[Sequence[int]], counts: Sequence[int]
    ) -> None: ...
    def verify(
        self, label: str, slots: Sequence[int], seeds: Sequence[int]
    ) -> tuple[list[int], int]: ...
    def close_endpoint(self, label: str) -> list[int]: ...
    def pump(self) -> None: ...


class Lane(ABC):
    """Moves blocks from the source region into the destination region."""

    spec: SeriesSpec
    source: BlockRegion

    @abstractmethod
    def open(self, block_len: int) -> None:
        """Set up for ``block_len`` (register regions, exchange descriptors)."""

    @abstractmethod
    def submit(self, local: list[int], remote: list[int]) -> int:
        """Start one request; returns its id."""

    @abstractmethod
    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        """(done ids, failed ids) since the last call; drives I/O."""

    @abstractmethod
    def prepare_rep(self, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        """Announce a repetition: ``counts[g]`` requests will write destination ``groups[g]``."""

    @abstractmethod
    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> tuple[list[int], int]:
        """Check and consume destination slots; (mismatching slots, failed receives)."""

    @abstractmethod
    def close(self) -> None:
        """Tear down what ``open`` set up."""


class EndpointLane(Lane):
    """A p2pkv transport or raw baseline writing into a :class:`Target`."""

    def __init__(
        self, spec: SeriesSpec, registry: Registry, source_buf: np.ndarray, target: Target
    ) -> None:
        self.spec = spec
        self._registry = registry
        self._buf = source_buf
        self._target = target
        self._endpoint: Any = None

    def open(self, block_len: int) -> None:
        num_blocks = self._buf.nbytes // block_len
        region = self._buf.data[: num_blocks * block_len]
        self.source = BlockRegion(self._buf, block_len, num_blocks)
        self._endpoint = make_endpoint(self.spec, self._registry, region, block_len)
        try:
            self._endpoint.add_peer(TARGET, self._target.open(self.spec, block_len))
            self._target.add_peer(self.spec.label, bytes(self._endpoint.descriptor()))
        except Exception:
            self.close()
            raise

    def submit(self, local: list[int], remote: list[int]) -> int:
        return int(self._endpoint.write_blocks(TARGET, local, remote))

    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        self._target.pump()
        result = self._endpoint.poll(TARGET)
        return result[0], result[1]

    def prepare_rep(self, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        self._target.expect(self.spec.label, groups, counts)

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> tuple[list[int], int]:
        return self._target.verify(self.spec.label, slots, seeds)

    def close(self) -> None:
        if self._endpoint is not None:
            endpoint, self._endpoint = self._endpoint, None
            endpoint.close()
        self._target.close_endpoint(self.spec.label)


class MemcpyLane(Lane):
    """Block-by-block ``np.copyto`` in this process; a request completes inside ``submit``."""

    def __init__(self, source_buf: np.ndarray, dest_buf: np.ndarray) -> None:
        self.spec = SeriesSpec("memcpy", "memcpy", cross_process=False)
        self._src_buf = source_buf
        self._dst_buf = dest_buf
        self._ids = itertools.count(1)
        self._done: list[int] = []

    def open(self, block_len: int) -> None:
        self.source = BlockRegion(self._src_buf, block_len)
        self._dest = BlockRegion(self._dst_buf, block_len)

    def submit(self, local: list[int], remote: list[int]) -> int:
        src, dst = self.source.words, self._dest.words
        for i, j in zip(local, remote, strict=True):
            np.copyto(dst[j], src[i])
        tid = next(self._ids)
        self._done.append(tid)
        return tid

    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        done, self._done = self._done, []
        return done, ()

    def prepare_rep(self, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        """Nothing to announce: copies complete inside ``submit``."""

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> tuple[list[int], int]:
        return self._dest.verify_seeds(slots, seeds), 0

    def close(self) -> None:
        self._done.clear()

