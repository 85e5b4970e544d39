"""Which peers a request may make the tier dial: ``peers`` in the tier config.

A consumer dials whoever its request's routing names, and routers copy that from the request
(vLLM: ``remote_host``/``remote_port`` of ``kv_transfer_params``, from the HTTP body). So a
client, or a misconfigured router, chooses whom the tier dials: thousands of distinct
addresses would make it dial each (vLLM's advisory GHSA-frvg-qw88-hww9 is that problem in
its built-in tier). :class:`DialPolicy` bounds it:

- ``peers.allow``: networks (``10.0.0.0/8``, ``fd00::/8``), addresses, or host names the tier
  may dial (:mod:`p2pkv.peer_allow`); any other peer is refused before any socket exists.
  Empty (the default): any peer.
- ``peers.max_dialed``: sessions this tier dialed that may be open at once. A request naming
  a new peer beyond it first evicts the oldest dialed session still in its handshake (a
  black-holed or refusing address holds one until ``timeouts.handshake``), so a flood of
  bogus peers cannot lock legitimate ones out; only when every dialed session is ready is
  the new peer refused. Sessions peers dialed to us do not count.

A refused request recomputes (its lookups MISS, its loads fail ``peer_dead`` naming the
limit). Threading: driver thread only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from p2pkv.addressing import parse_address
from p2pkv.errors import ConfigError
from p2pkv.peer_allow import parse_allow_list

__all__ = ["DialPolicy", "PeerLimits"]


class PeerLimits(Protocol):
    """What the policy reads of a tier's ``peers`` (``p2pkv.config.Peers``; a Protocol, so
    this module needs no config)."""

    @property
    def allow(self) -> tuple[str, ...]:
        """Networks, addresses or host names the tier may dial; empty: any peer."""
        ...

    @property
    def max_dialed(self) -> int:
        """Sessions this tier dialed that may be open at once."""
        ...


class DialPolicy:
    """``peers`` of one tier: the allow-list and the cap; the tier tells it which sessions
    it dialed (:meth:`admit`), it keeps no copy of them."""

    def __init__(self, peers: PeerLimits) -> None:
        self._allow = parse_allow_list(peers.allow)
        self.max_dialed = peers.max_dialed
        self.refused = 0
        """Dials refused: not on the allow-list, or every dialed session ready at the cap."""
        self.evicted = 0
        """Handshaking sessions closed to make room for a new peer."""

    def refusal(self, peer: str) -> str | None:
        """Why ``peer`` may not be dialed (outside ``peers.allow``), or None."""
        if self._allow.open:
            return None
        try:
            host, _ = parse_address(peer)
        except ConfigError:
            return "it is not host:port, so not on peers.allow"
        if self._allow.allows(host):
            return None
        return ("it is not on peers.allow (add its network to the tier's peers.allow to let "
                "requests name it)")

    def admit(self, peer: str, open_sessions: int,
              dialed: Callable[[], Sequence[tuple[str, bool]]],
              evict: Callable[[str, str], None]) -> str | None:
        """Whether the tier may dial a new session to ``peer``: None, or why not.
        ``open_sessions``: how many sessions the tier has (dialed or not); below the cap
        that settles it and ``dialed`` is not called. ``dialed()``: the open sessions this
        tier dialed, oldest first, as (peer, ready). At the cap, the oldest one not ready
        yet is evicted first (``evict(peer, reason)`` closes it)."""
        why = self.refusal(peer)
        if why is None and open_sessions >= self.max_dialed:
            sessions = dialed()
            if len(sessions) >= self.max_dialed:
                why = self._make_room(peer, sessions, evict)
        if why is not None:
            self.refused += 1
        return why

    def _make_room(self, peer: str, dialed: Sequence[tuple[str, bool]],
                   evict: Callable[[str, str], None]) -> str | None:
        """Evict the oldest dialed session not ready yet for ``peer``; why not, if none."""
        victim = next((other for other, ready in dialed if not ready), None)
        if victim is None:
            return (f"{self.max_dialed} sessions this tier dialed are open and ready "
                    f"(peers.max_dialed): raise it if this instance has more peers")
        self.evicted += 1
        evict(victim, f"evicted for a new peer, {peer}: {self.max_dialed} sessions this "
                      "tier dialed are open (peers.max_dialed)")
        return None
