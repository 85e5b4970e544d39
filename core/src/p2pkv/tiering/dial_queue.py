"""Requests waiting for a dial: their peers were named while no dial was free.

The dial policy puts a request's dial off when its budget of new dials is spent, or when
every place for dials without progress is taken (:mod:`p2pkv.dial_policy`). The request
does not fail then: its peer waits here with the request's ``kv_request_id``, and the loads
it submits wait as open jobs. The dialer dials waiting peers as dials come free
(:meth:`p2pkv.tiering.dialer.Dialer.drain`); each one's requests and loads then go to its
new session, in the order the engine made them. The order, best first:

1. peers that ``peers.connect`` lists (on Kubernetes, pods that exist);
2. peers named by more requests (a new healthy peer gets a stream; a flood names each once);
3. the most recently named (an older name is nearer its end).

Every wait is bounded, so a flood never holds a legitimate request past its deadline:

- a load keeps its own deadline (``timeouts.load`` from its submit), in the queue and in
  the session it is handed to; past it, it fails ``load_timeout``;
- a peer waits at most ``timeouts.handshake`` for its dial to start (as long as a dial may
  take to be answered); then its loads fail ``peer_dead``, and so do its requests' later
  loads, as after a refused dial;
- at most ``peers.max_dialed`` peers wait. Beyond that the worst one leaves at once (the
  oldest of those named once), its loads failing ``peer_dead``.

A flood of names thus costs a small record each here, and no socket. Threading: driver
thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.env import SessionEnv
from p2pkv.session.session import Session
from p2pkv.types import Job, Outcome

__all__ = ["DialQueue", "Waiting"]


class QueuedLoad:
    """A load waiting with its peer, and the deadline it keeps when handed over. It names
    its peer, not the peer's :class:`Waiting` record: no reference cycle, so a record that
    leaves is freed at once, without the garbage collector (a flood drops one a name)."""

    __slots__ = ("deadline", "job", "kv", "peer", "pull", "timer")

    def __init__(self, peer: str, kv: str, job: Job, pull: bool, deadline: float) -> None:
        self.peer = peer
        self.kv = kv
        self.job = job
        self.pull = pull
        self.deadline = deadline
        self.timer: Timer | None = None


class Waiting:
    """One peer waiting for a dial: its requests by ``kv_request_id``, each with its loads."""

    __slots__ = ("last", "listed", "pd", "peer", "requests", "since")

    def __init__(self, peer: str, now: float, listed: bool) -> None:
        self.peer = peer
        self.since = now
        self.last = now
        """When a request last named it."""
        self.listed = listed
        self.pd = False
        """A PD request waits for it (it may be dialed beyond ``peers.max_dialed``)."""
        self.requests: dict[str, list[QueuedLoad]] = {}

    def rank(self) -> tuple[bool, int, float]:
        return self.listed, len(self.requests), self.last


class DialQueue:
    """The waiting peers (see the module docstring), at most ``size``; the loads' deadlines
    ride ``timers``, the peers' waits end in :meth:`expire`. ``listed(peer)``:
    ``peers.connect`` lists it."""

    def __init__(
        self, env: SessionEnv, size: int, timers: Deadlines, listed: Callable[[str], bool]
    ) -> None:
        self._env = env
        self._size = size
        self._timers = timers
        self._listed = listed
        self._waiting: dict[str, Waiting] = {}
        """By peer, in the order they began to wait (so the first is the first to expire)."""
        self._once: OrderedDict[str, Waiting] = OrderedDict()
        """Peers named by one request at most and not listed, oldest first: a flood's bulk."""
        self._favoured: dict[str, Waiting] = {}
        """The others."""
        self.queued = 0
        """Peers that waited for a dial."""
        self.failed = 0
        """Peers that left the queue undialed (too many waiting, or waited too long)."""
        self._on_load_expired = self._load_expired
        self._full = (
            f"{size} peers wait for a dial (peers.max_dialed) and "
            "it was named least and longest ago (a flood of new names?)"
        )
        """Why the worst of a full queue leaves (built once: a flood drops one a name)."""

    def __contains__(self, peer: object) -> bool:
        return peer in self._waiting

    def __len__(self) -> int:
        return len(self._waiting)

    def loads(self) -> int:
        """Loads waiting (a debug view: walks every waiting peer)."""
        return sum(len(loads) for w in self._waiting.values() for loads in w.requests.values())

    # -- the engine's requests --------------------------------------------------------------

    def hold(self, peer: str, kv: str | None, *, pd: bool) -> str | None:
        """A request (``kv``; None: ``P2PTier.connect``) named ``peer``, which must wait.
        Returns why not when ``peer`` is the worst of a full queue (it does not wait)."""
        now = self._env.clock()
        waiting = self._waiting.get(peer)
        if waiting is None:  # a new name: a small record, the bulk of a flood
            waiting = self._waiting[peer] = Waiting(peer, now, self._listed(peer))
            (self._favoured if waiting.listed else self._once)[peer] = waiting
            self.queued += 1
            if kv is not None:
                waiting.requests[kv] = []
        elif kv is not None and kv not in waiting.requests:
            self._named(waiting, kv, now)
        waiting.pd = waiting.pd or pd
        if len(self._waiting) <= self._size:
            return None
        worst = self._worst()
        why = self._drop(worst, self._full, now)
        return why if worst is waiting else None

    def add_load(self, peer: str, kv: str, job: Job, pull: bool) -> bool:
        """A load of ``kv``'s request, whose peer waits: its deadline starts now. False
        (nothing done) when ``peer`` does not wait.

        The load's own timer is armed only if its deadline falls before the peer's wait
        ends (``timeouts.load`` below ``timeouts.handshake``): otherwise the peer leaves
        first, or is dialed and the load keeps its deadline in the session."""
        waiting = self._waiting.get(peer)
        if waiting is None:
            return False
        env = self._env
        now = env.clock()
        waiting.pd = waiting.pd or not pull
        loads = waiting.requests.get(kv)
        if loads is None:
            loads = self._named(waiting, kv, now)
        deadline = now + env.timeouts.load
        load = QueuedLoad(peer, kv, job, pull, deadline)
        if deadline <= waiting.since + env.timeouts.handshake:
            load.timer = self._timers.at(deadline, self._on_load_expired, load)
        loads.append(load)
        return True

    def _named(self, waiting: Waiting, kv: str, now: float) -> list[QueuedLoad]:
        """A new request ``kv`` waits for ``waiting``'s peer: its loads (none yet)."""
        loads: list[QueuedLoad] = []
        waiting.requests[kv] = loads
        waiting.last = now
        if len(waiting.requests) > 1 and waiting.peer in self._once:
            self._favoured[waiting.peer] = self._once.pop(waiting.peer)
        return loads

    def finish(self, peer: str, kv: str) -> None:
        """The engine finished ``kv``'s request: its waiting loads fail now, as in a session,
        and the peer leaves when no request waits for it any more."""
        waiting = self._waiting[peer]
        loads = waiting.requests.pop(kv, None)
        if loads:
            self._close_loads(
                loads,
                Outcome.REQUEST_FINISHED,
                f"request finished while waiting for a dial of {peer}",
            )
        if not waiting.requests:
            self._remove(waiting)

    # -- dialing ----------------------------------------------------------------------------

    def expire(self, now: float) -> None:
        """Those that waited ``timeouts.handshake`` leave, their loads failing."""
        oldest = now - self._env.timeouts.handshake
        waiting = self._waiting
        while waiting and (first := next(iter(waiting.values()))).since <= oldest:
            self._drop(
                first,
                f"waited {self._env.timeouts.handshake:g}s for a free dial "
                "(timeouts.handshake): new peers are named faster than they answer",
                now,
            )

    def best(self) -> Waiting | None:
        """The peer to dial next, if any waits."""
        if self._favoured:
            return max(self._favoured.values(), key=Waiting.rank)
        if self._once:
            return next(reversed(self._once.values()))
        return None

    def hand_over(self, waiting: Waiting, session: Session) -> None:
        """``waiting``'s peer has a session: its requests and loads go to it, each load with
        the deadline it had."""
        self._remove(waiting)
        consumer, timers = session.consumer, self._timers
        for kv, loads in waiting.requests.items():
            consumer.open_request(kv)
            for load in loads:
                timers.cancel(load.timer)
                consumer.submit(load.job, kv, pull=load.pull, deadline=load.deadline)

    def fail(self, waiting: Waiting, why: str, outcome: Outcome = Outcome.PEER_DEAD) -> None:
        """``waiting``'s peer will not be dialed (``why``): its loads fail, and its requests'
        later loads too."""
        self._remove(waiting)
        failed = self._env.failed_loads
        marked = f"{outcome._value_}: {why}"  # ``_value_``: no descriptor call, once a drop
        for kv, loads in waiting.requests.items():
            failed.mark(kv, marked)
            if loads:
                self._close_loads(loads, outcome, why)

    def fail_all(self, outcome: Outcome, why: str) -> None:
        """Every waiting peer's loads fail (the tier shuts down)."""
        for waiting in list(self._waiting.values()):
            self.fail(waiting, why, outcome)

    # -- leaving ----------------------------------------------------------------------------

    def _worst(self) -> Waiting:
        if self._once:
            return next(iter(self._once.values()))
        return min(self._favoured.values(), key=Waiting.rank)

    def _load_expired(self, load: QueuedLoad) -> None:
        load.timer = None
        waiting, env = self._waiting.get(load.peer), self._env
        loads = None if waiting is None else waiting.requests.get(load.kv)
        if loads is not None and load in loads:
            loads.remove(load)
            detail = (
                f"waited {env.timeouts.load:g}s for a dial of {load.peer} (its "
                "budget of new dials was spent on other new peers)"
            )
            env.failed_loads.mark(load.kv, f"{Outcome.LOAD_TIMEOUT.value}: {detail}")
            env.ledger.close(load.job.job_id, Outcome.LOAD_TIMEOUT, detail)

    def _drop(self, waiting: Waiting, reason: str, now: float) -> str:
        """``waiting`` leaves undialed for ``reason`` at ``now``: logged, its loads failed;
        why."""
        self.failed += 1
        why = f"not dialing {waiting.peer}: {reason}"
        self._env.warnings.log(now, logging.WARNING, "%s", why)
        self.fail(waiting, why)
        return why

    def _close_loads(self, loads: list[QueuedLoad], outcome: Outcome, why: str) -> None:
        ledger, timers = self._env.ledger, self._timers
        for load in loads:
            if load.timer is not None:
                timers.cancel(load.timer)
            ledger.close(load.job.job_id, outcome, why)

    def _remove(self, waiting: Waiting) -> None:
        peer = waiting.peer
        del self._waiting[peer]
        if self._once.pop(peer, None) is None:
            del self._favoured[peer]
