"""What sessions share with the tier that owns them: transports, ledger, timers, identity, the
cross-session records, and the small interfaces the roles see of their session.

A session never reaches into the tier: what spans sessions (producer ids and their bindings,
parked stores, failed consumer ids, deferred lookup-handle releases, data-peer owners) lives
in the records here, which the tier reads and changes through their methods too.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Sized
from dataclasses import dataclass, field
from typing import Protocol

from p2pkv.config import Flow, Limits, Timeouts
from p2pkv.contracts import DataTransport
from p2pkv.driver import FlushPoint
from p2pkv.observers import Observers
from p2pkv.protocol import Message
from p2pkv.ratelimit import LogLimiter
from p2pkv.session.deadlines import Deadlines
from p2pkv.session.ledger import JobLedger
from p2pkv.session.producers import ProducerDirectory
from p2pkv.session.reads import ReadGate
from p2pkv.session.records import DataPeerOwners, FailedLoads, LookupEnds


@dataclass(frozen=True)
class LocalIdentity:
    """What our hello says about us."""

    address: str
    epoch: int
    descriptor: bytes
    num_blocks: int
    block_len: int
    fingerprint: str
    hash_seed: str


class SessionLink(Protocol):
    """What a role uses of the session it belongs to."""

    @property
    def peer(self) -> str: ...

    @property
    def ready(self) -> bool:
        """The session carries messages now (READY, not doomed)."""
        ...

    @property
    def read_window(self) -> float:
        """How long after a fetch a read of ours is still within the producer's lease."""
        ...

    def send(self, msg: Message, *, cleanup: bool = False) -> bool:
        """Send ``msg`` (dropped when not ready). False only when the frame is over the size
        cap: it was not sent, the session goes on, the caller fails the request it served.
        ``cleanup``: no peer waits on it; it may leave with the next frame or tick."""
        ...


class ClosedLink:
    """What a role of a closed, wound-down session sees of it: never ready, sends nothing.
    It names the peer only, so the role holds no reference back to its session."""

    def __init__(self, peer: str) -> None:
        self.peer = peer

    ready = False
    read_window = 0.0

    def send(self, msg: Message, *, cleanup: bool = False) -> bool:
        """Dropped, as on any session that is not ready."""
        return True


def dropped(msg: Message) -> bool:
    """The ``send`` of a closed session's producer parts: the message is dropped."""
    return True


class ReadOwner(Protocol):
    """Who posted a read (the consumer role of the session with ``peer``): told once when
    it terminates."""

    @property
    def peer(self) -> str: ...

    def on_data(self, tid: int, ok: bool) -> None: ...


class PendingSession(Protocol):
    """A session on one of the tier's worklists: doomed (to close at the next safe point)
    or congested (frames held behind a full send queue). The tier finds the session itself
    by ``peer`` in its table; an entry whose session was replaced is stale."""

    @property
    def peer(self) -> str: ...

    @property
    def outbox(self) -> Sized:
        """The frames held behind a full send queue."""
        ...

    def flush(self) -> bool:
        """Send held frames; True once none is held (or the session cannot send any more)."""
        ...


def _no_flush() -> None:
    """The flush of a control transport that does not batch: its frames are on their way."""


_WARN_BURST = 20  # peer warnings logged at once, and per _WARN_WINDOW on average ...
_WARN_WINDOW = 10.0  # ... then one "suppressed K" line per this many seconds


@dataclass(eq=False)
class SessionEnv:
    """Everything a session and its roles share with the tier (see the module docstring).

    The tier builds one and owns it; sessions and roles read it and change it through the
    methods of its parts. Driver thread only."""

    data: DataTransport
    ledger: JobLedger
    deadlines: Deadlines
    clock: Callable[[], float]
    observers: Observers
    timeouts: Timeouts
    limits: Limits
    local: LocalIdentity
    producers: ProducerDirectory
    flow: Flow = field(default_factory=Flow)
    failed_loads: FailedLoads = field(default_factory=FailedLoads)
    lookup_ends: LookupEnds = field(default_factory=LookupEnds)
    data_peers: DataPeerOwners = field(default_factory=DataPeerOwners)
    owners: dict[int, ReadOwner] = field(default_factory=dict)
    """Read id -> who posted it (routes ``data.poll`` results)."""
    counters: Counter[str] = field(default_factory=Counter)
    doomed: list[PendingSession] = field(default_factory=list)
    """Sessions doomed since the tier's last pass over them (it closes them)."""
    congested: set[PendingSession] = field(default_factory=set)
    """Sessions holding frames behind a full send queue (the tier flushes them every tick)."""
    flush_control: FlushPoint = field(default_factory=lambda: FlushPoint(_no_flush))
    """Puts queued control frames on the wire (``ControlTransport.flush`` of a batching
    transport). Sessions set its ``pending`` as they send; the tier's guard flushes as its
    call returns. Called at once before a data-transport call that can take milliseconds
    (``add_peer``, ``remove_peer``), so a peer never waits for our frames meanwhile."""
    hello: bytes | None = field(default=None, init=False)
    """Our hello, encoded once (every session sends the same)."""
    reads: ReadGate = field(init=False)
    """Every read the consumer roles post goes through it (shared, bounded resources)."""
    warnings: LogLimiter = field(init=False)
    """Warnings about peers that requests name (dials refused or failed, sessions that never
    became ready): rate-limited, so requests naming thousands of bad peers log a bounded
    number of lines and one summary per window."""

    def __post_init__(self) -> None:
        self.reads = ReadGate(self)
        self.warnings = LogLimiter(
            logging.getLogger("p2pkv.tier"),
            _WARN_BURST,
            _WARN_WINDOW,
            self.clock(),
            "warnings about peers (requests naming peers that cannot or may not be dialed?)",
        )
