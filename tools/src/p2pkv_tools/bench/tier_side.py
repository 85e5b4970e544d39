"""One side of ``p2pkv bench --tier``: a real ``P2PTier`` over a pre-faulted region, in a child.

The region comes from the data transport's ``allocate_region`` with the tier's
``data_options`` (:func:`p2pkv_tools.bench.data_transport.transport_region`), as an engine's would.

The parent (:mod:`p2pkv_tools.bench.tier_lane`) plays the engine's scheduler and the PD router;
each side runs in a spawned process of its own and is driven over a harness pipe
(:func:`p2pkv_tools.bench.harness.serve`), which carries only the bench's own commands:

- producer: ``store(r, slots)`` -> ``on_new_request`` + ``submit_store`` of request ``r``'s
  keys over ``slots`` (their content was written by ``fill``, untimed: the bench times the
  tier, not the prefill);
- consumer: ``load(r, host, port, slots)`` -> ``on_new_request``, ``lookup`` of every key
  (PD: HIT at once), ``submit_load``; its latency runs from ``submit_load`` to the
  ``get_finished_jobs`` that returns its result, both read in this process;
- both: between commands, while a job is open, the side steps like an engine
  (``get_finished_jobs``, ``on_request_finished`` of finished requests, ``on_schedule_end``,
  ``tick``); ``wait`` steps until a result is there and returns the results since the last
  call; ``usage`` reports process CPU time (every thread: the tier, its transports' I/O
  threads) and the tier's ``descriptors_posted`` counter when the tier's stats have one;
- phases (``--phases``, a side built with ``phases``): ``phases`` returns, per load finished
  since the last call, when it was submitted, when its reads were posted and ended and when
  its fetch was sent (:class:`~p2pkv_tools.bench.tier_phases_side.PhaseClock`), and when its
  result was returned; ``profile(True)``/``profile(False)`` start and stop a cProfile of the
  driver thread, the latter returning its CPU seconds per component;
- first pull (:mod:`p2pkv_tools.bench.tier_first_pull`): ``connect(host, port, timeout)`` on the
  consumer -> ``P2PTier.connect``, stepped until its session is ready, while ``accept``
  steps the producer until its side is; ``first_load`` is ``load`` stepped to its result,
  noting when the tier's ``sessions_ready`` stat turned 1 (the handshake's end).

Keys are derived from the request number on both sides (:func:`request_keys`).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.addressing import format_address
from p2pkv.config import TierConfig
from p2pkv.registry import default_registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, LookupResult, RequestContext

from p2pkv_tools.bench.data_transport import transport_region
from p2pkv_tools.bench.harness import serve_built
from p2pkv_tools.bench.tier_phases_side import CpuProfile, PhaseClock, clocked_registry
from p2pkv_tools.demo.content import BlockRegion

__all__ = ["DESCRIPTORS_STAT", "TierSide", "request_keys", "side_main"]

DESCRIPTORS_STAT = "descriptors_posted"
"""The tier stats counter ``--tier`` divides by requests for descriptors per request."""

_TICK = 0.0002
"""``tick`` timeout while a job is open (what the demo's roles use)."""

Finished = tuple[int, str, float, str]
"""(request, outcome, submit-to-result seconds, detail)."""
FirstLoad = tuple[list[Finished], float | None]
"""A first load's results and the seconds from its submit_load to a ready session (0 when
one was ready before, None when none was before the result or the timeout)."""


def request_keys(request: int, blocks: int) -> list[bytes]:
    """The block keys of request ``request`` (unique per request and block)."""
    head = request.to_bytes(8, "little")
    return [head + i.to_bytes(8, "little") for i in range(blocks)]


def _kv_id(request: int) -> str:
    return f"bench-tier-{request}"


class TierSide:
    """A region of ``region_bytes`` (whole blocks) from the data transport and a tier built
    from ``tier_config`` over it; with ``phases``, its reads timed by a
    :class:`PhaseClock` observer and its driver thread profiled on demand."""

    def __init__(
        self, tier_config: dict[str, Any], block_len: int, region_bytes: int, phases: bool = False
    ) -> None:
        config = TierConfig.from_dict(tier_config)
        self._clock = PhaseClock() if phases else None
        registry = clocked_registry(self._clock, config.data) if self._clock else default_registry()
        data = registry.transport("data", config.data)
        region = transport_region(data, region_bytes // block_len, block_len, config.data_options)
        self.region = BlockRegion(region, block_len)
        self.tier = P2PTier(config, region, block_len, registry=registry)
        self._open: dict[int, tuple[RequestContext, float]] = {}
        self._finished: list[Finished] = []
        self._phases: list[dict[str, Any]] = []
        self._loads: set[int] = set()
        self._profile = CpuProfile()

    def describe(self) -> tuple[str, int]:
        """(the tier's address, blocks in the region)."""
        return self.tier.local_address, self.region.num_blocks

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self.region.fill_seeds(slots, seeds)

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> list[int]:
        """Check and consume ``slots``; the mismatching ones."""
        return self.region.verify_seeds(slots, seeds)

    def usage(self) -> tuple[float, int | None]:
        """(process CPU seconds, the tier's descriptors counter or None without one)."""
        stat = self.tier.stats().get(DESCRIPTORS_STAT)
        return time.process_time(), stat

    def store(self, request: int, slots: list[int]) -> None:
        ctx = RequestContext(f"p{request}", {"remote_decoder": {"kv_request_id": _kv_id(request)}})
        self.tier.on_new_request(ctx)
        self._open[request] = (ctx, time.perf_counter())
        self.tier.submit_store(
            Job(request, request_keys(request, len(slots)), slots, is_load=False, ctx=ctx)
        )

    def load(self, request: int, host: str, port: int, slots: list[int]) -> None:
        route = {"kv_request_id": _kv_id(request), "remote_host": host, "remote_port": port}
        ctx = RequestContext(f"c{request}", {"remote_prefiller": route})
        self.tier.on_new_request(ctx)
        keys = request_keys(request, len(slots))
        for key in keys:
            if self.tier.lookup(key, ctx) is not LookupResult.HIT:
                self.tier.on_request_finished(ctx)
                self._finished.append((request, "lookup_miss", 0.0, key.hex()))
                return
        self._open[request] = (ctx, time.perf_counter())
        self._loads.add(request)
        self.tier.submit_load(Job(request, keys, slots, is_load=True, ctx=ctx))

    def connect(self, host: str, port: int, timeout: float) -> float:
        """``P2PTier.connect`` to ``host:port``, then tick until a session is ready: the
        seconds from the call. Raises ``RuntimeError`` when the address cannot be dialled,
        ``TimeoutError`` when no session is ready within ``timeout``."""
        started = time.perf_counter()
        if not self.tier.connect(format_address(host, port)):
            raise RuntimeError(f"P2PTier.connect({format_address(host, port)!r}) refused")
        return self._until_ready(started, timeout)

    def accept(self, timeout: float) -> float:
        """Tick until a session is ready (the dialled side of ``connect``): seconds."""
        return self._until_ready(time.perf_counter(), timeout)

    def _until_ready(self, started: float, timeout: float) -> float:
        limit = started + timeout
        while not self._ready():
            if time.perf_counter() > limit:
                raise TimeoutError(f"no session ready within {timeout} s")
            self.tier.tick(_TICK)
        return time.perf_counter() - started

    def _ready(self) -> bool:
        return self.tier.stats()["sessions_ready"] > 0

    def first_load(
        self, request: int, host: str, port: int, slots: list[int], timeout: float
    ) -> FirstLoad:
        """``load``, stepped until its result or ``timeout``, sampling the tier's
        ``sessions_ready`` stat after every step (see :data:`FirstLoad`)."""
        ready_s = 0.0 if self._ready() else None
        self.load(request, host, port, slots)
        submitted = self._open[request][1] if request in self._open else time.perf_counter()
        limit = time.monotonic() + timeout
        while self._open and time.monotonic() < limit:
            self.step()
            if ready_s is None and self._ready():
                ready_s = time.perf_counter() - submitted
        done, self._finished = self._finished, []
        return done, ready_s

    def step(self) -> bool:
        """One engine step while a job is open; True while one still is."""
        if not self._open:
            return False
        for result in self.tier.get_finished_jobs():
            entry = self._open.pop(result.job_id, None)
            if entry is None:
                continue
            ctx, submitted = entry
            now = time.perf_counter()
            self._finished.append(
                (result.job_id, result.outcome.value, now - submitted, result.detail)
            )
            if self._clock is not None and result.job_id in self._loads:
                self._loads.discard(result.job_id)
                self._phases.append(
                    {
                        "request": result.job_id,
                        "submitted": submitted,
                        "result": now,
                        "events": self._clock.take(),
                    }
                )
            self.tier.on_request_finished(ctx)
        self.tier.on_schedule_end()
        if self._open:
            self.tier.tick(_TICK)
        return bool(self._open)

    def wait(self, timeout: float, every: bool = False) -> list[Finished]:
        """Step until a result is there (``every``: until no job is open) or ``timeout``
        seconds passed; the results since the last call."""
        limit = time.monotonic() + timeout
        while (self._open if every else not self._finished) and time.monotonic() < limit:
            if not self.step() and not every:
                break
        done, self._finished = self._finished, []
        return done

    def phases(self) -> list[dict[str, Any]]:
        """The loads finished since the last call, with their phase clock's events (a side
        built with ``phases``; else none)."""
        done, self._phases = self._phases, []
        return done

    def profile(self, on: bool) -> dict[str, float]:
        """Start (``on``) or stop the driver thread's profile; stopping returns its CPU
        seconds per component."""
        if on:
            self._profile.start()
            return {}
        return self._profile.stop()

    def shutdown(self) -> None:
        self.tier.shutdown()


def side_main(
    conn: Connection,
    tier_config: dict[str, Any],
    block_len: int,
    region_bytes: int,
    phases: bool = False,
) -> None:
    """Child entry: build the side, then serve commands, stepping while a job is open."""
    serve_built(
        conn,
        lambda: TierSide(tier_config, block_len, region_bytes, phases),
        (
            "describe",
            "fill",
            "verify",
            "usage",
            "store",
            "load",
            "wait",
            "connect",
            "accept",
            "first_load",
            "phases",
            "profile",
        ),
        idle="step",
    )
