"""Failure domains: a peer lost makes its host suspect, and its sibling ranks are probed.

With data parallelism one pod serves several ranks, each a tier of its own at ``base port +
rank`` on the pod's address; the pod dies, pauses or is cut off as a unit. Each session
notices that by itself (its connection dies, or its heartbeats stop, within the control
transport's timeout), but a consumer can act on the first one: when a session that had heard
from its peer is *lost* (its connection died; not a bye, an eviction or our own close), the
peer's host becomes suspect for ``timeouts.handshake`` seconds, and

- every other session to that host with nothing open (a quiet sibling rank) that only
  serves us is probed at once: closed with a bye and dialed again, with the short probe
  deadline (``timeouts.handshake / 5``). A live rank answers within milliseconds and is
  warm again; a dead or paused one fails the probe, and its address is backed off
  (:mod:`.backoff`), so requests naming it are refused at once until the backoff passes;
- every new dial to that host gets the same short deadline, and each one that fails keeps
  the host suspect for another ``timeouts.handshake``.

A probe is not a death: a paused pod that resumes is dialed again once the backoff passes
and served as before. Sessions with work open are not probed (their own heartbeats decide,
within the timeout), and neither are sessions whose peer has ever asked us for blocks (a
fetch or a lookup): nothing open here does not mean nothing is on its way from such a peer,
and the probe's bye would cross its next request, failing it. A producer therefore never
probes its consumers; a consumer probes the ranks it pulls from. Siblings are the sessions
to the same host, whatever their port: on Kubernetes each pod has its own address, so they
are the pod's ranks.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable

from p2pkv.addressing import parse_address
from p2pkv.errors import ConfigError
from p2pkv.session.session import Session
from p2pkv.tiering.table import SessionTable, SessionWatcher
from p2pkv.types import Outcome

__all__ = ["MEMORY", "PROBE_SHARE", "FailureDomains"]

log = logging.getLogger("p2pkv.tier")

PROBE_SHARE = 0.2
"""A probe's handshake deadline, as a share of ``timeouts.handshake``."""
MEMORY = 1024
"""Suspect hosts remembered at most (the oldest forgotten)."""


class FailureDomains(SessionWatcher):
    """Suspect hosts and their probes (see the module docstring). ``redial(peer)`` dials a
    probe (the dialer's ``own_dial`` with ``DialKind.PROBE``)."""

    def __init__(self, table: SessionTable, clock: Callable[[], float], handshake: float) -> None:
        self._table = table
        self._clock = clock
        self._window = handshake
        self.probe_timeout = handshake * PROBE_SHARE
        self.redial: Callable[[str], object] = lambda peer: None
        self._suspect: OrderedDict[str, float] = OrderedDict()
        """Host -> until when it is suspect."""
        self._by_host: dict[str, dict[Session, None]] = {}
        self.suspected = 0
        """Hosts found suspect."""
        self.probed = 0
        """Quiet sibling sessions probed."""

    def handshake_timeout(self, peer: str) -> float | None:
        """The probe deadline for a dial to a suspect host, else None (the default)."""
        host = _host(peer)
        if host is None:
            return None
        until = self._suspect.get(host)
        if until is None:
            return None
        if until <= self._clock():
            del self._suspect[host]
            return None
        return self.probe_timeout

    def suspect_hosts(self) -> int:
        """Hosts suspect now."""
        now = self._clock()
        return sum(1 for until in self._suspect.values() if until > now)

    # -- watching sessions ------------------------------------------------------------------

    def opened(self, session: Session) -> None:
        host = _host(session.peer)
        if host is not None:
            self._by_host.setdefault(host, {})[session] = None

    def closed(self, session: Session, lost: bool) -> None:
        host = _host(session.peer)
        if host is None:
            return
        siblings = self._by_host.get(host)
        if siblings is not None:
            siblings.pop(session, None)
            if not siblings:
                del self._by_host[host]
        if not lost or self._table.stopping:
            return
        if session.heard:
            self._lost(host, session.peer)
        elif self.handshake_timeout(session.peer) is not None:
            self._suspect[host] = self._clock() + self._window  # still failing: stays suspect

    def _lost(self, host: str, peer: str) -> None:
        now = self._clock()
        was = self._suspect.pop(host, None)
        self._suspect[host] = now + self._window
        while len(self._suspect) > MEMORY:
            self._suspect.popitem(last=False)
        if was is not None and was > now:
            return  # already suspect: its siblings were probed
        self.suspected += 1
        quiet = [
            s for s in self._by_host.get(host, ()) if s.ready and s.idle and not s.producer.asked
        ]
        if quiet:
            log.info(
                "peer %s lost: probing %d quiet session(s) to other ranks of %s",
                peer,
                len(quiet),
                host,
            )
        for sibling in quiet:
            if self._table.get(sibling.peer) is not sibling:
                continue
            self.probed += 1
            reason = f"probing: {peer}, a rank of the same host, was lost"
            self._table.close(sibling, Outcome.PEER_DEAD, reason, bye=reason)
            self.redial(sibling.peer)


def _host(peer: str) -> str | None:
    try:
        return parse_address(peer)[0]
    except ConfigError:
        return None  # not host:port (an in-process name): no host to share
