"""Order-of-events checks over ``chaos_node.Recorder`` logs (entries ``(t, op, *fields)``).

Wire 2: **the consumer owns every write into its region**. The only transfers that land in a
node's region are the reads it posted itself (``read_blocks``), and a read that was cancelled
(or whose peer was removed or re-added, or whose transport was closed) is over for good. A
read is *live* from its ``read`` entry until the transport reported it (``end``), ``cancel``
ended it, or ``add_peer``/``remove_peer`` of its peer or ``close`` did. The rules:

- on the consumer (``read_violations``): every read goes into the slots of one load job open
  at that moment (never into slots the engine was handed back), and ends before that job's
  result: no read of ours lands or ends after its load's result;
- across the two processes (``pin_violations``): the producer hands a store job's slots back
  to its engine only when no consumer read of them is live, unless the lease has passed since
  the consumer sent its fetch (the consumer refuses a read completing later than that, so
  nothing it accepts can come from a reused slot);
- ``close`` (which deregisters the region) leaves nothing undrained (``close_problems``).

Entries are compared by their position in one node's log (appended in order); across nodes by
their timestamps (one monotonic clock per host).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["LEASE_DRIFT", "Read", "close_problems", "pin_violations", "read_violations", "reads"]

Entry = tuple[Any, ...]

LEASE_DRIFT = 0.01
"""``p2pkv.session.consumer_role.LEASE_DRIFT``: the share of the lease the consumer keeps back."""


@dataclass
class Read:
    tid: int
    peer: str
    local: frozenset[int]
    remote: frozenset[int]
    posted: float
    at: int
    """Position of the ``read`` entry in the log."""
    ended: float = math.inf
    """When it stopped being live (``inf``: never, as far as the log knows)."""
    ended_at: int = 1 << 62
    how: str = ""
    """``done``, ``failed``, ``cancel``, ``remove_peer``, ``add_peer`` or ``close``."""
    job: int | None = None
    """The load job whose slots it reads into (``read_violations`` sets it)."""
    job_submitted: float = math.nan


@dataclass
class _Job:
    job_id: int
    slots: frozenset[int]
    is_load: bool
    submitted: float
    result: str | None = None
    result_t: float = math.inf
    result_at: int = 1 << 62
    reads: list[Read] = field(default_factory=list)


def reads(log: Sequence[Entry]) -> list[Read]:
    """Every read in ``log`` with when and how it stopped being live."""
    out: list[Read] = []
    live: dict[int, Read] = {}

    def end(r: Read, t: float, i: int, how: str) -> None:
        r.ended, r.ended_at, r.how = t, i, how

    r: Read | None
    for i, e in enumerate(log):
        t, op = e[0], e[1]
        if op == "read":
            r = Read(e[2], e[3], frozenset(e[4]), frozenset(e[5]), t, i)
            out.append(r)
            live[r.tid] = r
        elif op == "end":
            r = live.pop(e[2], None)
            if r is not None:
                end(r, t, i, "done" if e[3] else "failed")
        elif op == "cancel":
            r = live.pop(e[2], None)
            if r is not None:
                end(r, t, i, "cancel")
        elif op in ("remove_peer", "add_peer"):
            for tid in [tid for tid, r in live.items() if r.peer == e[2]]:
                end(live.pop(tid), t, i, op)
        elif op == "close":
            for r in live.values():
                end(r, t, i, "close")
            live.clear()
    return out


def _jobs(log: Sequence[Entry], all_reads: list[Read]) -> tuple[dict[int, _Job], list[str]]:
    """Jobs of ``log`` with their reads attached; and reads into slots no open load owned."""
    jobs: dict[int, _Job] = {}
    owner: dict[int, _Job] = {}
    by_at = {r.at: r for r in all_reads}
    found: list[str] = []
    job: _Job | None
    for i, e in enumerate(log):
        t, op = e[0], e[1]
        if op == "submit":
            job = jobs[e[2]] = _Job(e[2], frozenset(e[3]), e[4], t)
            if job.is_load:
                for s in job.slots:
                    owner[s] = job
        elif op == "result":
            job = jobs.get(e[2])
            if job is None:
                continue
            job.result, job.result_t, job.result_at = e[3], t, i
            if job.is_load:
                for s in job.slots:
                    if owner.get(s) is job:
                        del owner[s]
        elif op == "read":
            r = by_at[i]
            owners = {id(owner.get(s)): owner.get(s) for s in r.local}
            if len(owners) != 1 or None in owners.values():
                free = sorted(s for s in r.local if s not in owner)
                found.append(
                    f"read {r.tid} from {r.peer} at {t:.6f} into slots {sorted(r.local)}"
                    f" not owned by one open load (unowned: {free})"
                )
                continue
            (job,) = owners.values()
            assert job is not None
            r.job, r.job_submitted = job.job_id, job.submitted
            job.reads.append(r)
    return jobs, found


def read_violations(log: Sequence[Entry]) -> list[str]:
    """Breaks of the consumer's rules (module docstring) within one node's log."""
    all_reads = reads(log)
    jobs, found = _jobs(log, all_reads)
    for job in jobs.values():
        if job.result is None:
            continue
        for r in job.reads:
            if r.ended_at > job.result_at:
                when = "never" if math.isinf(r.ended) else f"{r.ended:.6f} ({r.how})"
                found.append(
                    f"load job {job.job_id} answered {job.result} at "
                    f"{job.result_t:.6f} while its read {r.tid} from {r.peer} was "
                    f"live (posted {r.posted:.6f}, ended {when})"
                )
    return found


def close_problems(log: Sequence[Entry]) -> list[str]:
    """``close`` left internal transfers undrained (region left registered), or never ran."""
    closes = [e for e in log if e[1] == "close"]
    if not closes:
        return ["the data transport was never closed"]
    return [f"close() could not drain {e[2]}: region left registered" for e in closes if e[2]]


def pin_violations(
    producer_log: Sequence[Entry],
    consumer_log: Sequence[Entry],
    producer_address: str,
    lease: float,
) -> list[str]:
    """Store jobs of the producer answered (slots handed back to its engine) while a read of
    the consumer from them was live, before the lease since the consumer's fetch had passed."""
    results = [
        (e[0], e[2], e[3], frozenset(e[4]))
        for e in producer_log
        if e[1] == "result" and e[4] and not e[5]
    ]
    mine = reads(consumer_log)
    _jobs(consumer_log, mine)
    found: list[str] = []
    for r in mine:
        if r.peer != producer_address or r.job is None:
            continue
        store = next((x for x in results if x[0] > r.posted and x[3] & r.remote), None)
        if store is None:
            continue
        t, job_id, outcome, _ = store
        if outcome == "done":  # the consumer released it as read: its reads had all ended
            continue
        if r.ended > t and t < r.job_submitted + lease * (1 - LEASE_DRIFT):
            found.append(
                f"store job {job_id} answered {outcome} at {t:.6f}, "
                f"{t - r.job_submitted:.3f}s after the consumer submitted load "
                f"{r.job} (lease {lease}s), while its read {r.tid} of those slots was "
                f"live (posted {r.posted:.6f}, ended {r.ended:.6f} {r.how})"
            )
    return found
