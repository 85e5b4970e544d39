"""The source side of a bench series: a region, its endpoint, and its source content.

The region comes from the group's :class:`~p2pkv_tools.bench.data_transport.RegionSource` (the
p2pkv transport's ``allocate_region``), pre-faulted.

:class:`TargetState` does the work and is used two ways: in a spawned child (cross-process
series: :class:`RemoteTarget` drives it over a harness pipe) or in the bench process itself
(in-process series such as ``memory``: :class:`LocalTarget`). The initiator reads the
target's blocks into its own region (wire 2.0: the consumer owns every write into its
region); the target posts nothing. During a repetition it spins on its endpoint's
``progress()``/``poll()``, as a serving process's tier tick does, so reads a two-sided
transport must serve from the source side (tagged sends) are served; between repetitions it
sleeps on the pipe.

The harness pipe carries only the parent's own commands (never anything from a p2pkv wire).
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
from p2pkv.registry import Registry, default_registry

from p2pkv_tools.bench.data_transport import RegionSource
from p2pkv_tools.bench.endpoints import SeriesSpec, make_endpoint
from p2pkv_tools.bench.harness import Helper, serve
from p2pkv_tools.bench.netns import Placement
from p2pkv_tools.demo.content import BlockRegion

__all__ = ["INITIATOR", "TARGET", "LocalTarget", "RemoteTarget", "TargetState", "page_in"]

INITIATOR = "bench-initiator"
TARGET = "bench-target"


def page_in(nbytes: int) -> np.ndarray:
    """A zeroed, pre-faulted buffer (first-touch page faults stay out of timed windows)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


class _Source:
    """One endpoint over the target region; what its progress reported."""

    def __init__(self, endpoint: Any, block_len: int) -> None:
        self.endpoint = endpoint
        self.block_len = block_len
        self.failures = 0
        """Failed ids the endpoint's ``poll`` reported (it posts no reads: any is a fault)."""
        self.broken = ""
        """Why this endpoint raised while being pumped (then it is pumped no more)."""

    def pump(self) -> None:
        self.endpoint.progress()
        _, failed = self.endpoint.poll(INITIATOR)
        self.failures += len(failed)


class TargetState:
    """A region of ``region_bytes`` from ``source`` plus the endpoints registered over it, one
    per series label (built from ``registry``, default: the process-wide one).

    The region is allocated per block size (``allocate_region`` takes the block length): on
    the first ``open`` or ``region`` call of a size, once every endpoint of the last is closed.

    Only the endpoint of the repetition being measured (from its ``begin`` to its ``end``)
    is pumped: a serving process runs one data transport, and spinning idle ones (or spinning
    between repetitions) would bill that CPU to whatever is measured meanwhile.
    """

    def __init__(
        self,
        region_bytes: int,
        registry: Registry | None = None,
        source: RegionSource | None = None,
    ) -> None:
        self._region_bytes = region_bytes
        self._registry = registry
        self._source = source or RegionSource()
        self._region: tuple[int, memoryview] | None = None
        self._sources: dict[str, _Source] = {}
        self._active: _Source | None = None

    def region(self, block_len: int) -> memoryview:
        """The region in blocks of ``block_len`` (allocated on the first call for that size;
        ``RuntimeError`` while endpoints over a region of another size are open)."""
        if self._region is not None and self._region[0] == block_len:
            return self._region[1]
        if self._sources:
            raise RuntimeError(
                f"target endpoints {sorted(self._sources)} are open over "
                f"blocks of another size than {block_len} B"
            )
        self._region = None  # released before the next one is allocated
        registry = self._registry or default_registry()
        region = self._source.allocate(self._region_bytes, block_len, registry)
        self._region = (block_len, region)
        return region

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        """Build series ``spec``'s endpoint over the region; returns its descriptor."""
        self.close(spec.label)
        region = self.region(block_len)
        registry = self._registry or default_registry()
        endpoint = make_endpoint(spec, registry, region, block_len, self._source.options)
        self._sources[spec.label] = _Source(endpoint, block_len)
        return bytes(endpoint.descriptor())

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self._sources[label].endpoint.add_peer(INITIATOR, descriptor)

    def fill(self, label: str, slots: Sequence[int], seeds: Sequence[int]) -> None:
        """Write the content of ``seeds`` into ``slots`` (blocks of ``label``'s endpoint)."""
        block_len = self._sources[label].block_len
        BlockRegion(self.region(block_len), block_len).fill_seeds(slots, seeds)

    def begin(self, label: str) -> None:
        """A repetition of series ``label`` starts: it becomes the pumped one."""
        self._active = self._sources[label]

    @property
    def active(self) -> bool:
        return self._active is not None

    def pump(self) -> None:
        """Progress the active endpoint's inbound work (never blocks).

        An endpoint that raises is set aside with the reason (its series fails at its
        ``end``); the other series go on."""
        source = self._active
        if source is None or source.broken:
            return
        try:
            source.pump()
        except Exception as exc:
            source.broken = f"target endpoint failed: {type(exc).__name__}: {exc}"

    def end(self, label: str) -> int:
        """The repetition is over: stop pumping; returns the failed ids the target's ``poll``
        reported since the last ``end``. Raises ``RuntimeError`` if the endpoint broke."""
        source = self._sources[label]
        self._active = None
        if source.broken:
            raise RuntimeError(source.broken)
        failures, source.failures = source.failures, 0
        return failures

    def close(self, label: str | None = None) -> list[int]:
        """Close one endpoint (or all); returns transfer ids that never drained."""
        labels = list(self._sources) if label is None else [label]
        undrained: list[int] = []
        for name in labels:
            source = self._sources.pop(name, None)
            if source is self._active:
                self._active = None
            if source is not None:
                try:
                    undrained.extend(source.endpoint.close() or [])
                except Exception:
                    if not source.broken:  # a broken endpoint's close may fail too
                        raise
        return undrained


def _serve(conn: Connection, region_bytes: int, source: RegionSource) -> None:
    """Child entry: execute commands, pump the active endpoint between them."""
    state = TargetState(region_bytes, source=source)

    def idle() -> bool:
        state.pump()
        return state.active

    try:
        serve(
            conn,
            {
                "open": state.open,
                "add_peer": state.add_peer,
                "fill": state.fill,
                "begin": state.begin,
                "end": state.end,
                "close": state.close,
            },
            idle,
        )
    finally:
        state.close()


class RemoteTarget:
    """A :class:`TargetState` in a spawned child (in ``placement`` when given: see
    :mod:`p2pkv_tools.bench.netns`), called synchronously with deadlines."""

    def __init__(
        self,
        region_bytes: int,
        timeout: float = 60.0,
        source: RegionSource | None = None,
        placement: Placement | None = None,
    ) -> None:
        self._helper = Helper(
            _serve,
            (region_bytes, source or RegionSource()),
            name="p2pkv-bench-target",
            daemon=True,
            timeout=timeout,
            placement=placement,
        )

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        return bytes(self._helper.call("open", spec, block_len))

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self._helper.call("add_peer", label, descriptor)

    def fill(self, label: str, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self._helper.call("fill", label, list(slots), list(seeds))

    def begin(self, label: str) -> None:
        self._helper.call("begin", label)

    def end(self, label: str) -> int:
        return int(self._helper.call("end", label))

    def close_endpoint(self, label: str) -> list[int]:
        return list(self._helper.call("close", label))

    def pump(self) -> None:
        """The child pumps itself."""

    def shutdown(self) -> None:
        self._helper.stop()


class LocalTarget:
    """A :class:`TargetState` in this process (for in-process transports); its endpoints
    come from ``registry`` (default: the process-wide one), its region from ``source``."""

    def __init__(
        self,
        region_bytes: int,
        registry: Registry | None = None,
        source: RegionSource | None = None,
    ) -> None:
        self.state = TargetState(region_bytes, registry, source)

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        return self.state.open(spec, block_len)

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self.state.add_peer(label, descriptor)

    def fill(self, label: str, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self.state.fill(label, slots, seeds)

    def begin(self, label: str) -> None:
        self.state.begin(label)

    def end(self, label: str) -> int:
        return self.state.end(label)

    def close_endpoint(self, label: str) -> list[int]:
        return self.state.close(label)

    def pump(self) -> None:
        self.state.pump()

    def shutdown(self) -> None:
        self.state.close()
