"""One chaos node: a demo engine role (producer or consumer) driving a real ``P2PTier`` in its
own spawned process, with an audit of every job result and, optionally, a recording of every
data-transport call.

The roles are :mod:`p2pkv.demo.roles` (same key-derived block content, same byte
verification); this module only adds what the chaos suite needs around them:

- the node may enter a network namespace and set environment variables (``UCX_TLS``...) before
  any transport exists;
- :class:`AuditedTier` checks that every job id gets exactly one result (a second result, or
  a result for an id never submitted twice, is an *anomaly* the test asserts is absent) and
  holds ``shutdown``'s leftovers so they flow through the role like any other result;
- :class:`RecordingData` timestamps data-transport calls (writes with their slots, completions,
  confirmed cancels, peer removal, close), and the tier timestamps job results with their
  slots, so a test can check the order of events (``chaos_checks``).

Timestamps are ``time.monotonic()``: one clock for every process on the host, so events of
different nodes can be compared.

Pipe protocol (harness traffic only, never anything from a p2pkv wire). Parent -> node: a role
command tuple (``("load", req, target)``...), ``("batch", [cmd, ...])``, ``("report",)``,
``("memory",)`` or ``("stop",)``. Node -> parent: ``("ready", address, pid)``, ``("fatal", text)``,
``("events", t, [event, ...])`` (the roles' typed events, plus :class:`Recorded` entries when
recording),
``("report", t, dict)``, ``("memory", t, live_rss)`` and, on ``stop``, ``("stopping", t, None)``
just before the tier's shutdown starts, then ``("stopped", t, dict)`` last.
"""

from __future__ import annotations

import ctypes
import gc
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any

import psutil
from p2pkv.config import TierConfig
from p2pkv.contracts import CancelMode, ControlSettings, DataSettings, DataTransport, PollResult
from p2pkv.demo.roles import ConsumerRole, ProducerRole, RoleSetup
from p2pkv.registry import default_registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, JobResult
from p2pkv_memory.faults import FaultInjector, FaultyDataTransport

__all__ = [
    "AuditedTier", "NodeSpec", "Recorded", "Recorder", "RecordingData", "enter_netns", "node_main",
]

_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 0x80000
_MNT_DETACH = 2
_LIFETIME = 900.0  # seconds: a node never outlives this, whatever happens to its parent
_BUSY_TICK = 0.0002
_IDLE_WAIT = 0.002


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


def enter_netns(name: str) -> None:
    """Move this process into network namespace ``name`` the way ``ip netns exec`` does: join
    the namespace, then, in a private mount namespace, mount a fresh ``/sys`` so that
    ``/sys/class/net`` (where UCX finds its devices) shows the namespace's interfaces. Call it
    before any thread exists (threads inherit it)."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (network namespace {name}): {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


class Recorder:
    """Timestamped entries ``(t, op, *fields)``; see ``chaos_checks`` for what reads them.

    ``write tid peer local remote`` · ``end tid ok`` (reported by poll) · ``cancel tid``
    (cancel confirmed it stopped) · ``remove_peer peer undrained`` · ``close_begin`` ·
    ``close undrained`` · ``result job_id outcome slots is_load`` · ``shutdown_begin``.
    """

    def __init__(self) -> None:
        self.entries: list[tuple[Any, ...]] = []
        self._sent = 0

    def add(self, op: str, *fields: Any) -> None:
        self.entries.append((time.monotonic(), op, *fields))

    def take_new(self) -> list[tuple[Any, ...]]:
        new = self.entries[self._sent:]
        self._sent = len(self.entries)
        return new


class RecordingData(FaultyDataTransport):
    """A data transport that records every call that starts, ends or releases something.

    Built on the fault injector's delegating wrapper (with no fault armed it passes through).
    """

    def __init__(self, inner: DataTransport, recorder: Recorder) -> None:
        super().__init__(inner, FaultInjector(), "")
        self.recorder = recorder

    def write_blocks(self, peer_id: str, local_idxs: Sequence[int],
                     remote_idxs: Sequence[int]) -> int:
        tid = super().write_blocks(peer_id, local_idxs, remote_idxs)
        self.recorder.add("write", tid, peer_id, list(local_idxs), list(remote_idxs))
        return tid

    def poll(self, peer_id: str | None = None) -> PollResult:
        result = super().poll(peer_id)
        for tid in result.done:
            self.recorder.add("end", tid, True)
        for tid in result.failed:
            self.recorder.add("end", tid, False)
        return result

    def cancel(self, transfer_ids: Sequence[int], mode: CancelMode) -> list[int]:
        kept = super().cancel(transfer_ids, mode)
        for tid in set(transfer_ids) - set(kept):
            self.recorder.add("cancel", tid)
        return kept

    def remove_peer(self, peer_id: str) -> list[int]:
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
            self._jobs[job.job_id] = (list(job.block_ids), job.is_load)

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
        return [i for i, s in enumerate(self._submitted)
                if s and (i >= len(counts) or not counts[i])]


def _grow(buf: bytearray, index: int) -> None:
    if index >= len(buf):
        buf.extend(bytes(index + 1025 - len(buf)))


class _ChaosEngine:
    """Mixed into a demo role: builds the tier from our own transports (kept for reports)."""

    recorder: Recorder | None
    control: Any
    buf: Any
    block_len: int

    def make_tier(self, config: TierConfig) -> P2PTier:
        registry = default_registry()
        data: DataTransport = registry.transport("data", config.data).create(
            DataSettings(self.buf.data, self.block_len, config.data_options)
        )
        if self.recorder is not None:
            data = RecordingData(data, self.recorder)
        try:
            self.control = registry.transport("control", config.control).create(ControlSettings(
                config.host, config.port, max_frame_bytes=config.limits.max_frame_bytes,
                options=config.control_options,
            ))
        except BaseException:
            data.close()
            raise
        return AuditedTier(config, self.buf.data, self.block_len, registry=registry,
                           control=self.control, data=data, recorder=self.recorder)


class ChaosProducer(_ChaosEngine, ProducerRole):
    def __init__(self, setup: RoleSetup, recorder: Recorder | None) -> None:
        self.recorder = recorder
        super().__init__(setup)


class ChaosConsumer(_ChaosEngine, ConsumerRole):
    def __init__(self, setup: RoleSetup, recorder: Recorder | None) -> None:
        self.recorder = recorder
        super().__init__(setup)


def report(role: ChaosProducer | ChaosConsumer) -> dict[str, Any]:
    """What the parent asserts on: state sizes, counters, audit, control transport stats."""
    tier = role.tier
    assert isinstance(tier, AuditedTier)
    stats = getattr(role.control, "stats", None)
    return {
        "state_sizes": tier._state_sizes(),
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
    if spec.netns is not None:
        enter_netns(spec.netns)
    os.environ.update(spec.env)
    if spec.log_path is not None:
        logging.basicConfig(filename=spec.log_path, level=logging.INFO, force=True,
                            format="%(created).6f %(levelname)s %(name)s: %(message)s")
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
