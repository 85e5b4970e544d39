"""A consumer's probes: asking the producer which keys it holds (symmetric lookups).

The engine's ``lookup`` of a key on a peer returns RETRY at first. The key waits here until
the engine's schedule ends (``flush``), when one ``lookup`` per request carries every new key.
The ``lookup_resp`` answers each key HIT or MISS, and later lookups of the key return that.
A lookup unanswered within twice the lookup timeout, or too large for one frame, answers
its keys MISS.

Threading: driver thread only.
"""

from __future__ import annotations

from p2pkv.errors import ProtocolError
from p2pkv.protocol import Lookup, LookupResp
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv, SessionLink
from p2pkv.session.loads import ConsumerRequest, Probe
from p2pkv.types import LookupResult


class Probes:
    """The probes of one consumer role (see the module docstring)."""

    def __init__(self, env: SessionEnv, link: SessionLink) -> None:
        self._env = env
        self._link = link
        self._lookups: dict[int, tuple[ConsumerRequest, list[bytes], Timer]] = {}
        """Lookups sent and not answered: seq -> (request, keys, deadline)."""
        self._probing: dict[str, ConsumerRequest] = {}
        """Requests with probe keys not yet sent (flushed at ``on_schedule_end``)."""
        self._next_seq = 0

    @property
    def busy(self) -> bool:
        return bool(self._lookups or self._probing)

    @property
    def in_flight(self) -> int:
        """Lookups sent and not answered yet."""
        return len(self._lookups)

    def probe(self, req: ConsumerRequest, key: bytes) -> LookupResult:
        """RETRY until the batched probe of ``key`` is answered, then HIT or MISS."""
        state = req.probes.get(key)
        if state is None:
            if req.finished:
                return LookupResult.MISS
            req.probes[key] = Probe.PENDING
            req.unsent_keys.append(key)
            self._probing[req.kv] = req
            return LookupResult.RETRY
        if state is Probe.HIT:
            return LookupResult.HIT
        if state is Probe.MISS:
            return LookupResult.MISS
        return LookupResult.RETRY

    def flush(self) -> None:
        """Send one lookup per request with new probe keys (``on_schedule_end``)."""
        link = self._link
        if not self._probing or not link.ready:
            return
        env = self._env
        deadline = env.clock() + 2 * env.timeouts.lookup
        for req in self._probing.values():
            keys, req.unsent_keys = req.unsent_keys, []
            if not keys:
                continue
            seq = self._next_seq
            self._next_seq += 1
            probes = req.probes
            for k in keys:
                probes[k] = Probe.INFLIGHT
            req.contacted = True
            self._lookups[seq] = (req, keys, env.deadlines.at(deadline, self._timeout, seq))
            if not link.send(Lookup(seq, req.kv, keys)):
                self._unanswered(seq)  # too many keys for one frame: they are misses
        self._probing.clear()

    def on_lookup_resp(self, msg: LookupResp) -> None:
        if msg.seq >= self._next_seq:
            raise ProtocolError(f"lookup_resp.seq: {msg.seq} was never sent")
        entry = self._lookups.pop(msg.seq, None)
        if entry is None:
            return  # the request finished or the probe timed out meanwhile
        req, keys, timer = entry
        self._env.deadlines.cancel(timer)
        if len(msg.hits) != len(keys):
            raise ProtocolError(f"lookup_resp.hits: {len(msg.hits)} answers for {len(keys)} keys")
        probes = req.probes
        for k, hit in zip(keys, msg.hits, strict=True):
            if probes.get(k) is Probe.INFLIGHT:
                probes[k] = Probe.HIT if hit else Probe.MISS

    def drop(self, req: ConsumerRequest) -> None:
        """Forget every probe of ``req`` (it finished, or the tier is shutting down)."""
        if req.probes:
            req.probes.clear()
            req.unsent_keys = []
            self._probing.pop(req.kv, None)
            for seq in [s for s, e in self._lookups.items() if e[0] is req]:
                self._env.deadlines.cancel(self._lookups.pop(seq)[2])

    def unlink(self, link: SessionLink) -> None:
        """The session closed with nothing left: ``link`` (a stand-in) replaces it."""
        self._link = link

    def close(self) -> None:
        """The session is over: forget every probe."""
        for _, _, timer in self._lookups.values():
            self._env.deadlines.cancel(timer)
        self._lookups.clear()
        self._probing.clear()

    def _timeout(self, seq: int) -> None:
        entry = self._lookups.get(seq)
        if entry is not None:
            self._env.observers.timeout(
                kind="lookup", kv_request_id=entry[0].kv, peer=self._link.peer
            )
            self._unanswered(seq)

    def _unanswered(self, seq: int) -> None:
        """Lookup ``seq`` gets no answer: its keys still asked are misses."""
        req, keys, timer = self._lookups.pop(seq)
        self._env.deadlines.cancel(timer)
        probes = req.probes
        for k in keys:
            if probes.get(k) is Probe.INFLIGHT:
                probes[k] = Probe.MISS
