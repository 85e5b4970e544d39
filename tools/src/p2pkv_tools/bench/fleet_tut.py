"""The tier under test of ``p2pkv bench --fleet``: one real ``P2PTier`` in a helper process of
its own, driven as vLLM 0.33's tier-poll thread drives a tier.

While no job is open the tier ticks every :data:`CADENCE` (5 ms, the quiet tier-poll cadence);
while one is, ``tick`` waits for control I/O up to 1 ms at a time (an engine stepping).
Commands (over a harness pipe):

- ``describe()``: the tier's address; ``sessions()``: its ready sessions; ``warm(...)``:
  tick until a number of sessions is ready, and say when.
- ``idle(seconds)``: tick quietly for ``seconds``; the process's CPU (and the ticking
  thread's alone), threads, descriptors and resident memory, the TCP data segments its
  sockets sent and received (``ss``), and the Python calls of a quiet tick.
- ``run(plan)``: PD loads as the plan says (:class:`Plan`), bytes verified; per kind of load
  the outcomes, latencies (submit to result) and a few failure details, and the CPU spent
  (in all, and within the window); within the window, the ticking thread's CPU issuing
  flood names (the tier's calls: their requests are built before the window, as an
  engine builds its own whatever its KV tier) and ticking (``time.thread_time``), and its
  ticks; the zmq dials and reach checks the run made
  (:mod:`~p2pkv_tools.bench.fleet_dials`).

The process freezes its startup heap once the tier is built, as vLLM's EngineCore does
(``gc.freeze``): the collector then walks what the tier and the runs allocate since.

Loads name their producer in the request's routing, as llm-d's router does; keys and
``kv_request_id`` come from the request number (:func:`~p2pkv_tools.bench.fleet_peers.fleet_kv_id`).
"""

from __future__ import annotations

import gc
import os
import shutil
import subprocess
import sys
import time
from collections import Counter, defaultdict, deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from types import FrameType
from typing import Any

from p2pkv.addressing import parse_address
from p2pkv.config import TierConfig
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, LookupResult, RequestContext

from p2pkv_tools.bench.fleet_data import ShmDataTransport, fleet_registry
from p2pkv_tools.bench.fleet_dials import DialCounts
from p2pkv_tools.bench.fleet_peers import BLOCK, fleet_kv_id, process_usage, quiet_logs
from p2pkv_tools.bench.harness import serve_built
from p2pkv_tools.bench.tier_side import request_keys
from p2pkv_tools.demo.content import BlockRegion

__all__ = ["CADENCE", "COUNTED_TICKS", "Plan", "TierUnderTest", "tcp_segments", "tut_main"]

CADENCE = 0.005
"""Seconds between the ticks of a quiet tier."""
_STEP = 0.001
"""The longest wait of a tick while a job is open."""
_GRACE = 30.0
"""Seconds a run waits past its window for the results of the loads it made."""
_DETAILS = 3
"""Failure details kept per kind."""
_LONGEST = 120.0
"""Seconds a flood's window lasts at most."""
COUNTED_TICKS = 200
"""Quiet ticks whose Python calls ``idle`` counts (the zmq hub sweeps every other one)."""


@dataclass
class Plan:
    """What :meth:`TierUnderTest.run` does. Addresses are ``host:port``."""

    seconds: float
    """The window: closed-loop traffic and the flood run this long."""
    blocks: int = 4
    timed: list[tuple[float, str, int, str]] = field(default_factory=list)
    """Loads at fixed times: (seconds into the window, producer, request, kind)."""
    closed: list[tuple[str, int]] = field(default_factory=list)
    """Loads issued in order, ``concurrency`` at a time (kind ``established``)."""
    concurrency: int = 8
    flood: list[str] = field(default_factory=list)
    """Client-named producers that are not there, one load each (1 block, kind ``flood``)."""
    flood_rate: float = 0.0
    """Flood loads per second. The window lasts until every one was issued (at most
    :data:`_LONGEST` seconds)."""


@dataclass
class _Kind:
    outcomes: dict[str, int] = field(default_factory=dict)
    latencies_s: list[float] = field(default_factory=list)
    details: list[str] = field(default_factory=list)

    def add(self, outcome: str, latency: float, detail: str) -> None:
        self.outcomes[outcome] = self.outcomes.get(outcome, 0) + 1
        if outcome == "done":
            self.latencies_s.append(latency)
        elif len(self.details) < _DETAILS and detail:
            self.details.append(detail)


_Request = tuple[int, RequestContext, list[bytes]]
"""A request as an engine hands it to the tier: its number (the job's id), its context
(routing naming the producer) and its blocks' keys."""


def _request(producer: str, request: int, blocks: int) -> _Request:
    """Request ``request``: ``blocks`` blocks from ``producer``, named in its routing."""
    host, port = parse_address(producer)
    route = {"kv_request_id": fleet_kv_id(request), "remote_host": host, "remote_port": port}
    ctx = RequestContext(f"c{request}", {"remote_prefiller": route})
    return request, ctx, request_keys(request, blocks)


@dataclass
class _ThreadCpu:
    """The tier thread's CPU (``time.thread_time``) within a run's window: issuing flood
    names, and ticking."""

    flood_s: float = 0.0
    tick_s: float = 0.0
    ticks: int = 0

    def tick(self, tier: P2PTier, timeout: float, in_window: bool) -> None:
        """``tier.tick(timeout)``, counted while ``in_window``."""
        if not in_window:
            tier.tick(timeout)
            return
        spent = time.thread_time()
        tier.tick(timeout)
        self.tick_s += time.thread_time() - spent
        self.ticks += 1


class TierUnderTest:
    """One tier over a region of ``blocks`` blocks (see the module docstring)."""

    def __init__(self, tier_config: dict[str, Any], blocks: int) -> None:
        region = ShmDataTransport.allocate_region(blocks, BLOCK, {})
        self._region = BlockRegion(region, BLOCK)
        self._dials = DialCounts()
        self._tier = P2PTier(
            TierConfig.from_dict(tier_config), region, BLOCK, registry=fleet_registry()
        )
        self._free = deque(range(blocks))
        self._open: dict[int, tuple[RequestContext, list[int], float, str]] = {}
        self._open_kinds: Counter[str] = Counter()
        self._kinds: defaultdict[str, _Kind] = defaultdict(_Kind)
        self._mismatched = 0
        self._flood_request = 1 << 40

    def describe(self) -> str:
        return self._tier.local_address

    def origin(self) -> list[str]:
        """Where this process imported p2pkv and its control transport from."""
        found = [sys.modules.get(name) for name in ("p2pkv", "p2pkv_zmq")]
        return [os.path.dirname(module.__file__ or "") if module else "" for module in found]

    def sessions(self) -> int:
        return self._tier.stats().get("sessions_ready", 0)

    def warm(
        self, expected: int, started: float, timeout: float, stall: float
    ) -> tuple[float | None, int]:
        """Tick (waiting for I/O) until ``expected`` sessions are ready: (the seconds from
        ``started``, a wall-clock time, to then, or None; the sessions reached). Gives up
        ``timeout`` seconds after ``started``, or once no session was added for ``stall``."""
        reached, last = 0, time.monotonic()
        while time.time() - started < timeout and time.monotonic() - last < stall:
            self._tier.tick(CADENCE)
            ready = self.sessions()
            if ready > reached:
                reached, last = ready, time.monotonic()
            if ready >= expected:
                return time.time() - started, ready
        return None, reached

    def step(self) -> bool:
        """Between commands: one quiet tick (the harness then waits up to 50 ms)."""
        self._tier.tick(0.0)
        return False

    def idle(self, seconds: float) -> dict[str, Any]:
        """Tick quietly every :data:`CADENCE` for ``seconds``; then count the Python calls
        of :data:`COUNTED_TICKS` more (``sys.setprofile``: calls of Python and of C
        functions), apart, so the counting costs the CPU figures nothing."""
        before, segments = process_usage(), tcp_segments()
        started, thread_cpu = time.monotonic(), time.thread_time()
        ticks = 0
        while (now := time.monotonic()) - started < seconds:
            self._tier.tick(0.0)
            ticks += 1
            time.sleep(max(0.0, started + ticks * CADENCE - now))
        wall, thread_cpu = time.monotonic() - started, time.thread_time() - thread_cpu
        after, segments_after = process_usage(), tcp_segments()
        return {
            "cpu_s": after["cpu_s"] - before["cpu_s"],
            "wall_s": wall,
            "ticks": ticks,
            "tick_thread_cpu_s": thread_cpu,
            "calls_per_tick": self._calls_per_tick(COUNTED_TICKS),
            "sessions": self.sessions(),
            "threads": after["threads"],
            "fds": after["fds"],
            "rss_mib": after["rss_mib"],
            "segments": (
                None if segments is None or segments_after is None else segments_after - segments
            ),
        }

    def _calls_per_tick(self, ticks: int) -> float:
        """Python calls per quiet tick over ``ticks`` ticks, :data:`CADENCE` apart."""
        calls = 0

        def count(frame: FrameType, event: str, arg: object) -> None:
            nonlocal calls
            if event in ("call", "c_call"):
                calls += 1

        tick = self._tier.tick
        for _ in range(ticks):
            sys.setprofile(count)
            tick(0.0)
            sys.setprofile(None)
            time.sleep(CADENCE)
        return calls / ticks

    def run(self, plan: Plan) -> dict[str, Any]:
        """Run ``plan`` (see :class:`Plan`); results per kind and the CPU spent."""
        self._kinds, self._mismatched = defaultdict(_Kind), 0
        timed = deque(sorted(plan.timed))
        closed, flood = deque(plan.closed), self._flood_requests(plan.flood)
        cpu = process_usage()["cpu_s"]
        window_cpu: float | None = None
        started = time.monotonic()
        flooded = 0
        window = plan.seconds
        thread = _ThreadCpu()
        dials, checks = self._dials.snapshot()
        while True:
            now = time.monotonic() - started
            if flood and now >= window:
                window = min(now + CADENCE, _LONGEST)  # the flood is not over yet
            in_window = now < window
            if not in_window and window_cpu is None:
                window_cpu = process_usage()["cpu_s"] - cpu
            while timed and timed[0][0] <= now:
                _, producer, request, kind = timed.popleft()
                self._load(producer, request, plan.blocks, kind)
            if in_window and flood and flooded < plan.flood_rate * now:
                spent = time.thread_time()
                while flood and flooded < plan.flood_rate * now:
                    self._issue(flood.popleft(), "flood")
                    flooded += 1
                thread.flood_s += time.thread_time() - spent
            while in_window and closed and self._count("established") < plan.concurrency:
                producer, request = closed.popleft()
                self._load(producer, request, plan.blocks, "established")
            self._collect()
            if not in_window and not timed and not self._open:
                break
            if now > window + _GRACE:
                break
            thread.tick(self._tier, _STEP if self._open else 0.0, in_window)
            if not self._open:
                time.sleep(CADENCE)
        wall = time.monotonic() - started
        dials_now, checks_now = self._dials.snapshot()
        return {
            "zmq_dials": dials_now - dials,
            "reach_checks": None if checks is None or checks_now is None else checks_now - checks,
            "cpu_s": process_usage()["cpu_s"] - cpu,
            "wall_s": wall,
            "window_s": window,
            "window_cpu_s": window_cpu,
            "flood_thread_cpu_s": thread.flood_s,
            "tick_thread_cpu_s": thread.tick_s,
            "window_ticks": thread.ticks,
            "mismatched": self._mismatched,
            "left_open": len(self._open),
            "flood_issued": flooded,
            "kinds": {k: vars(v) for k, v in self._kinds.items()},
        }

    def _count(self, kind: str) -> int:
        return self._open_kinds[kind]

    def _load(self, producer: str, request: int, blocks: int, kind: str) -> None:
        """Build request ``request`` to ``producer`` and issue it (:meth:`_issue`)."""
        self._issue(_request(producer, request, blocks), kind)

    def _issue(self, request: _Request, kind: str) -> None:
        """The engine's calls for ``request``: ``on_new_request``, a lookup of every key
        (PD: a hit) and ``submit_load``."""
        job_id, ctx, keys = request
        blocks = len(keys)
        kinds = self._kinds[kind]
        if len(self._free) < blocks:
            kinds.add("no_free_slot", 0.0, "the region of the tier under test is full")
            return
        tier = self._tier
        tier.on_new_request(ctx)
        if any(tier.lookup(key, ctx) is not LookupResult.HIT for key in keys):
            tier.on_request_finished(ctx)
            kinds.add("lookup_miss", 0.0, "")
            return
        slots = [self._free.popleft() for _ in range(blocks)]
        self._open[job_id] = (ctx, slots, time.perf_counter(), kind)
        self._open_kinds[kind] += 1
        tier.submit_load(Job(job_id, keys, slots, is_load=True, ctx=ctx))

    def _flood_requests(self, producers: list[str]) -> deque[_Request]:
        """A one-block request to each of ``producers``, built before the window: an
        engine builds its requests whatever its KV tier, so a flood name's figures are the
        tier's calls alone."""
        first = self._flood_request
        self._flood_request += len(producers)
        return deque(
            _request(producer, first + i, 1) for i, producer in enumerate(producers, start=1)
        )

    def _collect(self) -> None:
        for result in self._tier.get_finished_jobs():
            self._finish(result)

    def _finish(self, result: JobResult) -> None:
        entry = self._open.pop(result.job_id, None)
        if entry is None:
            return
        ctx, slots, submitted, kind = entry
        self._open_kinds[kind] -= 1
        outcome = result.outcome.value
        if outcome == "done" and self._region.verify(
            slots, request_keys(result.job_id, len(slots))
        ):
            self._mismatched += 1
            outcome = "mismatched"
        self._kinds[kind].add(outcome, time.perf_counter() - submitted, result.detail)
        self._tier.on_request_finished(ctx)
        self._free.extend(slots)

    def shutdown(self) -> None:
        self._tier.shutdown()


def tcp_segments() -> int | None:
    """TCP data segments this process's sockets sent and received so far (``ss``), None
    when ``ss`` is missing or fails."""
    ss = shutil.which("ss")
    if ss is None:
        return None
    try:
        out = subprocess.run(
            [ss, "-tinpH"], capture_output=True, text=True, timeout=30, check=True
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    mine, total = f"pid={os.getpid()},", 0
    entry: list[str] = []
    for line in [*out.splitlines(), ""]:
        if line.startswith((" ", "\t")):
            entry.append(line)
            continue
        if entry and mine in entry[0]:
            for word in " ".join(entry[1:]).split():
                name, _, value = word.partition(":")
                if name in ("data_segs_out", "data_segs_in") and value.isdigit():
                    total += int(value)
        entry = [line]
    return total


def _frozen(tut: TierUnderTest) -> TierUnderTest:
    """``tut``, with the process's startup heap frozen out of the collector's walks, as
    vLLM's EngineCore freezes its own once built (``freeze_gc_heap``, with the tier inside).
    Without it, every full collection walks the modules and the simulator's startup objects,
    which an engine's collections skip."""
    gc.collect()
    gc.freeze()
    return tut


def tut_main(conn: Connection, tier_config: dict[str, Any], blocks: int) -> None:
    """Helper entry: serve a :class:`TierUnderTest`."""
    quiet_logs()
    serve_built(
        conn,
        lambda: _frozen(TierUnderTest(tier_config, blocks)),
        ("describe", "origin", "sessions", "warm", "idle", "run"),
        idle="step",
    )
