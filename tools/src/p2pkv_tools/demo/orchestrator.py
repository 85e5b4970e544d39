"""The demo's router: replays the request stream against a producer and a consumer.

The roles run in two spawned processes (:class:`ProcessRole`) or, when a chosen transport is
process-local (``memory``), both in this process (:class:`InlineRole`). The orchestrator
plays the PD router: it admits requests while the in-flight window and both regions have room,
sends each side its half in the request's arrival order, and collects results.

- ``consumer_first``: ``load`` to the consumer; once submitted, ``store`` to the producer.
- ``producer_first``: ``store`` to the producer; once submitted, ``load`` to the consumer.
- ``symmetric``: ``cache`` to the producer; once cached, ``probe`` to the consumer; once
  loaded, ``evict`` to the producer.

A request is finished when every side reported its end. Every wait has a deadline; a role
process that dies or stops answering fails the run with the reason. The harness pipes carry
only the orchestrator's own commands (never anything from a p2pkv wire).
"""

from __future__ import annotations

import multiprocessing as mp
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Any

from p2pkv.addressing import format_address, parse_address
from p2pkv.cli import configure_logging

from p2pkv_tools.demo.roles import (
    ConsumerRole,
    Event,
    Evicted,
    Loaded,
    Pinned,
    ProducerRole,
    RoleSetup,
    Stored,
    Submitted,
)
from p2pkv_tools.demo.workload import DemoRequest

__all__ = ["DemoFailure", "InlineRole", "ProcessRole", "RequestRecord", "RoleHandle", "replay"]

_IDLE_WAIT = 0.002
_BUSY_TICK = 0.0002


class DemoFailure(RuntimeError):
    """The run could not go on (a role died, refused to start, or stopped answering)."""


@dataclass(frozen=True)
class Ready:
    """The role's tier is up; consumers dial ``address``."""

    address: str


@dataclass(frozen=True)
class Fatal:
    """The role hit an error it cannot go on from."""

    reason: str


@dataclass(frozen=True)
class Stopped:
    """The role shut its tier down (``leftovers``: outcomes of jobs still open then)."""

    stats: dict[str, Any]
    leftovers: list[str]


Message = Event | Ready | Fatal | Stopped


def _make_role(kind: str, setup: RoleSetup) -> ProducerRole | ConsumerRole:
    return ProducerRole(setup) if kind == "producer" else ConsumerRole(setup)


def _role_main(conn: Connection, kind: str, setup: RoleSetup) -> None:
    """Child entry: build the role, then run engine steps until told to stop. Logging is
    configured first, at the parent's level (a spawned process inherits none of it)."""
    configure_logging(setup.log_level)
    try:
        role = _make_role(kind, setup)
    except Exception as exc:
        conn.send([Fatal(f"{kind} failed to start: {type(exc).__name__}: {exc}")])
        return
    conn.send([Ready(role.address)])
    try:
        while True:
            events: list[Event] = []
            while conn.poll(0):
                cmd = conn.recv()
                if cmd[0] == "stop":
                    leftovers = role.shutdown()
                    conn.send([Stopped(role.stats(), [r.outcome.value for r in leftovers])])
                    return
                events.extend(role.handle(cmd))
            events.extend(role.step())
            if events:
                conn.send(events)
            elif role.busy or role.tier.has_pending_work():
                role.tier.tick(_BUSY_TICK)
            else:
                conn.poll(_IDLE_WAIT)
    except (EOFError, BrokenPipeError):
        role.shutdown()
    except Exception as exc:
        conn.send([Fatal(f"{kind}: {type(exc).__name__}: {exc}")])
        role.shutdown()


class RoleHandle(ABC):
    """The orchestrator's view of one role."""

    kind: str
    address: str = ""
    pid: int | None = None
    """The role's process id, None for a role in this process."""

    @abstractmethod
    def send(self, cmd: tuple[Any, ...]) -> None: ...

    @abstractmethod
    def events(self, timeout: float) -> list[Message]:
        """Events since the last call, waiting at most ``timeout`` for the first."""

    @abstractmethod
    def stop(self, timeout: float) -> tuple[dict[str, Any], list[str]]:
        """Shut the role's tier down; returns (stats, outcomes of jobs it still had)."""

    @abstractmethod
    def kill(self) -> None: ...


class ProcessRole(RoleHandle):
    """A role in a spawned process."""

    def __init__(self, kind: str, setup: RoleSetup) -> None:
        self.kind = kind
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_role_main, args=(child, kind, setup), name=f"p2pkv-demo-{kind}", daemon=True
        )
        self.process.start()
        self.pid = self.process.pid
        child.close()

    def send(self, cmd: tuple[Any, ...]) -> None:
        try:
            self.conn.send(cmd)
        except (BrokenPipeError, OSError):
            raise DemoFailure(f"{self.kind} process is gone ({self._state()})") from None

    def _state(self) -> str:
        code = self.process.exitcode
        return "running" if code is None else f"exit code {code}"

    def events(self, timeout: float) -> list[Message]:
        out: list[Message] = []
        try:
            while self.conn.poll(timeout if not out else 0):
                out.extend(self.conn.recv())
        except EOFError:
            raise DemoFailure(f"{self.kind} process died ({self._state()})") from None
        return out

    def stop(self, timeout: float) -> tuple[dict[str, Any], list[str]]:
        self.send(("stop",))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for ev in self.events(max(0.0, deadline - time.monotonic())):
                if isinstance(ev, Stopped):
                    self.process.join(timeout)
                    return ev.stats, ev.leftovers
        raise DemoFailure(f"{self.kind} did not shut down within {timeout}s")

    def kill(self) -> None:
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)


class InlineRole(RoleHandle):
    """A role in this process; ``events`` runs one engine step."""

    def __init__(self, kind: str, setup: RoleSetup) -> None:
        self.kind = kind
        self.role = _make_role(kind, setup)
        self.address = self.role.address
        self._queued: list[Message] = [Ready(self.address)]

    def send(self, cmd: tuple[Any, ...]) -> None:
        self._queued.extend(self.role.handle(cmd))

    def events(self, timeout: float) -> list[Message]:
        out, self._queued = self._queued, []
        out.extend(self.role.step())
        return out

    def stop(self, timeout: float) -> tuple[dict[str, Any], list[str]]:
        leftovers = self.role.shutdown()
        return self.role.stats(), [r.outcome.value for r in leftovers]

    def kill(self) -> None:
        self.role.shutdown()


@dataclass
class RequestRecord:
    """What happened to one request."""

    req: DemoRequest
    store_submitted: float | None = None
    loaded: Loaded | None = None
    stored: Stored | None = None
    pinned: list[Pinned] = field(default_factory=list)
    evicted: bool = False
    problems: list[str] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        if self.loaded is None:
            return False
        if self.req.order == "symmetric":
            return self.evicted
        return self.stored is not None


@dataclass
class Progress:
    """Counters the display reads while the replay runs."""

    done: int = 0
    failed: int = 0
    bytes_moved: int = 0
    samples: deque[tuple[float, int]] = field(default_factory=deque)

    def rate(self, now: float, window: float = 1.0) -> float:
        """GB/s over the last ``window`` seconds."""
        while self.samples and self.samples[0][0] < now - window:
            self.samples.popleft()
        return sum(b for _, b in self.samples) / window / 1e9


def replay(
    producer: RoleHandle,
    consumer: RoleHandle,
    stream: Sequence[DemoRequest],
    *,
    block_len: int,
    capacity: int,
    inflight: int,
    timeout: float,
    on_progress: Callable[[Progress], None] = lambda p: None,
) -> tuple[list[RequestRecord], float]:
    """Run the stream; returns the records and the wall time from the first admission to the
    last result. Raises ``DemoFailure``; the caller owns (and kills) the roles."""
    for role in (producer, consumer):
        _await_ready(role, timeout=60.0)
    router = _Router(producer, consumer, block_len)
    records = {r.index: RequestRecord(r) for r in stream}
    pending = deque(stream)
    active: dict[int, RequestRecord] = {}
    in_use = 0
    t_start = time.perf_counter()
    deadline = time.monotonic() + timeout
    last_change = time.monotonic()
    while pending or active:
        while pending and len(active) < inflight and in_use + pending[0].num_blocks <= capacity:
            req = pending.popleft()
            active[req.index] = records[req.index]
            in_use += req.num_blocks
            router.admit(req)
        if pending and not active:
            raise DemoFailure(
                f"request {pending[0].index} needs {pending[0].num_blocks} "
                f"blocks; the regions hold {capacity}"
            )
        got = _gather((producer, consumer))
        now = time.monotonic()
        if got:
            last_change = now
        for role, ev in got:
            if isinstance(ev, Fatal):
                raise DemoFailure(ev.reason)
            if isinstance(ev, (Ready, Stopped)):
                continue
            rec = records.get(ev.index)
            if rec is None:
                continue
            router.on_event(role.kind, ev, rec)
            if rec.finished and rec.req.index in active:
                del active[rec.req.index]
                in_use -= rec.req.num_blocks
                router.progress.done += 1
                router.progress.failed += bool(rec.problems)
        on_progress(router.progress)
        if now > deadline:
            raise DemoFailure(
                f"run exceeded --timeout {timeout}s with {len(active)} active "
                f"and {len(pending)} pending requests"
            )
        if now - last_change > 60.0:
            raise DemoFailure(f"no progress for 60 s; active requests: {sorted(active)}")
    return list(records.values()), time.perf_counter() - t_start


def _gather(handles: Sequence[RoleHandle]) -> list[tuple[RoleHandle, Message]]:
    procs = [h for h in handles if isinstance(h, ProcessRole)]
    if procs and len(procs) == len(handles):
        ready = wait([h.conn for h in procs], timeout=0.05)
        return [(h, ev) for h in procs if h.conn in ready for ev in h.events(0)]
    return [(h, ev) for h in handles for ev in h.events(0)]


def _await_ready(role: RoleHandle, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for ev in role.events(0.1):
            if isinstance(ev, Ready):
                role.address = ev.address
                return
            if isinstance(ev, Fatal):
                raise DemoFailure(ev.reason)
    raise DemoFailure(f"{role.kind} did not start within {timeout}s")


class _Router:
    """Sends each side its half of a request in the request's arrival order."""

    def __init__(self, producer: RoleHandle, consumer: RoleHandle, block_len: int) -> None:
        self.producer = producer
        self.consumer = consumer
        self.block_len = block_len
        self.target = format_address(*parse_address(producer.address))
        self.progress = Progress()

    def admit(self, req: DemoRequest) -> None:
        if req.order == "consumer_first":
            self.consumer.send(("load", req, self.target))
        elif req.order == "producer_first":
            self.producer.send(("store", req))
        else:
            self.producer.send(("cache", req))

    def on_event(self, kind: str, ev: Event, rec: RequestRecord) -> None:
        req = rec.req
        if isinstance(ev, Submitted):
            if kind == "consumer" and req.order == "consumer_first":
                self.producer.send(("store", req))
            elif kind == "producer":
                rec.store_submitted = ev.at
                if req.order == "producer_first":
                    self.consumer.send(("load", req, self.target))
                elif req.order == "symmetric":
                    self.consumer.send(("probe", req, self.target))
        elif isinstance(ev, Stored):
            rec.stored = ev
            if ev.outcome != "done":
                rec.problems.append(f"store {ev.outcome} {ev.detail}".strip())
        elif isinstance(ev, Pinned):
            rec.pinned.append(ev)
            if ev.outcome != "done":
                rec.problems.append(f"served store {ev.outcome} {ev.detail}".strip())
        elif isinstance(ev, Evicted):
            rec.evicted = True
        else:
            self._loaded(ev, rec)

    def _loaded(self, ev: Loaded, rec: RequestRecord) -> None:
        req = rec.req
        rec.loaded = ev
        if ev.outcome != "done":
            rec.problems.append(f"load {ev.outcome} {ev.detail}".strip())
        if ev.bad_blocks:
            rec.problems.append(f"{ev.bad_blocks} of {ev.blocks} blocks had wrong bytes")
        if ev.blocks != req.hits and ev.outcome == "done":
            rec.problems.append(f"loaded {ev.blocks} blocks, expected {req.hits}")
        moved = ev.blocks * self.block_len
        self.progress.bytes_moved += moved
        self.progress.samples.append((time.monotonic(), moved))
        if req.order == "symmetric":
            self.producer.send(("evict", req))
