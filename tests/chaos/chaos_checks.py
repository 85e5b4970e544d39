"""Order-of-events checks over ``chaos_node.Recorder`` logs (entries ``(t, op, *fields)``).

A write is *live* from its ``write`` entry until the transport reported it (``end``), a cancel
confirmed it stopped (``cancel``), or ``remove_peer`` returned without listing it. The rules:

- a store job's result (the engine unpins and reuses its slots) never comes while a write
  reading those slots is live;
- ``remove_peer`` is called only when no write to that peer is live (the tier waits for the
  transport's quiescence rather than relying on the transport's own drain);
- ``close`` (which deregisters the region) starts with no write live and drains everything.

``inbound_violations`` applies the same rule across two nodes: a consumer hands a load's slots
back to its engine (or deregisters its region) only when no write of the producer into those
slots is live.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Write", "inbound_violations", "overlapping_writes", "release_violations", "writes"]

Entry = tuple[Any, ...]


@dataclass
class Write:
    tid: int
    peer: str
    local: frozenset[int]
    remote: frozenset[int]
    posted: float
    ended: float = math.inf
    """When it stopped being live (``inf``: never, as far as the log knows)."""


def writes(log: Sequence[Entry]) -> list[Write]:
    """Every write in ``log`` with the time it stopped being live."""
    out: dict[int, Write] = {}
    live: dict[int, Write] = {}
    for e in log:
        t, op = e[0], e[1]
        if op == "write":
            w = out[e[2]] = live[e[2]] = Write(e[2], e[3], frozenset(e[4]), frozenset(e[5]), t)
        elif op in ("end", "cancel"):
            w = live.pop(e[2], None)
            if w is not None:
                w.ended = t
        elif op == "remove_peer":
            for tid in [tid for tid, w in live.items() if w.peer == e[2] and tid not in e[3]]:
                live.pop(tid).ended = t
    return list(out.values())


def release_violations(log: Sequence[Entry], give_up_after: float = math.inf) -> list[str]:
    """Breaks of the rules in the module docstring within one node's log."""
    found: list[str] = []
    live: dict[int, tuple[str, frozenset[int], float]] = {}
    for e in log:
        op = e[1]
        if op == "write":
            live[e[2]] = (e[3], frozenset(e[4]), e[0])
        elif op in ("end", "cancel"):
            live.pop(e[2], None)
        elif op == "result":
            t, _, job_id, outcome, slots, is_load = e
            if slots and not is_load:
                busy = sorted(tid for tid, (_, s, posted) in live.items()
                              if s & set(slots) and t - posted < give_up_after)
                if busy:
                    found.append(f"store job {job_id} answered {outcome} while write(s) {busy} "
                                 f"reading its slots were live")
        elif op == "remove_peer":
            peer, undrained = e[2], e[3]
            busy = sorted(tid for tid, (p, _, _) in live.items() if p == peer)
            if busy:
                found.append(f"remove_peer({peer}) called with write(s) {busy} live")
            for tid in busy:
                if tid not in undrained:
                    del live[tid]
        elif op == "close_begin" and live:
            found.append(f"close() started with write(s) {sorted(live)} live")
        elif op == "close" and e[2]:
            found.append(f"close() could not drain write(s) {e[2]}: region left registered")
    return found


def inbound_violations(producer_log: Sequence[Entry], consumer_log: Sequence[Entry],
                       consumer_address: str) -> list[str]:
    """Times the consumer released slots (a load's result) or deregistered its region
    (``close_begin``) while a producer write into them was live, or before one was posted."""
    into = [w for w in writes(producer_log) if w.peer == consumer_address]
    found: list[str] = []
    for e in consumer_log:
        t, op = e[0], e[1]
        if op == "result" and e[5] and e[4]:
            slots = set(e[4])
            for w in into:
                if w.remote & slots and w.posted <= t < w.ended:
                    found.append(f"load job {e[2]} answered {e[3]} at {t:.6f} while producer "
                                 f"write {w.tid} into its slots was live "
                                 f"({w.posted:.6f}..{w.ended:.6f})")
        elif op == "close_begin":
            for w in into:
                if w.ended > t:
                    found.append(f"consumer deregistered its region at {t:.6f} while producer "
                                 f"write {w.tid} was live ({w.posted:.6f}..{w.ended:.6f})")
    return found


def overlapping_writes(log: Sequence[Entry]) -> list[str]:
    """Writes posted into a peer's slot while an earlier write into that slot was live."""
    found: list[str] = []
    for w in (ws := writes(log)):
        older = [o.tid for o in ws if o.peer == w.peer and o.tid != w.tid
                 and o.posted <= w.posted < o.ended and o.remote & w.remote]
        if older:
            found.append(f"write {w.tid} to {w.peer} posted at {w.posted:.6f} into slots that "
                         f"write(s) {older} were still writing")
    return found
