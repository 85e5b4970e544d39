"""Small records the tier shares with its sessions, one concept each.

* :class:`FailedLoads`: consumer ``kv_request_id``\\ s that cannot load any more (lookups
  answer MISS, later loads fail at once) until the consumer request finishes.
* :class:`LookupEnds`: whether the engine ever offered a ``LocalHitSource``, and the lookup
  handles whose ``LocalHitSource.end`` is owed at the next ``serve_lookups``.
* :class:`DataPeerOwners`: which session registered each data peer (only it may remove it).

Threading: driver thread only.
"""

from __future__ import annotations


class FailedLoads(dict[str, str]):
    """``kv_request_id`` -> why its loads fail (a dict: ``in`` is checked per looked-up
    block)."""

    def mark(self, kv_request_id: str, why: str) -> None:
        """A load of this (unfinished) request failed (``why``: outcome and detail); the
        first failure is kept and named by every later refusal."""
        self.setdefault(kv_request_id, why)

    def forget(self, kv_request_id: str) -> None:
        """The consumer request finished: the id may load again (a new request)."""
        self.pop(kv_request_id, None)


class LookupEnds:
    def __init__(self) -> None:
        self.source_seen = False
        """True once the engine has offered a ``LocalHitSource`` (``serve_lookups``)."""
        self._owed: list[object] = []

    def defer(self, handle: object) -> None:
        """Call ``LocalHitSource.end(handle)`` during the next ``serve_lookups``."""
        self._owed.append(handle)

    def take(self) -> list[object]:
        owed, self._owed = self._owed, []
        return owed

    def __len__(self) -> int:
        return len(self._owed)


class DataPeerOwners:
    def __init__(self) -> None:
        self._owner: dict[str, object] = {}

    def added(self, peer: str, owner: object) -> None:
        """``owner`` registered ``peer`` with the data transport (it now owns removal)."""
        self._owner[peer] = owner

    def release(self, peer: str, owner: object) -> bool:
        """Forget ``peer`` if ``owner`` registered it last; True if the caller must remove it."""
        if self._owner.get(peer) is not owner:
            return False
        del self._owner[peer]
        return True

    def __len__(self) -> int:
        return len(self._owner)
