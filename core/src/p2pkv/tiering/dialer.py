"""Finding or dialing the session for a peer, within ``peers.*``.

:meth:`Dialer.session_for` (a request's dial) and :meth:`Dialer.own_dial` (the tier's own)
return the live session to a peer, the held newcomer's if one waits
(:mod:`p2pkv.session.admission`), or dial a new one. What may be dialed depends on why:

- a **request** (:attr:`DialKind.PD` or :attr:`DialKind.REQUEST`) goes through the negative
  cache (:mod:`.backoff`), the allow-list, and :class:`~p2pkv.dial_policy.DialPolicy`'s cap,
  eviction and budget of new dials (a PD request is dialed beyond the cap rather than
  refused). A dial the policy puts off waits in the queue (:mod:`.dial_queue`) with its
  request, and so does every new peer while the queue is not empty, so that it keeps its
  order; :meth:`Dialer.drain` (every tick) dials the waiting peers, best first, as dials
  come free;
- a **warm** dial (:mod:`.warm`) and a **probe** (:mod:`.domains`) go through the cache and
  the allow-list only: warm sessions have their own bound, and a probe replaces a session
  just closed. They never wait.

A dial to a suspect host gets the probe's short handshake deadline. As a watcher of the
table, the dialer backs off an address whose dialed session ended lost without hearing from
its peer (a warm dial's failure paces pre-connect only, see :mod:`.backoff`; the control
transport is told to forget it too, ``forget_dial_failure``), forgets the
backoff once any session with the address hears from it, and gives a request dial's token
back to the budget when its peer answers.

Threading: driver thread only.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterator

from p2pkv.contracts import ControlTransport
from p2pkv.dial_policy import DialPolicy
from p2pkv.session.admission import Admission
from p2pkv.session.deadlines import Deadlines, Timer
from p2pkv.session.env import SessionEnv
from p2pkv.session.session import Session
from p2pkv.tiering.backoff import DialBackoff
from p2pkv.tiering.dial_queue import DialQueue
from p2pkv.tiering.table import SessionTable, SessionWatcher
from p2pkv.types import Outcome

__all__ = ["DialKind", "Dialer", "Queued", "Refusal"]

log = logging.getLogger("p2pkv.tier")


class DialKind(enum.Enum):
    """Why a session is wanted."""

    PD = "pd"
    """A PD request (``remote_prefiller``): its producer holds blocks for it."""
    REQUEST = "request"
    """Any other request (a prefix pull, a symmetric lookup)."""
    WARM = "warm"
    """Pre-connect (``peers.connect``)."""
    PROBE = "probe"
    """A probe of a suspect host's rank."""


class Queued(enum.Enum):
    """The peer waits for a dial (:mod:`.dial_queue`): the request waits with it."""

    QUEUED = "queued"


_REQUESTS = frozenset({DialKind.PD, DialKind.REQUEST})


class Refusal(str):
    """Why a peer may not be dialed. ``passing``: only for now (its address is backed off,
    so a later request dials it again); else for as long as the tier's state stays.
    ``listed``: by the allow-list (a request's refusal is then logged)."""

    passing = False
    listed = False


class Dialer(SessionWatcher):
    """See the module docstring. ``warm``: the warm set's peers (outside the cap);
    ``handshake_timeout(peer)``: the short deadline of a suspect host, or None; ``queue``:
    the peers waiting for a dial; ``timers``: where the wake-up for the next free dial is
    set. The views read ``policy``, ``backoff`` and ``queue``."""

    def __init__(
        self,
        control: ControlTransport,
        table: SessionTable,
        admission: Admission,
        env: SessionEnv,
        policy: DialPolicy,
        backoff: DialBackoff,
        queue: DialQueue,
        timers: Deadlines,
    ) -> None:
        self._control = control
        self._table = table
        self._admission = admission
        self._env = env
        self.policy = policy
        self.backoff = backoff
        self.queue = queue
        self._timers = timers
        self._wake: Timer | None = None
        self._retry_at = 0.0
        """No waiting peer is dialed before this (the policy said wait)."""
        self._charged: dict[Session, None] = {}
        """Request dials that spent a token of the budget and heard nothing yet."""
        self._pre_connecting: dict[Session, None] = {}
        """Warm dials that heard nothing yet (their failure only paces pre-connect)."""
        self.warm: Collection[str] = frozenset()
        self.handshake_timeout: Callable[[str], float | None] = lambda peer: None

    def session_for(
        self, peer: str, kind: DialKind, kv: str | None = None
    ) -> Session | Refusal | Queued:
        """A request's session to ``peer`` (``kind`` PD or REQUEST), dialing if needed; why
        not, if it may not be; or ``QUEUED``: the dial waits, and the request ``kv`` (None:
        ``P2PTier.connect``) with it."""
        session = self._existing(peer, touch=True)
        if session is not None:
            return session
        why = self._refusal(peer, self.policy.screen)
        if why is not None:
            if why.listed:
                self._env.warnings.log(self._env.clock(), logging.WARNING, "%s", why)
            return why
        queue = self.queue
        got = Queued.QUEUED if len(queue) else self._request_dial(peer, kind)
        if got is Queued.QUEUED:  # behind the queue: a new name never jumps it
            dropped = queue.hold(peer, kv, pd=kind is DialKind.PD)
            if dropped is not None:
                return Refusal(dropped)
        return got

    def own_dial(self, peer: str, kind: DialKind) -> Session | Refusal:
        """The session of a dial of the tier's own (``kind`` WARM or PROBE), dialing if
        needed: no budget, no cap, never waiting; why not, if it may not be."""
        session = self._existing(peer, touch=False)
        if session is not None:
            return session
        why = self._refusal(peer, self.policy.refusal)
        return why if why is not None else self._open(peer, kind)

    def drain(self, now: float) -> None:
        """Dial the waiting peers, best first, while dials are free (every tick; at once when
        nothing waits or the policy said wait a moment ago)."""
        queue = self.queue
        if not len(queue):
            return
        queue.expire(now)
        if now < self._retry_at:
            return
        while (waiting := queue.best()) is not None:
            peer = waiting.peer
            kind = DialKind.PD if waiting.pd else DialKind.REQUEST
            got: Session | Refusal | Queued | None = self._existing(peer, touch=True)
            if got is None:
                got = self._refusal(peer, _screened) or self._request_dial(peer, kind)
            if got is Queued.QUEUED:
                self._wait(now)
                return
            if isinstance(got, Session):
                queue.hand_over(waiting, got)
            else:
                queue.fail(waiting, got)

    def _wait(self, now: float) -> None:
        """Try the queue again once a token is due, or a dial may have made way."""
        policy = self.policy
        self._retry_at = now + max(policy.next_dial(now), 1.0 / policy.max_unheard)
        if self._wake is None:  # a tick comes by then, however long it would wait
            self._wake = self._timers.at(self._retry_at, self._woken)

    def _woken(self, _: object) -> None:
        self._wake = None
        self.drain(self._env.clock())

    def _existing(self, peer: str, *, touch: bool) -> Session | None:
        """The usable session to ``peer``, or the held newcomer's (promoted), or None;
        ``touch``: a request names it (it may be working from now on)."""
        table = self._table
        session = table.get(peer)
        if session is not None:
            if session.usable:
                if touch:
                    session.last_active = self._env.clock()
                    table.touch(session)
                return session
            table.close_unusable(session)
        if peer in self._admission:
            session = self._admission.promote(peer)
            table.touch(session)
            return session
        return None

    def _refusal(self, peer: str, allowed: Callable[[str], str | None]) -> Refusal | None:
        """Why ``peer`` may not be dialed now: the tier stops, its address is backed off
        (``passing``), or ``allowed(peer)`` says why not (the allow-list)."""
        if self._table.stopping:
            return Refusal(f"not dialing {peer}: the tier is shutting down")
        why = self.backoff.refusal(peer, self._env.clock())
        if why is not None:
            refusal = Refusal(f"not dialing {peer}: {why}")
            refusal.passing = True
            return refusal
        why = allowed(peer)
        if why is None:
            return None
        refusal = Refusal(f"not dialing {peer}: {why}")
        refusal.listed = True
        return refusal

    def _request_dial(self, peer: str, kind: DialKind) -> Session | Refusal | Queued:
        """A new session to ``peer`` for a request if the policy lets it dial now (a session
        the policy evicts to make room is closed here), why not, or ``QUEUED``: wait."""
        env = self._env
        now = env.clock()
        verdict = self.policy.admit(
            peer, _Dialed(self._table, self.warm), now, pd=kind is DialKind.PD
        )
        if verdict.wait:
            return Queued.QUEUED
        victim = verdict.evict
        if victim is not None:  # a bye only to a peer that ever answered
            self._table.close(
                victim,
                Outcome.PEER_DEAD,
                verdict.reason,
                bye=verdict.reason if victim.heard else None,
            )
        if verdict.refused is not None:
            env.warnings.log(now, logging.WARNING, "not dialing %s: %s", peer, verdict.refused)
            return Refusal(f"not dialing {peer}: {verdict.refused}")
        session = self._open(peer, kind)
        if isinstance(session, Session):
            self._charged[session] = None
        return session

    def _open(self, peer: str, kind: DialKind) -> Session | Refusal:
        """Dial ``peer`` and open its session (whatever decides agreed)."""
        try:
            conn = self._control.connect(peer)
        except Exception as exc:
            why = Refusal(f"cannot connect to {peer}: {exc}")
            if kind in _REQUESTS:  # the warm set reports its own peers
                self._env.warnings.log(self._env.clock(), logging.WARNING, "%s", why)
            return why
        table = self._table
        session = table.open(
            peer, conn, dialed=True, handshake_timeout=self.handshake_timeout(peer)
        )
        if kind in _REQUESTS:
            table.touch(session)
        else:
            session.pre_connect = True
            if kind is DialKind.WARM:
                self._pre_connecting[session] = None
        return session

    # -- watching sessions ------------------------------------------------------------------

    def heard(self, session: Session) -> None:
        self.backoff.heard(session.peer)
        self._pre_connecting.pop(session, None)
        if session in self._charged:
            del self._charged[session]
            self.policy.answered()
            self._retry_at = 0.0

    def closed(self, session: Session, lost: bool) -> None:
        if session in self._charged:
            del self._charged[session]
            self._retry_at = 0.0  # a place for dials without progress came free
        warm = session in self._pre_connecting
        if warm:
            del self._pre_connecting[session]
        if lost and session.dialed and not session.heard and not self._table.stopping:
            reason = session.conn.close_reason or "no answer within the handshake deadline"
            self.backoff.failed(session.peer, reason, self._env.clock(), pre_connect=warm)
            if warm:  # it paces pre-connect only: the transport's own memory too
                self._control.forget_dial_failure(session.peer)


class _Dialed:
    """The table's dialed sessions as the policy reads them: warm ones left out."""

    def __init__(self, table: SessionTable, warm: Collection[str]) -> None:
        self._table = table
        self._warm = warm

    def count(self) -> int:
        table = self._table
        warm = (
            sum(1 for peer in self._warm if (s := table.get(peer)) is not None and s.dialed)
            if self._warm
            else 0
        )
        return len(table.dialed) - warm

    def unheard_count(self) -> int:
        unheard = self._table.unheard
        if not self._warm:
            return len(unheard)
        return sum(1 for s in unheard if s.peer not in self._warm)

    def stalled(self, dialed_before: float) -> Iterator[Session]:
        warm = self._warm
        for session, dialed in self._table.unheard.items():
            if dialed > dialed_before:
                return
            if (
                session.peer not in warm
                and getattr(session.conn, "progress", "dialing") == "dialing"
            ):
                yield session

    def idle(self) -> Iterator[Session]:
        return (s for s in self._table.dialed if s.peer not in self._warm and s.ready and s.idle)


def _screened(peer: str) -> None:
    """The allow-list's verdict on a waiting peer: it was screened when it was named."""
