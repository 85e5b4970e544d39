"""Serving a consumer's lookups from the engine's local hit source.

A ``lookup`` asks which of some keys this engine holds. Each one waits here until the engine
offers its ``LocalHitSource`` (``P2PTier.serve_lookups``), which answers HIT, MISS or RETRY
per key. Once no key is RETRY, or the lookup deadline passed, the hits are pinned through
the source and become supply for the request (the ``adopt`` callback). Then one
``lookup_resp`` answers every key. A source that raises answers MISS: the engine goes on.

Threading: driver thread only.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from p2pkv.errors import ProtocolError
from p2pkv.protocol import Lookup, LookupResp, Message
from p2pkv.session.deadlines import Timer
from p2pkv.session.env import SessionEnv, dropped
from p2pkv.types import Job, LocalHitSource, LookupResult

log = logging.getLogger(__name__)


class _Serve:
    __slots__ = ("answers", "begun", "handle", "keys", "kv", "seq", "timer")

    def __init__(self, seq: int, kv: str, keys: list[bytes]) -> None:
        self.seq = seq
        self.kv = kv
        self.keys = keys
        self.answers: list[bool | None] = [None] * len(keys)
        self.begun = False
        self.handle: object = None
        self.timer: Timer | None = None


class LookupServing:
    """The pending lookups of one consumer (see the module docstring).

    ``send`` puts a message on the session. ``adopt(kv, job)`` turns a job the source
    pinned into supply for ``kv``: the keys it can serve, or None (the job then has its
    result already)."""

    def __init__(
        self,
        env: SessionEnv,
        peer: str,
        send: Callable[[Message], bool],
        adopt: Callable[[str, Job], set[bytes] | None],
    ) -> None:
        self._env = env
        self._peer = peer
        self._send = send
        self._adopt = adopt
        self._serves: dict[int, _Serve] = {}
        self._last_seq = -1
        self._refusing = False

    def __len__(self) -> int:
        """Lookups not answered yet."""
        return len(self._serves)

    def unlink(self) -> None:
        """The session closed with nothing left: forget it and its role (no reference
        cycle)."""
        self._send = dropped
        self._adopt = _adopt_nothing

    def on_lookup(self, msg: Lookup) -> None:
        """Queue ``msg`` for the hit source; answer all MISS at once when there is none."""
        if msg.seq <= self._last_seq:
            raise ProtocolError(
                f"lookup.seq: {msg.seq} is not above the previous lookup {self._last_seq}"
            )
        self._last_seq = msg.seq
        env = self._env
        if not env.lookup_ends.source_seen or self._refusing:
            self._send(LookupResp(msg.seq, [False] * len(msg.keys)))
            return
        serve = _Serve(msg.seq, msg.kv_request_id, msg.keys)
        serve.timer = env.deadlines.at(env.clock() + env.timeouts.lookup, self._expired, serve)
        self._serves[msg.seq] = serve

    def refuse_new(self) -> None:
        """Answer later lookups all MISS at once (the tier is shutting down)."""
        self._refusing = True

    def serve(self, source: LocalHitSource) -> None:
        """Advance every pending lookup with ``source``; answer the settled ones."""
        if not self._serves:
            return
        now = self._env.clock()
        for serve in list(self._serves.values()):
            answers = serve.answers
            try:
                if not serve.begun:
                    serve.handle = source.begin(serve.kv)
                    serve.begun = True
                for i, key in enumerate(serve.keys):
                    if answers[i] is None:
                        res = source.lookup(serve.handle, key)
                        if res is LookupResult.HIT:
                            answers[i] = True
                        elif res is LookupResult.MISS:
                            answers[i] = False
            except Exception:
                log.exception(
                    "peer %s: hit source failed serving lookup %d of %r; answering MISS",
                    self._peer,
                    serve.seq,
                    serve.kv,
                )
                self._answer_miss(serve, source)
                continue
            expired = serve.timer is not None and now >= serve.timer[0]
            if expired or None not in answers:
                self._answer(serve, source)

    def close(self) -> None:
        """The session is over: forget every lookup; their handles end at the next
        ``serve_lookups``."""
        env = self._env
        for serve in self._serves.values():
            env.deadlines.cancel(serve.timer)
            if serve.begun:
                env.lookup_ends.defer(serve.handle)
        self._serves.clear()

    def _answer(self, serve: _Serve, source: LocalHitSource) -> None:
        hits = [a is True for a in serve.answers]
        hit_keys = [k for k, h in zip(serve.keys, hits, strict=True) if h]
        if hit_keys:
            pinned: set[bytes] | None = None
            try:
                job = source.pin(serve.handle, hit_keys)
            except Exception:
                log.exception("peer %s: hit source pin() failed; answering MISS", self._peer)
            else:
                pinned = self._adopt(serve.kv, job)
            hits = [
                h and pinned is not None and k in pinned
                for k, h in zip(serve.keys, hits, strict=True)
            ]
        self._finish(serve, hits)
        self._end(source, serve.handle)

    def _end(self, source: LocalHitSource, handle: object) -> None:
        try:
            source.end(handle)
        except Exception:
            log.exception("peer %s: hit source end() failed", self._peer)

    def _answer_miss(self, serve: _Serve, source: LocalHitSource | None) -> None:
        self._finish(serve, [False] * len(serve.keys))
        if serve.begun:
            if source is None:
                self._env.lookup_ends.defer(serve.handle)
            else:
                self._end(source, serve.handle)

    def _finish(self, serve: _Serve, hits: list[bool]) -> None:
        self._env.deadlines.cancel(serve.timer)
        self._serves.pop(serve.seq, None)
        self._send(LookupResp(serve.seq, hits))

    def _expired(self, serve: _Serve) -> None:
        """The lookup deadline passed with no ``serve_lookups`` call to finish it: MISS."""
        serve.timer = None
        self._env.observers.timeout(kind="lookup", kv_request_id=serve.kv, peer=self._peer)
        self._answer_miss(serve, None)


def _adopt_nothing(kv: str, job: Job) -> None:
    """A closed session serves no lookup: never called (its lookups were dropped)."""
