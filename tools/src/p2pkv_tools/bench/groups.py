"""Where each series runs: lane groups, one process per transport library.

Two UCX-based libraries in one process do not mix: NIXL bundles its own UCX and ucxx loads
another (and sets UCX variables at import), and a process holding both measured either at a
small fraction of its speed here. So the series of each cross-process transport (``raw nixl``,
``raw nixl write`` and ``p2pkv nixl``; ``raw ucx`` and ``p2pkv ucx``) run in a worker process
of their own, which spawns the target child they read from; in-process series run in the
bench process with a local target, a group per transport (``memory``) and one for
``memcpy``. Every group owns its own region (where the reads land) and a target region (the
source) of ``region_bytes``, from its :class:`~p2pkv_tools.bench.data_transport.RegionSource` (its
p2pkv transport's ``allocate_region``, which its raw baselines share; plain memory for
``memcpy``), allocated per block size and page-faulted before anything is timed.

:class:`LaneGroup` does the work; :class:`WorkerGroup` runs one in a worker process and is
called synchronously with deadlines. The worker pipe carries only the bench's own commands.
"""

from __future__ import annotations

from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Protocol

import numpy as np
from p2pkv.logs import module_logger
from p2pkv.registry import default_registry

from p2pkv_tools.bench.data_transport import RegionSource
from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.harness import Helper, serve_built
from p2pkv_tools.bench.lanes import EndpointLane, Lane, MemcpyLane
from p2pkv_tools.bench.netns import Link, Placement
from p2pkv_tools.bench.runner import CellPlan, CellResult, measure_cell
from p2pkv_tools.bench.target import LocalTarget, RemoteTarget

__all__ = ["Group", "LaneGroup", "WorkerGroup", "failed_cell"]

log = module_logger(__name__)


class Group(Protocol):
    series: list[SeriesSpec]

    def begin_open(self, block_size: int) -> None:
        """Start opening every series' lane for ``block_size`` (groups open in parallel)."""
        ...

    def end_open(self) -> dict[str, str]:
        """Wait for ``begin_open``; label -> why a series could not open."""
        ...

    def measure(self, label: str, plan: CellPlan, seed: Sequence[int]) -> CellResult: ...

    def close(self) -> None: ...

    def shutdown(self) -> None: ...


def failed_cell(spec: SeriesSpec, plan: CellPlan, error: str) -> CellResult:
    return CellResult(
        series=spec.label,
        impl=spec.impl,
        transport=spec.transport,
        block_size=plan.block_size,
        batch=plan.batch,
        concurrency=plan.concurrency,
        error=error,
    )


class LaneGroup:
    """Series sharing one process: their lanes, one destination region and one target, both
    regions from ``source``; a cross-process group's target child lives in
    ``target_placement`` when given (see :mod:`p2pkv_tools.bench.netns`)."""

    def __init__(
        self,
        series: Sequence[SeriesSpec],
        region_bytes: int,
        source: RegionSource,
        target_placement: Placement | None = None,
    ) -> None:
        self.series = list(series)
        self._region_bytes = region_bytes
        self._source = source
        self._region: memoryview | None = None
        remote = any(s.cross_process for s in series)
        self._target: RemoteTarget | LocalTarget = (
            RemoteTarget(region_bytes, source=source, placement=target_placement)
            if remote
            else LocalTarget(region_bytes, source=source)
        )
        self._lanes: dict[str, Lane] = {}
        self._open_errors: dict[str, str] = {}

    def begin_open(self, block_size: int) -> None:
        self.open(block_size)

    def end_open(self) -> dict[str, str]:
        return dict(self._open_errors)

    def open(self, block_size: int) -> dict[str, str]:
        self.close()
        registry = default_registry()
        try:
            self._region = None  # released before the next one is allocated
            self._region = self._source.allocate(self._region_bytes, block_size, registry)
        except Exception as exc:
            self._open_errors.update(
                {s.label: f"region: {type(exc).__name__}: {exc}" for s in self.series}
            )
            return dict(self._open_errors)
        for spec in self.series:
            try:
                lane = self._lane(spec, block_size)
                lane.open(block_size)
                self._lanes[spec.label] = lane
            except Exception as exc:
                log.warning("%s at %d B: open failed: %s", spec.label, block_size, exc)
                self._open_errors[spec.label] = f"open failed: {type(exc).__name__}: {exc}"
        return dict(self._open_errors)

    def _lane(self, spec: SeriesSpec, block_size: int) -> Lane:
        """Series ``spec``'s lane over this group's region (for blocks of ``block_size``)."""
        assert self._region is not None
        if spec.impl == "memcpy":
            assert isinstance(self._target, LocalTarget)
            return MemcpyLane(self._region, self._target.state.region(block_size))
        return EndpointLane(
            spec, default_registry(), self._region, self._target, self._source.options
        )

    def measure(self, label: str, plan: CellPlan, seed: Sequence[int]) -> CellResult:
        spec = next(s for s in self.series if s.label == label)
        lane = self._lanes.get(label)
        if lane is None:
            return failed_cell(spec, plan, self._open_errors.get(label, "not opened"))
        try:
            return measure_cell(lane, plan, np.random.default_rng(list(seed)))
        except Exception as exc:
            log.warning("%s cell %s failed: %s", label, plan, exc)
            return failed_cell(spec, plan, f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        for lane in self._lanes.values():
            try:
                lane.close()
            except Exception as exc:
                log.warning("%s: close failed: %s", lane.spec.label, exc)
        self._lanes.clear()
        self._open_errors.clear()

    def shutdown(self) -> None:
        self.close()
        self._target.shutdown()


def _worker_main(
    conn: Connection,
    series: list[SeriesSpec],
    region_bytes: int,
    source: RegionSource,
    target_placement: Placement | None,
) -> None:
    serve_built(
        conn,
        lambda: LaneGroup(series, region_bytes, source, target_placement),
        ("open", "measure", "close"),
    )


class WorkerGroup:
    """A :class:`LaneGroup` in a worker process of its own; with ``link``, the worker (the
    reading side) lives at the link's reader end and its target child at the source end.

    Construction only starts the process (workers start in parallel); the first call waits
    for it. The worker is not daemonic (it spawns its target child); it exits when told to
    or when its pipe closes, and is killed if it does not within ``timeout``."""

    def __init__(
        self,
        series: Sequence[SeriesSpec],
        region_bytes: int,
        source: RegionSource,
        timeout: float,
        link: Link | None = None,
    ) -> None:
        self.series = list(series)
        name = "p2pkv-bench-" + "-".join(sorted({s.transport for s in series}))
        args = (self.series, region_bytes, source, link.source if link else None)
        self._helper = Helper(
            _worker_main,
            args,
            name=name,
            daemon=False,
            timeout=timeout,
            placement=link.reader if link else None,
        )

    def begin_open(self, block_size: int) -> None:
        self._helper.send("open", block_size)

    def end_open(self) -> dict[str, str]:
        return dict(self._helper.reply("reply to open"))

    def measure(self, label: str, plan: CellPlan, seed: Sequence[int]) -> CellResult:
        result: CellResult = self._helper.call("measure", label, plan, list(seed))
        return result

    def close(self) -> None:
        self._helper.call("close")

    def shutdown(self) -> None:
        self._helper.stop()
