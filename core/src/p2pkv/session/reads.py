"""The read gate: every read a consumer posts goes through here, so that a data transport's
shared, bounded resources (a staging pool every staged peer's reads land in) are shared
fairly, and a read that does not fit *now* waits instead of failing.

A data transport says how large such a resource is (``DataTransport.read_capacity(peer)``,
one shared resource per transport) and refuses a read that does not fit at the moment with
``TransferBusy`` (nothing posted). The gate then:

- **holds** the read (its round waits, within its own load deadline; the producer keeps its
  blocks pinned under the lease meanwhile) and posts it once room is free, retried every
  tick (:meth:`ReadGate.pump`);
- **shares** the resource among the peers using it: with ``k`` peers that have reads in it
  or waiting for it, a peer may have ``capacity // max(2, k)`` blocks in flight (a read of a
  peer with nothing in flight always fits its share, however large), so a burst from one peer
  leaves room for the others, and one peer stuck with reads in flight (paused, cut off) can
  hold at most half of it;
- **takes turns**: held reads go out one per peer per turn, each peer's in order; a read
  that still does not fit keeps the turn (later, smaller reads of other peers do not overtake
  it, so a large read is never starved by a stream of small ones).

A read the transport refuses finally (any other ``TransferSubmitError``) is handed back to its
owner, which fails its round. Reads of peers that need no shared resource go straight
through unless the transport said busy for them too.

Threading: driver thread only.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Sequence
from typing import Protocol

from p2pkv.contracts import DataTransport
from p2pkv.errors import TransferBusy


class DataHolder(Protocol):
    """Where the gate finds the data transport (the session env: tests may swap it)."""

    data: DataTransport


class ReadPoster(Protocol):
    """Who asked for a read: told once whether it was posted or refused."""

    def read_posted(self, held: HeldRead, rid: int) -> None: ...

    def read_refused(self, held: HeldRead, exc: Exception) -> None: ...


class HeldRead:
    """One read waiting to be posted: ``remote[i]`` of ``peer`` into our ``local[i]``.
    ``owner_data`` is the poster's own record (its round); ``live`` goes False when the
    poster gave the read up (the gate drops it when it comes up)."""

    __slots__ = ("live", "local", "owner", "owner_data", "peer", "remote")

    def __init__(
        self,
        owner: ReadPoster,
        owner_data: object,
        peer: str,
        local: list[int],
        remote: Sequence[int],
    ) -> None:
        self.owner = owner
        self.owner_data = owner_data
        self.peer = peer
        self.local = local
        self.remote = remote
        self.live = True

    @property
    def nblocks(self) -> int:
        return len(self.local)


_POSTED, _REFUSED, _OVER_SHARE, _BUSY = range(4)
"""What ``ReadGate._try`` did with a read."""


class ReadGate:
    """Posts reads through ``holder.data`` fairly (see the module docstring)."""

    def __init__(self, holder: DataHolder) -> None:
        self._holder = holder
        self._held: dict[str, deque[HeldRead]] = {}
        """Peer -> its reads waiting, in order; the dict's order is the turn order."""
        self._used: dict[str, int] = {}
        """Peer -> blocks of its reads in flight in the shared resource (only > 0)."""
        self._shared_reads: dict[int, tuple[str, int]] = {}
        """Read id -> (peer, blocks) of each read in flight in the shared resource."""
        self.busy: str = ""
        """Why the last read held back could not be posted (the transport's words)."""

    # -- the poster's side ------------------------------------------------------------------

    def post(self, held: HeldRead) -> None:
        """Post ``held`` now if it may go, else hold it; the owner hears of it (perhaps
        during this call) through ``read_posted`` / ``read_refused``."""
        peer = held.peer
        capacity = self._capacity(peer)
        first = peer not in self._held and not (capacity is not None and self._shared_waiting())
        if first and self._try(held, capacity) <= _REFUSED:
            return
        queue = self._held.get(peer)
        if queue is None:
            queue = self._held[peer] = deque()
        queue.append(held)

    def ended(self, rid: int) -> None:
        """Read ``rid`` ended (reported, or cancelled): its share of the resource is free."""
        entry = self._shared_reads.pop(rid, None)
        if entry is None:
            return
        peer, nblocks = entry
        left = self._used[peer] - nblocks
        if left:
            self._used[peer] = left
        else:
            del self._used[peer]

    def split(
        self, peer: str, local: list[int], remote: Sequence[int]
    ) -> Iterator[tuple[list[int], Sequence[int]]]:
        """``local``/``remote`` cut into reads that fit half of the shared resource reads
        from ``peer`` need (one piece when they need none, or fit): a read larger than the
        pool would be refused for good, and one larger than a peer's share would wait until
        every other peer's reads ended."""
        capacity = self._capacity(peer)
        step = len(local) if capacity is None else max(1, capacity // 2)
        if len(local) <= step:
            yield local, remote
            return
        for start in range(0, len(local), step):
            yield local[start : start + step], remote[start : start + step]

    # -- the tier's side --------------------------------------------------------------------

    def pump(self) -> None:
        """Post waiting reads in turns (one per peer per turn) until none may go. Called
        every tick, after the data transport was polled (reads that ended freed room)."""
        while self._held and self._turn():
            pass

    @property
    def waiting(self) -> int:
        """Reads held back now (given-up ones included until their turn comes)."""
        return sum(len(q) for q in self._held.values())

    # -- internals --------------------------------------------------------------------------

    def _turn(self) -> bool:
        """One turn over the peers with waiting reads; True if anything was posted (another
        turn may post more)."""
        posted = False
        shared_busy = False
        for peer in list(self._held):
            queue = self._held[peer]
            while queue and not queue[0].live:
                queue.popleft()
            if not queue:
                del self._held[peer]
                continue
            capacity = self._capacity(peer)
            shared = capacity is not None
            if shared and shared_busy:
                continue  # the peer whose turn it is waits for room: nobody overtakes it
            outcome = self._try(queue[0], capacity)
            if outcome == _BUSY:
                shared_busy = shared_busy or shared
            elif outcome <= _REFUSED:
                queue.popleft()
                del self._held[peer]
                if queue:
                    self._held[peer] = queue  # to the back of the turn order
                posted = posted or outcome == _POSTED
        return posted

    def _try(self, held: HeldRead, capacity: int | None) -> int:
        """Post ``held`` if its share of ``capacity`` (its peer's, as the transport says)
        allows and the transport takes it (its owner is told when it was posted or refused
        for good)."""
        peer, nblocks = held.peer, held.nblocks
        if capacity is not None:
            used = self._used.get(peer, 0)
            if used and used + nblocks > self._share(capacity, peer):
                self.busy = (
                    f"peer {peer!r} has {used} block(s) in flight, its share of the "
                    f"{capacity} the data transport shares among peers"
                )
                return _OVER_SHARE
        try:
            rid = self._holder.data.read_blocks(peer, held.local, held.remote)
        except TransferBusy as exc:
            self.busy = str(exc)
            return _BUSY
        except Exception as exc:
            held.owner.read_refused(held, exc)
            return _REFUSED
        if capacity is not None:
            self._shared_reads[rid] = (peer, nblocks)
            self._used[peer] = self._used.get(peer, 0) + nblocks
        held.owner.read_posted(held, rid)
        return _POSTED

    def _capacity(self, peer: str) -> int | None:
        try:
            return self._holder.data.read_capacity(peer)
        except Exception:  # a transport bug must not stop reads: treat it as unbounded
            return None

    def _shared_waiting(self) -> bool:
        return any(self._capacity(p) is not None for p in self._held)

    def _share(self, capacity: int, peer: str) -> int:
        """Blocks ``peer`` may have in flight: the capacity over the peers using it (at
        least two, so one peer never takes all of it)."""
        users = len(self._used) + sum(
            1 for p in self._held if p not in self._used and self._capacity(p) is not None
        )
        if peer not in self._used and peer not in self._held:
            users += 1
        return capacity // max(2, users)
