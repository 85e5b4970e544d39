"""The consumer's state of one request: its load rounds, and the rules a new load meets.

Each ``submit_load`` becomes one :class:`LoadRound` of its ``kv_request_id``. Rounds are
numbered per request and session, and complete independently. A load may not ask for a key
an open round is loading, nor one a finished round loaded whose result the engine has not
taken yet. Nothing here sends, arms timers or reports.

Threading: driver thread only.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence

from p2pkv.errors import ProtocolError
from p2pkv.session.deadlines import Timer
from p2pkv.session.ledger import JobLedger
from p2pkv.session.reads import HeldRead
from p2pkv.types import Job


class Phase(enum.IntEnum):
    """Where a load round is: waiting for READY, fetch sent, ended."""

    UNSENT = 0
    ACTIVE = 1
    DONE = 2


class Probe(enum.IntEnum):
    """Where a probed key is: not sent yet, asked, answered."""

    PENDING = 0
    INFLIGHT = 1
    MISS = 2
    HIT = 3


class LoadRound:
    """One load job of the engine: its fetch, the reads into our slots, its deadline."""

    __slots__ = (
        "announced",
        "held",
        "job_id",
        "keys",
        "no",
        "opened",
        "phase",
        "reads",
        "req",
        "sent_at",
        "slots",
        "timer",
        "unread",
    )

    def __init__(self, req: ConsumerRequest, no: int, job: Job) -> None:
        self.req = req
        self.no = no
        self.job_id = job.job_id
        self.keys: Sequence[bytes] = job.keys
        self.slots = job.block_ids
        self.phase = Phase.UNSENT
        self.opened = False
        """Counted open in the session's load window (from its turn until it ends)."""
        self.held: list[HeldRead] = []
        """Reads announced by a ``ready`` and waiting in the read gate for room."""
        self.sent_at = 0.0
        """Our clock when the fetch went out: the lease is counted from here."""
        self.announced: set[int] = set()
        """Key positions a ``ready`` named."""
        self.unread = len(job.keys)
        """Blocks whose read has not completed."""
        self.reads: dict[int, tuple[int, float]] = {}
        """Our reads in flight: transfer id -> (blocks, when posted)."""
        self.timer: Timer | None = None

    @property
    def nblocks(self) -> int:
        return len(self.keys)

    def announce(self, pos: list[int]) -> list[int]:
        """Record the key positions a ``ready`` names; returns our slots for them.
        ``ProtocolError`` when one is outside the round or was named before."""
        n = len(self.keys)
        announced = self.announced
        if max(pos) >= n or len(set(pos)) != len(pos) or not announced.isdisjoint(pos):
            bad = _first_bad_position(pos, n, announced)
            raise ProtocolError(
                f"ready.pos: position {bad} is outside the round's {n} "
                f"key(s) or was already announced"
            )
        announced.update(pos)
        return list(map(self.slots.__getitem__, pos))


class ConsumerRequest:
    """Load rounds and probes of one ``kv_request_id``."""

    __slots__ = (
        "contacted",
        "failed",
        "finished",
        "kv",
        "loaded",
        "next_round",
        "open_keys",
        "probes",
        "released",
        "rounds",
        "unsent_keys",
    )

    def __init__(self, kv: str) -> None:
        self.kv = kv
        self.next_round = 0
        self.rounds: dict[int, LoadRound] = {}
        self.open_keys: set[bytes] = set()
        """Keys of the open rounds: a load may not ask for one again (request conflict)."""
        self.loaded: dict[int, Sequence[bytes]] = {}
        """Job id -> keys of rounds done whose result the engine may not have taken yet: a
        load of one of those keys conflicts too, until the engine has the result."""
        self.contacted = False
        """A fetch or lookup for this request was sent to the peer."""
        self.finished = False
        self.failed = False
        self.released = False
        self.probes: dict[bytes, Probe] = {}
        self.unsent_keys: list[bytes] = []

    def conflict(self, job: Job, ledger: JobLedger) -> str:
        """Why ``job`` cannot be a new round here (only this job fails), or ``""``."""
        if self.released:
            return (
                f"request {self.kv!r} was already ended with its producer (finished or an "
                f"earlier load failed); a new load needs a new kv_request_id"
            )
        if self.open_keys and not self.open_keys.isdisjoint(job.keys):
            wanted = set(job.keys)
            busy = next(r for r in self.rounds.values() if not wanted.isdisjoint(r.keys))
            return (
                f"{len(self.open_keys.intersection(job.keys))} of its blocks are already "
                f"being loaded for request {self.kv!r} by job {busy.job_id}"
            )
        for job_id, keys in list(self.loaded.items()):
            if not ledger.not_taken(job_id):
                del self.loaded[job_id]
            elif not set(keys).isdisjoint(job.keys):
                return (
                    f"its blocks were just loaded for request {self.kv!r} by job {job_id}, "
                    f"whose result the engine has not taken yet"
                )
        return ""

    def open_round(self, job: Job) -> LoadRound:
        """A new round of this request for ``job`` (checked by :meth:`conflict`)."""
        self.open_keys.update(job.keys)
        rnd = LoadRound(self, self.next_round, job)
        self.next_round += 1
        self.rounds[rnd.no] = rnd
        return rnd


def _first_bad_position(pos: list[int], n: int, announced: set[int]) -> int:
    """The first of ``pos`` outside ``0..n-1`` or named before (earlier in ``pos`` too)."""
    seen = set(announced)
    for p in pos:
        if p >= n or p in seen:
            return p
        seen.add(p)
    raise AssertionError("no bad position")
