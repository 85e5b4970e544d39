"""Feed a :class:`~p2pkv_vllm.prefix_index.PrefixIndex` from the instances' KV events.

One daemon thread per (instance, DP rank) that has ``kv_events``: it owns one
:class:`~p2pkv_vllm.kv_subscriber.KVEventSubscriber` (the subscriber's one owner thread) and
applies every update to the index (the index locks). A publisher restart makes the index
forget that rank. Placeholder ``BlockStored`` events are dropped before the index sees them:
vLLM's OffloadingConnector publishes them (``block_size`` 0, no ``token_ids``) for offloaded
blocks it kept no metadata for; they name no tokens, so nothing can be matched against them,
and taken at face value their ``block_size`` 0 would get the instance refused.
:meth:`KVEventFeeds.stop` sets a flag each thread checks at least every
``POLL_INTERVAL`` seconds, then joins them, bounded.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

import msgspec

from p2pkv_vllm.kv_events import BlockStored, KVEventBatch, endpoint_for_rank
from p2pkv_vllm.kv_subscriber import Batch, KVEventSubscriber, SubscriberStats
from p2pkv_vllm.prefix_index import PrefixIndex
from p2pkv_vllm.proxy.config import Decoder, Prefiller
from p2pkv_vllm.proxy.selection import Slot, slot_name

__all__ = ["POLL_INTERVAL", "KVEventFeeds", "without_placeholders"]

POLL_INTERVAL = 0.2


class KVEventFeeds:
    """The feeds of every upstream with ``kv_events``; start once, stop once."""

    def __init__(self, index: PrefixIndex, upstreams: Sequence[Prefiller | Decoder]) -> None:
        self._index = index
        self._stop = threading.Event()
        self._targets = [
            (
                slot_name(Slot(u, rank)),
                endpoint_for_rank(u.kv_events, rank),
                endpoint_for_rank(u.kv_replay, rank) if u.kv_replay else None,
            )
            for u in upstreams
            if u.kv_events
            for rank in range(u.dp_size)
        ]
        self._stats: dict[str, SubscriberStats] = {}
        self._threads: list[threading.Thread] = []

    def start(self) -> None:
        for name, endpoint, replay in self._targets:
            sub = KVEventSubscriber(endpoint, replay)
            self._stats[name] = sub.stats
            thread = threading.Thread(
                target=self._run, args=(name, sub), daemon=True, name=f"p2pkv-kv-events {name}"
            )
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout: float = 2.0) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(timeout)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Per rank: its endpoints and subscriber counters (read racily: monitoring only)."""
        return {
            name: {
                "endpoint": endpoint,
                "replay_endpoint": replay,
                **(asdict(self._stats[name]) if name in self._stats else {}),
            }
            for name, endpoint, replay in self._targets
        }

    def _run(self, name: str, sub: KVEventSubscriber) -> None:
        try:
            while not self._stop.is_set():
                for update in sub.poll(POLL_INTERVAL):
                    if isinstance(update, Batch):
                        self._index.apply(name, without_placeholders(update.batch))
                    else:
                        self._index.forget(name)
        finally:
            sub.close()


def without_placeholders(batch: KVEventBatch) -> KVEventBatch:
    """``batch`` minus its placeholder ``BlockStored`` events (``block_size`` 0 and no
    ``token_ids``); the same object when it has none."""
    kept = [
        e
        for e in batch.events
        if not (isinstance(e, BlockStored) and e.block_size == 0 and not e.token_ids)
    ]
    return batch if len(kept) == len(batch.events) else msgspec.structs.replace(batch, events=kept)
