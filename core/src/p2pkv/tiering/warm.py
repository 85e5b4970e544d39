"""The warm set: the peers of ``peers.connect`` this tier keeps sessions to before any request.

``peers.connect`` may resolve to the whole fleet (a headless Service over every rank). A full
mesh costs every tier sockets, memory and heartbeats per peer, N squared across the fleet, so
the tier keeps sessions to a bounded set only, at most ``peers.warm`` members:

- a peer of ``peers.connect`` that a request names joins the set (the most recently named
  stay; the least recently named member leaves when the set is full);
- free places are filled with a random sample of ``peers.connect``'s peers, so a fleet of
  tiers covers it evenly, and each new resolution keeps the members it still lists.

A member leaving the set keeps its session; it becomes an ordinary dialed session (counted
in ``peers.max_dialed``, closed when idle). Members never count in ``peers.max_dialed``; a
peer no request names and ``peers.connect`` does not list never joins, so client-named
peers cannot take warm places.

Dialing is paced, so many tiers starting at once do not storm each other: a member's first
dial waits a random part of :data:`FIRST_JITTER`, at most ``peers.max_handshakes`` dials of
the set are in their handshake at once (the rest queue), and a member whose session ended is
dialed again after its backoff (:mod:`.backoff`) plus up to :data:`REDIAL_JITTER`. A dial that
fails is never logged per attempt: the backoff counts it, and a refusal by the allow-list
is logged once per peer.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
import random
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence

from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.session import Session
from p2pkv.tiering.backoff import DialBackoff
from p2pkv.tiering.table import SessionTable, SessionWatcher

__all__ = ["FIRST_JITTER", "REDIAL_JITTER", "WarmSet"]

log = logging.getLogger("p2pkv.tier")

FIRST_JITTER = 1.0
"""Seconds over which the first dials of new members spread."""
REDIAL_JITTER = 1.0
"""Seconds at most added to a member's backoff before it is dialed again."""


class WarmSet(SessionWatcher):
    """The members (a collection of peer addresses) and their dialing; ``dial(peer)`` opens
    a warm session (the dialer's ``own_dial`` with ``DialKind.WARM``)."""

    def __init__(
        self,
        size: int,
        max_handshakes: int,
        table: SessionTable,
        deadlines: Deadlines,
        clock: Callable[[], float],
        backoff: DialBackoff,
        rng: random.Random | None = None,
    ) -> None:
        self.size = size
        self._max_handshakes = max_handshakes
        self._table = table
        self._deadlines = deadlines
        self._clock = clock
        self._backoff = backoff
        self._rng = rng if rng is not None else random.Random()
        self.dial: Callable[[str], Session | str] = lambda peer: "no dialer"
        self._members: OrderedDict[str, None] = OrderedDict()
        """Least recently named first."""
        self._candidates: frozenset[str] = frozenset()
        self._timers: dict[str, Timer] = {}
        self._queue: deque[str] = deque()
        self._dialing: dict[Session, None] = {}
        self._told: set[str] = set()
        """Members whose refusal by the allow-list was logged."""
        self._failing: set[str] = set()
        """Members whose last dial failed (logged once, until they answer again)."""

    def __contains__(self, peer: object) -> bool:
        return peer in self._members

    def __iter__(self) -> Iterator[str]:
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def listed(self, peer: str) -> bool:
        """``peers.connect``'s latest answer lists ``peer``."""
        return peer in self._candidates

    def ready(self) -> int:
        """Members with a ready session."""
        table = self._table
        return sum(1 for peer in self._members if (s := table.get(peer)) is not None and s.ready)

    def discovered(self, addresses: Sequence[str]) -> None:
        """``peers.connect`` resolved to ``addresses``: drop members it no longer lists,
        fill free places with a random sample, dial members without a session."""
        candidates = frozenset(addresses)
        for peer in candidates - self._candidates:
            self._backoff.heard(peer)  # listed (again): on Kubernetes, a ready pod
        self._candidates = candidates
        for peer in [p for p in self._members if p not in candidates]:
            self._leave(peer)
        free = self.size - len(self._members)
        if free > 0:
            pool = sorted(candidates.difference(self._members))
            for peer in self._rng.sample(pool, min(free, len(pool))):
                self._members[peer] = None
                self._members.move_to_end(peer, last=False)  # not named: leaves first
        for peer in self._members:
            if self._table.get(peer) is None:
                self._schedule(peer, self._rng.uniform(0.0, FIRST_JITTER))

    def named(self, peer: str) -> None:
        """A request named ``peer``: a listed peer joins (or stays in) the set."""
        members = self._members
        if peer in members:
            members.move_to_end(peer)
        elif peer in self._candidates and self.size:
            if len(members) >= self.size:
                self._leave(next(iter(members)))
            members[peer] = None

    def _leave(self, peer: str) -> None:
        del self._members[peer]
        self._failing.discard(peer)
        self._deadlines.cancel(self._timers.pop(peer, None))

    # -- dialing ----------------------------------------------------------------------------

    def _schedule(self, peer: str, delay: float) -> None:
        if peer not in self._timers and not self._table.stopping:
            self._timers[peer] = self._deadlines.at(self._clock() + delay, self._due, peer)

    def _due(self, peer: str) -> None:
        del self._timers[peer]
        self._queue.append(peer)
        self._pump()

    def _pump(self) -> None:
        """Dial queued members while fewer than ``max_handshakes`` dials of the set are in
        their handshake."""
        queue, table = self._queue, self._table
        while queue and len(self._dialing) < self._max_handshakes and not table.stopping:
            peer = queue.popleft()
            if peer not in self._members or table.get(peer) is not None:
                continue
            until = self._backoff.ready_at(peer)
            now = self._clock()
            if until is not None and until > now:
                self._schedule(peer, until - now + self._rng.uniform(0.0, REDIAL_JITTER))
                continue
            got = self.dial(peer)
            if isinstance(got, Session):
                if not got.heard:
                    self._dialing[got] = None
            elif peer not in self._told:  # refused by the allow-list or the transport
                self._told.add(peer)
                log.info("peers.connect: %s", got)

    # -- watching sessions ------------------------------------------------------------------

    def heard(self, session: Session) -> None:
        if session.peer in self._failing:
            self._failing.discard(session.peer)
            log.info("peers.connect: %s answers again", session.peer)
        if session in self._dialing:
            del self._dialing[session]
            self._pump()

    def closed(self, session: Session, lost: bool) -> None:
        self._dialing.pop(session, None)
        peer = session.peer
        if lost and not session.heard and peer in self._members and peer not in self._failing:
            self._failing.add(peer)
            log.info(
                "peers.connect: %s does not answer (%s); dialed again with a backoff "
                "of up to peers.dial_backoff",
                peer,
                session.conn.close_reason or "no answer within the handshake deadline",
            )
        if peer in self._members:
            until = self._backoff.ready_at(peer)
            wait = 0.0 if until is None else max(0.0, until - self._clock())
            self._schedule(peer, wait + self._rng.uniform(0.0, REDIAL_JITTER))
        self._pump()
