"""One chaos node: a demo engine role (producer or consumer) driving a real ``P2PTier`` in its
own spawned process, with an audit of every job result and, optionally, a recording of every
data-transport call.

The roles are :mod:`p2pkv_tools.demo.roles` (same key-derived block content, same byte
verification); this module only adds what the chaos suite needs around them:

- the node may enter a network namespace (``enter_netns``: the bench's
  :func:`p2pkv_tools.bench.netns.join_namespace`) and set environment variables (``UCX_TLS``...)
  before any transport exists;
- :class:`AuditedTier` checks that every job id gets exactly one result (a second result, or
  a result for an id never submitted twice, is an *anomaly* the test asserts is absent) and
  holds ``shutdown``'s leftovers so they flow through the role like any other result;
- :class:`RecordingData` timestamps data-transport calls (our reads with their slots, their
  completions, cancels, peers added and removed, close), and the tier timestamps job
  submissions and results with their slots, so a test can check the order of events
  (``chaos_checks``);
- **canaries**: slots the engine got back (a failed load's, a resolved store's) can be kept
  out of the free list and filled with a canary, then checked while the node keeps ticking: no
  transfer may change a byte of them (the consumer owns every write into its region).

Timestamps are ``time.monotonic()``: one clock for every process on the host, so events of
different nodes can be compared.

Pipe protocol (harness traffic only, never anything from a p2pkv wire). Parent -> node: a role
command tuple (``("load", req, target)``...), ``("load_again", req, target)`` (consumer: a
second load of a request's keys under its ``kv_request_id`` while the first is open; its result
comes back as an :class:`Again` event), ``("batch", [cmd, ...])``, ``("report",)``,
``("memory",)``, ``("canary", op)``, ``("pause_on_read", pid, peer, n)`` (recording node:
SIGSTOP ``pid`` right after the reads posted from ``peer`` cover ``n`` blocks; answered
``("pause_on_read", t, None)`` once armed) or ``("stop",)``. Canary ops: ``"failed"`` (from now
on, the slots of every failed load, and of every resolved store, are kept and canaried),
``"free"`` (canary every free slot now), ``"check"``, ``"release"`` (the slots go back to the
free list, the mode ends). Node -> parent: ``("ready", address, pid)``, ``("fatal", text)``,
``("events", t, [event, ...])`` (the roles' typed events, plus :class:`Recorded` entries when
recording), ``("report", t, dict)``, ``("memory", t, live_rss)``, ``("canary", t, dict)``
(after every canary op: slots canaried, the changed ones, changed bytes) and, on ``stop``,
``("stopping", t, None)`` just before the tier's shutdown starts, then ``("stopped", t, dict)``
last.
"""

from __future__ import annotations

import ctypes
import faulthandler
import gc
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import psutil
from p2pkv.config import TierConfig
from p2pkv.contracts import ControlSettings, DataSettings, DataTransport, PollResult
from p2pkv.reference.delegating import DelegatingDataTransport
from p2pkv.registry import default_registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult, Outcome
from p2pkv_tools.bench.netns import join_namespace as enter_netns
from p2pkv_tools.demo.roles import ConsumerRole, Event, ProducerRole, RoleSetup, _Load

__all__ = [
    "CANARY",
    "Again",
    "AuditedTier",
    "NodeSpec",
    "Recorded",
    "Recorder",
    "RecordingData",
    "enter_netns",
    "node_main",
]

_LIFETIME = 900.0  # seconds: a node never outlives this, whatever happens to its parent
_BUSY_TICK = 0.0002
_IDLE_WAIT = 0.002
CANARY = 0xC3A5_5AC3_0FF1_CE00
"""Canary words: slot ``s`` holds ``CANARY ^ s`` in every 64-bit word (no key's content)."""


@dataclass(frozen=True)
class NodeSpec:
    """How to start a node (picklable: it crosses into the spawned child)."""

    kind: str
    """``producer`` or ``consumer``."""
    setup: RoleSetup
    netns: str | None = None
    """Network namespace (a name under ``/run/netns``) the node lives in."""
    env: Mapping[str, str] = field(default_factory=dict)
    """Set before any transport is built."""
    record: bool = False
    """Record data-transport calls and job results, streamed as :class:`Recorded` events."""
    log_path: str | None = None
    """Write the node's log records (INFO and up) to this file."""


@dataclass(frozen=True)
class Recorded:
    """A recorder entry streamed to the parent as an event."""

    entry: tuple[Any, ...]


@dataclass(frozen=True)
class Again:
    """The result of a ``load_again`` (a second load of request ``index``'s keys)."""

    index: int
    outcome: str
    detail: str
    submitted_at: float
    done_at: float
    bad_blocks: int = 0


class Recorder:
    """Timestamped entries ``(t, op, *fields)``; see ``chaos_checks`` for what reads them.

    ``read tid peer local remote`` (a read we posted: the peer's blocks ``remote`` into our
    ``local``) · ``end tid ok`` (reported by poll) · ``cancel tid`` (ended by ``cancel``:
    final) · ``add_peer peer`` (re-adding ends the peer's reads) · ``remove_peer_begin peer``
    (the call starts) · ``remove_peer peer undrained`` (it returned: the peer's reads ended;
    ``undrained``: internal transfers kept) ·
    ``close_begin`` · ``close undrained`` (ends every read) · ``submit job_id slots is_load`` ·
    ``result job_id outcome slots is_load`` · ``shutdown_begin`` · ``paused_source pid peer``.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[Any, ...]] = []
        self._sent = 0

    def add(self, op: str, *fields: Any) -> None:
        self.entries.append((time.monotonic(), op, *fields))

    def take_new(self) -> list[tuple[Any, ...]]:
        new = self.entries[self._sent :]
        self._sent = len(self.entries)
        return new


class RecordingData(DelegatingDataTransport):
    """A data transport that records every call that starts, ends or releases something."""

    def __init__(self, inner: DataTransport, recorder: Recorder) -> None:
        super().__init__(inner)
        self.recorder = recorder
        self._live: set[int] = set()
        self.pause_on_read: tuple[int, str, int] | None = None
        """``(pid, peer, n)``: SIGSTOP process ``pid`` right after our reads posted from
        ``peer`` cover ``n`` blocks (once), so the reads that follow stay in flight until it
        is resumed. Blocks, not reads: how many reads carry them depends on how the tier
        batched its loads, which a loaded machine changes."""

    def add_peer(self, peer_id: str, descriptor: bytes) -> None:
        super().add_peer(peer_id, descriptor)
        self.recorder.add("add_peer", peer_id)

    def read_blocks(
        self, peer_id: str, local_idxs: Sequence[int], remote_idxs: Sequence[int]
    ) -> int:
        tid = super().read_blocks(peer_id, local_idxs, remote_idxs)
        self._live.add(tid)
        self.recorder.add(
            "read", tid, peer_id, [int(i) for i in local_idxs], [int(i) for i in remote_idxs]
        )
        if self.pause_on_read is not None and self.pause_on_read[1] == peer_id:
            pid, peer, n = self.pause_on_read
            n -= len(local_idxs)
            self.pause_on_read = (pid, peer, n) if n > 0 else None
            if n <= 0:
                os.kill(pid, signal.SIGSTOP)
                self.recorder.add("paused_source", pid, peer_id)
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = super().poll(peer_id)
        for tid in result.done:
            self._live.discard(tid)
            self.recorder.add("end", tid, True)
        for tid in result.failed:
            self._live.discard(tid)
            self.recorder.add("end", tid, False)
        return result

    def cancel(self, transfer_ids: Sequence[int]) -> None:
        super().cancel(transfer_ids)
        for tid in transfer_ids:
            if tid in self._live:
                self._live.discard(tid)
                self.recorder.add("cancel", tid)

    def remove_peer(self, peer_id: str) -> list[int]:
        self.recorder.add("remove_peer_begin", peer_id)
        left = super().remove_peer(peer_id)
        self.recorder.add("remove_peer", peer_id, list(left))
        return left

    def close(self) -> list[int]:
        self.recorder.add("close_begin")
        left = super().close()
        self.recorder.add("close", list(left))
        return left


class AuditedTier(P2PTier):
    """A ``P2PTier`` whose results are audited (exactly one per job) and optionally recorded."""

    def __init__(self, *args: Any, recorder: Recorder | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.recorder = recorder
        self.anomalies: list[str] = []
        self._results_per_id = bytearray()  # job id -> 1 once answered (ids are small counters)
        self._submitted = bytearray()
        self._jobs: dict[int, tuple[list[int], bool]] = {}  # recorded: id -> (slots, is_load)
        self._held: list[JobResult] = []

    def _note_submit(self, job: Job) -> None:
        _grow(self._submitted, job.job_id)
        self._submitted[job.job_id] = 1
        if self.recorder is not None:
            slots = [int(s) for s in job.block_ids]
            self._jobs[job.job_id] = (slots, job.is_load)
            self.recorder.add("submit", job.job_id, slots, job.is_load)

    def submit_store(self, job: Job) -> None:
        self._note_submit(job)
        super().submit_store(job)

    def submit_load(self, job: Job) -> None:
        self._note_submit(job)
        super().submit_load(job)

    def get_finished_jobs(self) -> list[JobResult]:
        results = self._held + super().get_finished_jobs()
        self._held = []
        counts = self._results_per_id
        for r in results:
            _grow(counts, r.job_id)
            if counts[r.job_id]:
                self.anomalies.append(f"job {r.job_id}: second result {r.outcome.value}")
            counts[r.job_id] = 1
            if self.recorder is not None:
                slots, is_load = self._jobs.pop(r.job_id, (None, False))
                self.recorder.add("result", r.job_id, r.outcome.value, slots, is_load)
        return results

    def shutdown(self) -> list[JobResult]:
        """Shut down; the leftovers are also handed out by the next ``get_finished_jobs``."""
        if self.recorder is not None:
            self.recorder.add("shutdown_begin")
        leftovers = super().shutdown()
        self._held.extend(leftovers)
        return list(leftovers)

    def unanswered(self) -> list[int]:
        """Submitted job ids without a result so far."""
        counts = self._results_per_id
        return [
            i for i, s in enumerate(self._submitted) if s and (i >= len(counts) or not counts[i])
        ]


def _grow(buf: bytearray, index: int) -> None:
    if index >= len(buf):
        buf.extend(bytes(index + 1025 - len(buf)))


class _ChaosEngine:
    """Mixed into a demo role: builds the tier from our own transports (kept for reports) and
    keeps canaries in slots the engine got back."""

    recorder: Recorder | None
    control: Any
    buf: Any
    block_len: int
    region: Any
    _free: list[int]

    def make_tier(self, config: TierConfig) -> P2PTier:
        self.canary_mode = False
        self.canaries: dict[int, float] = {}
        """Canaried slots (out of the free list) -> when the canary was written."""
        registry = default_registry()
        data: DataTransport = registry.transport("data", config.data).create(
            DataSettings(self.buf.data, self.block_len, config.data_options)
        )
        self.recording: RecordingData | None = None
        if self.recorder is not None:
            data = self.recording = RecordingData(data, self.recorder)
        try:
            self.control = registry.transport("control", config.control).create(
                ControlSettings(
                    config.host,
                    config.port,
                    max_frame_bytes=config.limits.max_frame_bytes,
                    options=config.control_options,
                    handshake_timeout=config.timeouts.handshake,
                )
            )
        except BaseException:
            data.close()
            raise
        return AuditedTier(
            config,
            self.buf.data,
            self.block_len,
            registry=registry,
            control=self.control,
            data=data,
            recorder=self.recorder,
        )

    # -- canaries ---------------------------------------------------------------------------

    def canary_fill(self, slots: Sequence[int]) -> None:
        """Take ``slots`` out of the free list (the engine reused them) and canary them."""
        new = {int(s) for s in slots} - self.canaries.keys()
        if not new:
            return
        self._free = [s for s in self._free if s not in new]
        now = time.monotonic()
        words = self.region.words
        for slot in new:
            words[slot] = np.uint64(CANARY ^ slot)
            self.canaries[slot] = now

    def canary_check(self) -> dict[str, Any]:
        """Which canaried slots changed, and how many of their bytes."""
        words = self.region.words
        changed: list[int] = []
        nbytes = 0
        for slot in self.canaries:
            row = words[slot]
            want = np.uint64(CANARY ^ slot)
            if (row != want).any():
                changed.append(slot)
                expected = np.full(row.shape, want, np.uint64)
                nbytes += int(np.count_nonzero(row.view(np.uint8) != expected.view(np.uint8)))
        return {
            "slots": len(self.canaries),
            "changed": changed,
            "changed_bytes": nbytes,
            "oldest": min(self.canaries.values(), default=None),
        }

    def canary(self, op: str) -> dict[str, Any]:
        if op == "failed":
            self.canary_mode = True
        elif op == "free":
            self.canary_fill(list(self._free))
        elif op == "release":
            self.canary_mode = False
            slots = list(self.canaries)
            self.canaries.clear()
            self._free.extend(slots)
        elif op != "check":
            raise ValueError(f"unknown canary op {op!r}")
        return self.canary_check()


class ChaosProducer(_ChaosEngine, ProducerRole):
    def __init__(self, setup: RoleSetup, recorder: Recorder | None) -> None:
        self.recorder = recorder
        super().__init__(setup)

    def _finished(self, result: JobResult) -> list[Event]:
        stored = self._stores.get(result.job_id)
        events = super()._finished(result)
        if stored is not None and self.canary_mode:
            self.canary_fill(stored[2])  # the engine reuses a resolved store's slots at once
        return events


class ChaosConsumer(_ChaosEngine, ConsumerRole):
    def __init__(self, setup: RoleSetup, recorder: Recorder | None) -> None:
        self.recorder = recorder
        super().__init__(setup)
        self._again: dict[int, _Load] = {}

    def handle(self, cmd: tuple[Any, ...]) -> list[Event]:
        if cmd[0] == "load_again":
            return self._load_again(cmd[1])
        return super().handle(cmd)

    def _load_again(self, req: Any) -> list[Any]:
        """Submit a second load of ``req``'s keys, under the same request, into new slots."""
        first = next((ld for ld in self._loads.values() if ld.req.index == req.index), None)
        if first is None:
            raise ValueError(f"load_again: request {req.index} has no open load")
        again = _Load(
            req,
            first.ctx,
            list(first.keys),
            self.take_slots(len(first.keys)),
            self.next_job_id(),
            time.monotonic(),
        )
        self._again[again.job_id] = again
        self.tier.submit_load(
            Job(again.job_id, again.keys, again.slots, is_load=True, ctx=again.ctx)
        )
        return []

    def _finished(self, result: JobResult) -> list[Any]:
        again = self._again.pop(result.job_id, None)
        if again is not None:  # never finishes the request: its first load is still open
            bad = 0
            if result.outcome is Outcome.DONE:
                bad = len(self.region.verify(again.slots, again.keys))
            else:
                self.region.poison(again.slots)
            self.free_slots(again.slots)
            return [
                Again(
                    again.req.index,
                    result.outcome.value,
                    result.detail,
                    again.started,
                    time.monotonic(),
                    bad,
                )
            ]
        load = self._loads.get(result.job_id)
        events = super()._finished(result)
        if load is not None and self.canary_mode and result.outcome is not Outcome.DONE:
            self.canary_fill(load.slots)  # the engine reuses a failed load's slots at once
        return events

    @property
    def busy(self) -> bool:
        return bool(self._loads or self._probing or self._again)


def report(role: ChaosProducer | ChaosConsumer) -> dict[str, Any]:
    """What the parent asserts on: state sizes, counters, audit, control transport stats."""
    tier = role.tier
    assert isinstance(tier, AuditedTier)
    stats = getattr(role.control, "stats", None)
    return {
        "state_sizes": tier.state_sizes(),
        "stats": tier.stats(),
        "control": stats() if stats is not None else {},
        "anomalies": list(tier.anomalies),
        "unanswered": tier.unanswered(),
        "pending_work": tier.has_pending_work(),
        "busy": role.busy,
    }


def live_rss() -> int:
    """RSS after a garbage collection and ``malloc_trim``: memory actually in use, without
    what the allocator keeps cached after a burst (the number a leak check compares)."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:  # not glibc: the plain RSS
        pass
    return int(psutil.Process().memory_info().rss)


def node_main(conn: Connection, spec: NodeSpec) -> None:
    """Child entry (run through ``p2pkv.testing.child.Child``): build the role, then run engine
    steps and answer the parent until told to stop or the pipe closes."""
    faulthandler.enable()  # a crash in a native library prints where Python was
    if spec.netns is not None:
        enter_netns(spec.netns)
    os.environ.update(spec.env)
    if spec.log_path is not None:
        logging.basicConfig(
            filename=spec.log_path,
            level=logging.INFO,
            force=True,
            format="%(created).6f %(levelname)s %(name)s: %(message)s",
        )
    recorder = Recorder() if spec.record else None
    try:
        cls = ChaosProducer if spec.kind == "producer" else ChaosConsumer
        role = cls(spec.setup, recorder)
    except Exception as exc:
        conn.send(("fatal", f"{spec.kind} failed to start: {type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", role.address, os.getpid()))
    deadline = time.monotonic() + _LIFETIME
    try:
        while time.monotonic() < deadline:
            events: list[Any] = []
            while conn.poll(0):
                cmd = conn.recv()
                op = cmd[0]
                if op == "stop":
                    conn.send(("stopping", time.monotonic(), None))
                    role.shutdown()
                    events.extend(role.step())  # the leftovers, through the role like any result
                    _send_events(conn, events, recorder)
                    conn.send(("stopped", time.monotonic(), report(role)))
                    return
                if op == "report":
                    conn.send(("report", time.monotonic(), report(role)))
                elif op == "memory":
                    conn.send(("memory", time.monotonic(), live_rss()))
                elif op == "canary":
                    conn.send(("canary", time.monotonic(), role.canary(cmd[1])))
                elif op == "pause_on_read":
                    if role.recording is None:
                        raise ValueError("pause_on_read needs a recording node")
                    role.recording.pause_on_read = (cmd[1], cmd[2], cmd[3])
                    conn.send(("pause_on_read", time.monotonic(), None))
                elif op == "batch":
                    for sub in cmd[1]:
                        events.extend(role.handle(sub))
                else:
                    events.extend(role.handle(cmd))
            events.extend(role.step())
            if not _send_events(conn, events, recorder):
                if role.busy or role.tier.has_pending_work():
                    role.tier.tick(_BUSY_TICK)
                else:
                    conn.poll(_IDLE_WAIT)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        pass
    except Exception as exc:
        logging.getLogger("chaos").exception("node failed")
        conn.send(("fatal", f"{spec.kind}: {type(exc).__name__}: {exc}"))
    role.shutdown()


def _send_events(conn: Connection, events: list[Any], recorder: Recorder | None) -> bool:
    if recorder is not None:
        events.extend(Recorded(entry) for entry in recorder.take_new())
    if not events:
        return False
    conn.send(("events", time.monotonic(), events))
    return True
