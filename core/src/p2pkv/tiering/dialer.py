"""Finding or dialing the session for a peer, within ``peers.*``.

:meth:`Dialer.session_for` returns the live session to a peer, the held newcomer's if one
waits (:mod:`p2pkv.session.admission`), or dials a new one. What it may dial depends on why:

- a **request** (:attr:`DialKind.PD` or :attr:`DialKind.REQUEST`) goes through the negative
  cache (:mod:`.backoff`) and :class:`~p2pkv.dial_policy.DialPolicy` (allow-list, cap,
  eviction; a PD request is dialed beyond the cap rather than refused);
- a **warm** dial (:mod:`.warm`) and a **probe** (:mod:`.domains`) go through the cache and
  the allow-list only: warm sessions have their own bound, and a probe replaces a session
  just closed.

A dial to a suspect host gets the probe's short handshake deadline. As a watcher of the
table, the dialer backs off an address whose dialed session ended lost without hearing from
its peer, and forgets the backoff once any session with the address hears from it.

Threading: driver thread only.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Collection, Iterator

from p2pkv.contracts import ControlTransport
from p2pkv.dial_policy import DialPolicy
from p2pkv.session.admission import Admission
from p2pkv.session.env import SessionEnv
from p2pkv.session.session import Session
from p2pkv.tiering.backoff import DialBackoff
from p2pkv.tiering.table import SessionTable, SessionWatcher
from p2pkv.types import Outcome

__all__ = ["DialKind", "Dialer", "Refusal"]

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


_REQUESTS = frozenset({DialKind.PD, DialKind.REQUEST})


class Refusal(str):
    """Why a peer may not be dialed. ``passing``: only for now (its address is backed off,
    so a later request dials it again); else for as long as the tier's state stays."""

    passing = False


class Dialer(SessionWatcher):
    """See the module docstring. ``warm``: the warm set's peers (outside the cap);
    ``handshake_timeout(peer)``: the short deadline of a suspect host, or None."""

    def __init__(self, control: ControlTransport, table: SessionTable, admission: Admission,
                 env: SessionEnv, policy: DialPolicy, backoff: DialBackoff) -> None:
        self._control = control
        self._table = table
        self._admission = admission
        self._env = env
        self._policy = policy
        self._backoff = backoff
        self.warm: Collection[str] = frozenset()
        self.handshake_timeout: Callable[[str], float | None] = lambda peer: None

    def session_for(self, peer: str, kind: DialKind) -> Session | str:
        """The usable session to ``peer``, dialing if needed; why not, if it may not be."""
        table = self._table
        session = table.get(peer)
        if session is not None:
            if session.usable:
                if kind in _REQUESTS:
                    session.last_active = self._env.clock()
                    table.touch(session)
                return session
            table.close_unusable(session)
        if peer in self._admission:
            session = self._admission.promote(peer)
            table.touch(session)
            return session
        refusal = self._admission_refusal(peer, kind)
        if refusal is not None:
            return refusal
        try:
            conn = self._control.connect(peer)
        except Exception as exc:
            why = f"cannot connect to {peer}: {exc}"
            if kind in _REQUESTS:  # the warm set reports its own peers
                self._env.warnings.log(self._env.clock(), logging.WARNING, "%s", why)
            return why
        session = table.open(peer, conn, dialed=True,
                             handshake_timeout=self.handshake_timeout(peer))
        if kind in _REQUESTS:
            table.touch(session)
        else:
            session.pre_connect = True
        return session

    def _admission_refusal(self, peer: str, kind: DialKind) -> Refusal | None:
        """Why ``peer`` may not be dialed now (a closed tier, the backoff, the policy), or
        None; a session the policy evicts to make room is closed here."""
        env = self._env
        if self._table.stopping:
            return Refusal(f"not dialing {peer}: the tier is shutting down")
        why = self._backoff.refusal(peer, env.clock())
        if why is not None:
            refusal = Refusal(f"not dialing {peer}: {why}")
            refusal.passing = True
            return refusal
        if kind in _REQUESTS:
            verdict = self._policy.admit(peer, _Dialed(self._table, self.warm),
                                         pd=kind is DialKind.PD)
            victim = verdict.evict
            if victim is not None:  # a bye only to a peer that ever answered
                self._table.close(victim, Outcome.PEER_DEAD, verdict.reason,
                                  bye=verdict.reason if victim.heard else None)
            why = verdict.refused
            if why is not None:
                env.warnings.log(env.clock(), logging.WARNING, "not dialing %s: %s", peer, why)
        else:
            why = self._policy.refusal(peer)
        return None if why is None else Refusal(f"not dialing {peer}: {why}")

    # -- watching sessions ------------------------------------------------------------------

    def heard(self, session: Session) -> None:
        self._backoff.heard(session.peer)

    def closed(self, session: Session, lost: bool) -> None:
        if lost and session.dialed and not session.heard and not self._table.stopping:
            reason = session.conn.close_reason or "no answer within the handshake deadline"
            self._backoff.failed(session.peer, reason, self._env.clock())


class _Dialed:
    """The table's dialed sessions as the policy reads them: warm ones left out."""

    def __init__(self, table: SessionTable, warm: Collection[str]) -> None:
        self._table = table
        self._warm = warm

    def count(self) -> int:
        table = self._table
        warm = sum(1 for peer in self._warm
                   if (s := table.get(peer)) is not None and s.dialed) if self._warm else 0
        return len(table.dialed) - warm

    def unheard(self) -> Iterator[Session]:
        return (s for s in self._table.unheard if s.peer not in self._warm)

    def unheard_count(self) -> int:
        unheard = self._table.unheard
        if not self._warm:
            return len(unheard)
        return sum(1 for s in unheard if s.peer not in self._warm)

    def idle(self) -> Iterator[Session]:
        return (s for s in self._table.dialed
                if s.peer not in self._warm and s.ready and s.idle)
