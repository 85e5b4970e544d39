"""Which peers a request may make the tier dial: ``peers`` in the tier config.

A consumer dials whoever its request's routing names, and routers copy that from the request
(vLLM: ``remote_host``/``remote_port`` of ``kv_transfer_params``, from the HTTP body). So a
client, or a misconfigured router, chooses whom the tier dials: thousands of distinct
addresses would make it dial each (vLLM's advisory GHSA-frvg-qw88-hww9 is that problem in
its built-in tier). :class:`DialPolicy` bounds it:

- ``peers.allow``: networks (``10.0.0.0/8``, ``fd00::/8``), addresses, or host names the tier
  may dial (:mod:`p2pkv.peer_allow`); any other peer is refused before any socket exists.
  Empty (the default): any peer.
- **A budget of new dials**: a request's dial of a new peer spends a token of a bucket that
  refills at a quarter of ``peers.max_dialed`` per second (64/s by default, as many saved
  up); a dial whose peer answers gives its token back. Healthy peers are dialed as fast as
  they answer; names that never answer cost at most 64 dials a second, each a few hundred
  microseconds of the engine thread (its sockets opened and closed).
- **Dials that heard nothing from their peer yet** (a flood of refusing or black-holed names
  holds one each until it fails or its handshake deadline): at most that same quarter are
  open at once. A new one beyond that takes the place of the oldest that made no progress
  for :data:`GRACE` seconds (libzmq has not even connected it). A dial that is making
  progress (connected, or heard its peer) is never evicted for one that has not, nor is a
  dial younger than :data:`GRACE`.
- A request that finds no token or no place **waits** (:mod:`p2pkv.tiering.dial_queue`),
  its loads within their own deadlines, rather than fail.
- ``peers.max_dialed``: sessions this tier dialed for requests that may be open at once
  (warm sessions, :mod:`p2pkv.tiering.warm`, have their own bound; sessions peers dialed to
  us do not count). At the cap, a request naming a new peer takes the place of, in order:
  the oldest dial that made no progress (as above), else the least recently active idle
  session (it gives way with a bye). When every dialed session is working or hearing its
  peer, a PD request (``remote_prefiller``) is still dialed, beyond the cap: its producer
  holds blocks for it, which refusing would leave parked until ``timeouts.unbound_store``.
  Any other request waits while a dial in progress may still free a place, else is refused.

A refused request recomputes (its lookups MISS, its loads fail ``peer_dead`` naming the
limit). Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from p2pkv.addressing import parse_address
from p2pkv.errors import ConfigError
from p2pkv.peer_allow import parse_allow_list
from p2pkv.ratelimit import TokenBucket

S = TypeVar("S")
UNHEARD_SHARE = 4
"""At most ``max_dialed // UNHEARD_SHARE`` dials that heard nothing yet are open at once, and
as many new dials a second spend the budget."""
GRACE = 1.0
"""Seconds a dial may go without progress before a new one may take its place: a healthy
peer connects within a round trip, even on a loaded host."""
S_co = TypeVar("S_co", covariant=True)


class PeerLimits(Protocol):
    """What the policy reads of a tier's ``peers`` (``p2pkv.config.Peers``; a Protocol, so
    this module needs no config)."""

    @property
    def allow(self) -> tuple[str, ...]:
        """Networks, addresses or host names the tier may dial; empty: any peer."""
        ...

    @property
    def max_dialed(self) -> int:
        """Sessions this tier dialed for requests that may be open at once."""
        ...


class DialedSessions(Protocol[S_co]):
    """What the policy reads of the sessions the tier dialed for requests (warm ones left
    out): how many are open, and the candidates to make room, in the order they are taken."""

    def count(self) -> int:
        """Dialed sessions open, warm ones left out."""
        ...

    def unheard_count(self) -> int:
        """Those that heard nothing from their peer yet."""
        ...

    def stalled(self, dialed_before: float) -> Iterator[S_co]:
        """Those that heard nothing and made no progress, dialed before ``dialed_before`` (a
        clock reading), oldest dial first."""
        ...

    def idle(self) -> Iterator[S_co]:
        """Those ready with nothing open, least recently active first."""
        ...


@dataclass(frozen=True)
class Verdict(Generic[S]):
    """What :meth:`DialPolicy.admit` decided: dial (nothing set), dial once ``evict`` is
    closed with ``reason``, wait for a free dial (``wait``), or not at all (``refused``:
    why). A dial spent a token of the budget: :meth:`DialPolicy.answered` gives it back."""

    evict: S | None = None
    reason: str = ""
    refused: str | None = None
    wait: bool = False


class DialPolicy:
    """``peers`` of one tier: the allow-list, the cap and the budget of new dials; the tier
    shows it the sessions it dialed (:meth:`admit`), it keeps no copy of them. ``now`` is
    the tier's clock at construction (the budget starts full)."""

    def __init__(self, peers: PeerLimits, now: float) -> None:
        self._allow = parse_allow_list(peers.allow)
        self._open = self._allow.open
        self.max_dialed = peers.max_dialed
        self.max_unheard = max(1, peers.max_dialed // UNHEARD_SHARE)
        """Dials that heard nothing yet open at once (a flood's footprint), and new dials a
        second that the budget allows."""
        self._budget = TokenBucket(self.max_unheard, self.max_unheard, now)
        self.refused = 0
        """Dials refused: not on the allow-list, or every dialed session ready at the cap."""
        self.evicted = 0
        """Dials that made no progress, closed to make room for a new peer."""
        self.gave_way = 0
        """Idle sessions closed to make room for a new peer with a request."""
        self.over_cap = 0
        """PD requests dialed beyond the cap (every dialed session was working)."""

    def refusal(self, peer: str) -> str | None:
        """Why ``peer`` may not be dialed (outside ``peers.allow``), or None."""
        if self._open:
            return None
        try:
            host, _ = parse_address(peer)
        except ConfigError:
            return "it is not host:port, so not on peers.allow"
        if self._allow.allows(host):
            return None
        return (
            "it is not on peers.allow (add its network to the tier's peers.allow to let "
            "requests name it)"
        )

    def screen(self, peer: str) -> str | None:
        """:meth:`refusal`, counted in ``refused``: a request named ``peer``."""
        if self._open:  # no allow-list: asked once per request, so kept cheap
            return None
        why = self.refusal(peer)
        if why is not None:
            self.refused += 1
        return why

    def admit(self, peer: str, dialed: DialedSessions[S], now: float, *, pd: bool) -> Verdict[S]:
        """Whether a request may dial a new session to ``peer`` at ``now`` (the module
        docstring has the rules): dial as is, dial once ``Verdict.evict`` is closed, wait, or
        refused (why). A dial spends a token of the budget."""
        why = self.screen(peer)
        if why is not None:
            return Verdict(refused=why)
        budget = self._budget
        if not budget.take(now):
            return Verdict(wait=True)
        if dialed.unheard_count() >= self.max_unheard:
            verdict = self._evict_stalled(
                peer,
                dialed,
                now,
                f"{self.max_unheard} dials of "
                "this tier heard nothing yet (a quarter of "
                "peers.max_dialed)",
            )
        elif dialed.count() >= self.max_dialed:
            verdict = self._at_cap(peer, dialed, now, pd=pd)
        else:
            return Verdict()
        if verdict.wait or verdict.refused is not None:
            budget.put_back()
        return verdict

    def answered(self) -> None:
        """A dial that spent a token heard its peer: the token returns to the budget."""
        self._budget.put_back()

    def next_dial(self, now: float) -> float:
        """Seconds from ``now`` until the budget allows a new dial (0.0: at once)."""
        return self._budget.wait(now)

    def _evict_stalled(
        self, peer: str, dialed: DialedSessions[S], now: float, why: str
    ) -> Verdict[S]:
        """Evict the oldest dial without progress for :data:`GRACE` seconds, else wait."""
        victim = next(dialed.stalled(now - GRACE), None)
        if victim is None:
            return Verdict(wait=True)
        self.evicted += 1
        return Verdict(
            evict=victim,
            reason=f"evicted for a new peer, {peer}: {why} and this "
            f"one made no progress in {GRACE:g}s (not connected, nothing heard)",
        )

    def _at_cap(self, peer: str, dialed: DialedSessions[S], now: float, *, pd: bool) -> Verdict[S]:
        cap = self.max_dialed
        verdict = self._evict_stalled(
            peer, dialed, now, f"{cap} sessions this tier dialed are open (peers.max_dialed)"
        )
        if verdict.evict is not None:
            return verdict
        victim = next(dialed.idle(), None)
        if victim is not None:
            self.gave_way += 1
            return Verdict(
                evict=victim,
                reason=(
                    f"gave way to a new peer with a request, {peer}: {cap} sessions this tier "
                    f"dialed are open (peers.max_dialed)"
                ),
            )
        if pd:
            self.over_cap += 1
            return Verdict()
        if dialed.unheard_count():  # a dial still making progress may free a place
            return Verdict(wait=True)
        self.refused += 1
        return Verdict(
            refused=(
                f"{cap} sessions this tier dialed are open and working or hearing their peers "
                f"(peers.max_dialed): raise it if this instance has more peers"
            )
        )
