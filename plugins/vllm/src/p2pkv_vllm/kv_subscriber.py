"""A subscriber to one vLLM KV-event publisher (one engine DP rank): SUB, gap repair, restarts.

Contract:

- **Threading**: not thread-safe. One thread owns a subscriber: it calls :meth:`poll` (and
  finally :meth:`close`); nothing else touches it. ``p2pkv_vllm.proxy.kv_feed`` runs one
  daemon thread per subscriber.
- **Ordering**: :meth:`poll` returns updates in publication order: a :class:`Batch` per
  sequence number, consecutive within one publisher lifetime, and a :class:`Reset` when the
  consumer must forget what it learnt from this publisher (the publisher restarted: its
  sequence went backwards, so its engine's cache is new).
- **Gaps**: a live sequence number beyond the expected one means batches were lost (slow
  joiner, high-water mark). With a replay endpoint the subscriber asks vLLM's replay ROUTER
  for the missing range and delivers what comes back before the live batch. What the replay
  cannot supply (rolled out of the engine's buffer, replay timed out, no replay endpoint)
  stays lost: :attr:`SubscriberStats.lost` counts it, and the consumer must tolerate it
  (a prefix index then simply misses those blocks or keeps stale ones).
- **Joining late**: the first batch seen with ``seq > 0`` triggers a replay from 0, so the
  consumer learns what the engine cached before the subscriber connected, as far as the
  engine's replay buffer (``buffer_steps``) reaches.
- **Snapshots**: vLLM 0.33 has no snapshot endpoint (none in its source or docs), so there
  is no snapshot procedure here; the replay buffer is the only catch-up mechanism.
- **Deadlines**: :meth:`poll` returns within ``timeout`` plus at most one replay deadline
  (``replay_timeout``); nothing blocks without a bound.
- **Failures**: an undecodable batch (``msgspec`` validation) is counted in
  :attr:`SubscriberStats.undecodable` and treated as lost; malformed frames likewise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import msgspec
import zmq

from p2pkv_vllm.kv_events import END_SEQ, KVEventBatch, decode_batch

__all__ = ["Batch", "KVEventSubscriber", "Reset", "SubscriberStats", "Update"]

MAX_DRAIN = 1024
"""Live messages read per :meth:`KVEventSubscriber.poll` at most (bounds one call's work)."""


@dataclass(frozen=True)
class Batch:
    seq: int
    batch: KVEventBatch


@dataclass(frozen=True)
class Reset:
    reason: str


Update = Batch | Reset


@dataclass
class SubscriberStats:
    received: int = 0
    """Batches delivered (live and replayed)."""
    replayed: int = 0
    lost: int = 0
    """Sequence numbers never delivered (gaps the replay could not fill)."""
    undecodable: int = 0
    restarts: int = 0
    replay_failures: int = 0


class KVEventSubscriber:
    """SUB to ``endpoint`` (and, if given, DEALER to ``replay_endpoint``) of one publisher.

    Both endpoints are ``connect``-ed (the engine binds). ``topic`` filters like vLLM's
    ``KVEventsConfig.topic``. The sockets belong to ``context`` (default: the process-wide
    instance); :meth:`close` closes them with linger 0.
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        replay_timeout: float = 2.0,
        context: zmq.Context[zmq.Socket[bytes]] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.stats = SubscriberStats()
        self._ctx = context or zmq.Context.instance()
        self._topic = topic.encode()
        self._replay_timeout = replay_timeout
        self._next: int | None = None
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, self._topic)
        self._sub.connect(endpoint)
        self._dealer: zmq.Socket[bytes] | None = None

    def close(self) -> None:
        self._sub.close(linger=0)
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None

    def poll(self, timeout: float) -> list[Update]:
        """Wait up to ``timeout`` seconds for live batches; return them with any repairs."""
        updates: list[Update] = []
        if not self._sub.poll(int(timeout * 1000)):
            return updates
        for _ in range(MAX_DRAIN):
            try:
                frames = self._sub.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._accept_live(frames, updates)
        return updates

    # -- sequencing ------------------------------------------------------------------------

    def _accept_live(self, frames: list[bytes], updates: list[Update]) -> None:
        parsed = _parse(frames)
        if parsed is None:
            self.stats.undecodable += 1
            return
        seq, payload = parsed
        expected = self._next
        if expected is not None and seq < expected:
            self.stats.restarts += 1
            updates.append(Reset(f"publisher restarted (sequence {seq} after {expected - 1})"))
            expected = None
        if expected is None:
            expected = 0 if seq > 0 and self.replay_endpoint else seq
        if seq > expected:
            self._fill(expected, seq, updates)
        self._deliver(seq, payload, updates)

    def _fill(self, start: int, stop: int, updates: list[Update]) -> None:
        """Deliver batches ``start .. stop-1`` from the replay buffer, as far as it has them."""
        got = self._replay(start, stop) if self.replay_endpoint else []
        delivered = start
        for seq, payload in got:
            if seq < delivered or seq >= stop:
                continue
            self.stats.lost += seq - delivered
            self.stats.replayed += 1
            self._deliver(seq, payload, updates)
            delivered = seq + 1
        self.stats.lost += stop - delivered

    def _deliver(self, seq: int, payload: bytes, updates: list[Update]) -> None:
        self._next = seq + 1
        try:
            batch = decode_batch(payload)
        except msgspec.DecodeError:  # ValidationError is a subclass
            self.stats.undecodable += 1
            return
        self.stats.received += 1
        updates.append(Batch(seq, batch))

    # -- replay ----------------------------------------------------------------------------

    def _replay(self, start: int, stop: int) -> list[tuple[int, bytes]]:
        """Ask the replay ROUTER for ``seq >= start``; collect until the end marker, a batch
        at or past ``stop`` (the rest is live anyway), or the replay deadline."""
        dealer = self._replay_socket()
        deadline = time.monotonic() + self._replay_timeout
        dealer.send_multipart([b"", start.to_bytes(8, "big")])
        out: list[tuple[int, bytes]] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not dealer.poll(max(1, int(left * 1000))):
                self._drop_replay_socket()  # late answers must not leak into the next replay
                self.stats.replay_failures += 1
                return out
            frames = dealer.recv_multipart()
            if len(frames) == 4 and frames[2] == END_SEQ:
                return out
            parsed = _parse(frames[1:]) if len(frames) == 4 else None
            if parsed is None:
                self.stats.undecodable += 1
                continue
            out.append(parsed)
            if parsed[0] >= stop - 1:
                self._drop_replay_socket()  # skip the rest of the answer: it is live traffic
                return out

    def _replay_socket(self) -> zmq.Socket[bytes]:
        if self._dealer is None:
            assert self.replay_endpoint is not None
            self._dealer = self._ctx.socket(zmq.DEALER)
            self._dealer.setsockopt(zmq.LINGER, 0)
            self._dealer.connect(self.replay_endpoint)
        return self._dealer

    def _drop_replay_socket(self) -> None:
        if self._dealer is not None:
            self._dealer.close(linger=0)
            self._dealer = None


def _parse(frames: list[bytes]) -> tuple[int, bytes] | None:
    """``[topic, seq, payload]`` -> (seq, payload), or None when the frames are malformed."""
    if len(frames) != 3 or len(frames[1]) != 8:
        return None
    return int.from_bytes(frames[1], "big"), frames[2]
