"""The producer's state of one request: its supply, its demand, and matching the two.

Per ``kv_request_id`` a producer role keeps the **supply** and the **demand**. Supply is the
blocks the engine stored and nobody fetched yet (key -> our slot, key -> its store job).
Demand is the keys of the consumer's open fetch rounds (key -> round, key -> position).
Matching is a method of the request: each call returns the blocks that are now ready, and
the role pins them and tells the consumer. Nothing here sends, arms timers or reports.

Parallel dicts rather than a tuple per entry: no per-block objects beyond the dict entries.

Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from p2pkv.session.deadlines import Timer
from p2pkv.types import Outcome


class StoreJob:
    """One store job of the engine, offered to one consumer."""

    __slots__ = (
        "delivered",
        "done",
        "failure",
        "job_id",
        "keys",
        "pinned",
        "released",
        "remaining",
        "req",
        "timed_out",
        "timer",
    )

    def __init__(self, job_id: int, req: ProducerRequest, keys: Sequence[bytes]) -> None:
        self.job_id = job_id
        self.req = req
        self.keys = keys
        self.remaining = len(keys)
        """Blocks neither delivered nor superseded."""
        self.pinned = 0
        """Blocks of this job named in a ``ready`` and not yet released or expired."""
        self.delivered = 0
        self.failure: tuple[Outcome, str] | None = None
        self.released = False
        """The consumer is done with the request: undelivered blocks are not needed."""
        self.done = False
        self.timed_out = False
        """The store deadline passed. The job fails unless every block was delivered, once
        no block is pinned any more."""
        self.timer: Timer | None = None


class FetchRound:
    """One fetch of the consumer: how many keys still wait, and what it pins."""

    __slots__ = ("failure", "no", "pins", "req", "timer", "unready", "waiting")

    def __init__(self, req: ProducerRequest, no: int, size: int) -> None:
        self.req = req
        self.no = no
        self.unready = size
        """Keys not yet named in a ``ready``."""
        self.waiting = 0
        """Keys demanded with no supply yet."""
        self.pins: dict[StoreJob, int] = {}
        """Store job -> how many of its blocks this round pins (in the order first pinned)."""
        self.failure: tuple[Outcome, str] | None = None
        """Set once ``round_failed`` went out (the round waits for its pins only)."""
        self.timer: Timer | None = None


class Batch(NamedTuple):
    """Blocks of one round matched at once: key positions, our slots, their store jobs."""

    pos: list[int]
    src: list[int]
    jobs: list[StoreJob]


class ProducerRequest:
    """Supply, demand and rounds of one ``kv_request_id`` (see the module docstring)."""

    __slots__ = (
        "demand",
        "demand_pos",
        "jobs",
        "kv",
        "max_round",
        "released",
        "rounds",
        "supply",
        "supply_job",
        "supply_open",
    )

    def __init__(self, kv: str, supply_open: bool) -> None:
        self.kv = kv
        self.supply: dict[bytes, int] = {}
        """Key -> our slot holding it (with ``supply_job``: the job that pins it)."""
        self.supply_job: dict[bytes, StoreJob] = {}
        self.demand: dict[bytes, FetchRound] = {}
        """Key -> the open round waiting for it (with ``demand_pos``: its position there)."""
        self.demand_pos: dict[bytes, int] = {}
        self.rounds: dict[int, FetchRound] = {}
        self.jobs: set[StoreJob] = set()
        self.max_round = -1
        self.supply_open = supply_open
        """More stores may come (the local producer request is running)."""
        self.released = False
        """A terminal fetch ended the request."""

    def add_supply(self, sj: StoreJob, slots: Sequence[int]) -> dict[FetchRound, Batch]:
        """Offer ``sj``'s blocks (its keys, in ``slots``).

        Keys a round waits for are matched at once and returned, per round. The rest join
        the supply; a key already supplied by an earlier job counts as superseded.
        """
        supply, supply_job, demand = self.supply, self.supply_job, self.demand
        keys = sj.keys
        if not demand and supply.keys().isdisjoint(keys):  # nothing to match: just hold them
            before = len(supply)
            supply.update(zip(keys, slots, strict=True))
            supply_job.update(dict.fromkeys(keys, sj))
            sj.remaining -= len(keys) - (len(supply) - before)  # a key twice in one job
            return {}
        matched: dict[FetchRound, Batch] = {}
        for key, slot in zip(keys, slots, strict=True):
            rnd = demand.pop(key, None)
            if rnd is None:
                if key in supply:
                    sj.remaining -= 1  # an earlier job holds this key already
                else:
                    supply[key] = slot
                    supply_job[key] = sj
                continue
            rnd.waiting -= 1
            batch = matched.get(rnd)
            if batch is None:
                batch = matched[rnd] = Batch([], [], [])
            batch.pos.append(self.demand_pos.pop(key))
            batch.src.append(slot)
            batch.jobs.append(sj)
        return matched

    def add_demand(self, rnd: FetchRound, keys: list[bytes], held_all: bool) -> Batch | None:
        """Demand ``keys`` for ``rnd``: the held ones are matched at once (returned), the
        others wait for supply. ``held_all``: the supply holds every key."""
        supply, supply_job, demand, demand_pos = (
            self.supply,
            self.supply_job,
            self.demand,
            self.demand_pos,
        )
        if held_all:  # producer first: everything is here (C-level passes)
            return Batch(
                list(range(len(keys))), list(map(supply.pop, keys)), list(map(supply_job.pop, keys))
            )
        if not supply:  # consumer first: everything waits
            demand.update(dict.fromkeys(keys, rnd))
            demand_pos.update(zip(keys, range(len(keys)), strict=True))
            rnd.waiting = len(keys)
            return None
        batch = Batch([], [], [])
        for i, k in enumerate(keys):
            held = supply.pop(k, None)
            if held is None:
                demand[k] = rnd
                demand_pos[k] = i
                rnd.waiting += 1
            else:
                batch.pos.append(i)
                batch.src.append(held)
                batch.jobs.append(supply_job.pop(k))
        return batch if batch.pos else None

    def holds_all(self, keys: list[bytes]) -> bool:
        return self.supply.keys() >= set(keys)

    def missing(self, keys: list[bytes]) -> int:
        """How many of ``keys`` the supply does not hold."""
        supply = self.supply
        return sum(1 for k in keys if k not in supply)

    def conflict(self, keys: list[bytes]) -> str:
        """Why a new round asking for ``keys`` cannot be served, or ``""``."""
        if self.released:
            return f"{self.kv!r} was already ended by a terminal fetch"
        demand = self.demand
        if demand and not demand.keys().isdisjoint(keys):
            k = next(k for k in keys if k in demand)
            return f"a key is already demanded by round {demand[k].no} of {self.kv!r}"
        return ""

    def drop_waiting(self, rnd: FetchRound) -> None:
        """Forget the demand of ``rnd`` that no supply met yet."""
        if rnd.waiting:
            for k in [k for k, r in self.demand.items() if r is rnd]:
                del self.demand[k]
                del self.demand_pos[k]
            rnd.waiting = 0

    def withdraw(self, sj: StoreJob) -> None:
        """Offer none of ``sj``'s blocks any more."""
        supply, supply_job = self.supply, self.supply_job
        if supply:
            for key in sj.keys:
                if supply_job.get(key) is sj:
                    del supply[key]
                    del supply_job[key]

    def clear_supply(self) -> None:
        self.supply.clear()
        self.supply_job.clear()
