"""Warm pairs: open the P2P sessions between instances before the first user request.

The first pull between two fresh instances pays the tier's session setup: the consumer dials
the producer's control endpoint, the two exchange hellos carrying their data-plane
descriptors (NIXL agent metadata) and the data plane connects. With ``warm_pairs`` on, the
proxy pays it at startup with one tiny PD request per ordered pair (consumer, producer):

- a prefill leg on the producer with ``remote_decoder`` (it parks the prompt's blocks);
- then a decode leg on the consumer with ``remote_prefiller`` naming the producer's P2P
  address: the consumer's tier opens its session to the producer and loads the blocks;

both ``max_tokens`` 1, on a prompt of :data:`PROMPT_TOKENS` token ids unique to the warm-up
(no prefix-cache shortcut on either side). Later PD loads and symmetric probes
(``remote_kv_source``) between the two reuse that session. PD legs are used rather than a
symmetric probe because on vLLM 0.32 an idle source answers no probe (it answers once per
engine step), while a PD producer keeps stepping until its parked blocks are fetched.

Pairs (:func:`pairs`): every decoder slot pulling from every prefiller slot (PD), and with a
prefix policy every prefiller slot pulling from every other slot with a P2P address (the
ones it may be sent to as ``remote_kv_source``). Each two slots are warmed once: the tier
keeps one session per peer, used both ways (the dialed side dials back to answer), so
warming ``X <- Y`` also warms ``Y <- X`` (seen with real engines: after the warm-up of
``A <- B``, ``B``'s probes to ``A`` dialed nothing).

Lifecycle: :meth:`PairWarmer.run` is one background task started by the lifespan startup.
It waits (at most ``warm_pairs_wait`` seconds in all) until both instances of a pair answer
``GET /health``, then warms the pairs one at a time, each bounded by the prefill and decode
timeouts. A failed warm-up is logged and reported in ``GET /ready`` (``warm_pairs``), not
retried, and never blocks serving. Threading: the event loop only.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv.logs import module_logger

from p2pkv_vllm.proxy.config import PREFIX_POLICIES, ProxyConfig
from p2pkv_vllm.proxy.legs import (
    P2PPeer,
    decode_body,
    leg_headers,
    new_kv_request_id,
    p2p_peer,
    prefill_body,
    producer_params,
    pull_params,
)
from p2pkv_vllm.proxy.selection import Slot, slot_name, slots_of

__all__ = ["PROMPT_TOKENS", "Call", "PairWarmer", "WarmPair", "pairs"]

PROMPT_TOKENS = 257
"""Warm-up prompt length: one full block (and the last token, which vLLM always computes)
for block sizes up to 256, so the consumer looks a block up and loads it."""
TOKEN_IDS = range(3, 98)
"""Warm-up prompt token ids: ids every vocabulary of practical size has."""
HEALTH_POLL = 0.5

Call = Callable[
    [str, str, Mapping[str, Any] | None, Mapping[str, str]], Awaitable[tuple[int, bytes]]
]
"""(method, url, JSON body or None, headers) -> (status, body); raises on transport
failures (the warmer bounds and catches every call)."""

log = module_logger(__name__)


@dataclass(frozen=True)
class WarmPair:
    """``consumer`` (an instance slot) will pull from ``producer`` (a slot with a P2P tier)."""

    consumer: Slot[Any]
    producer: Slot[Any]
    peer: P2PPeer
    """The producer's P2P tier."""

    @property
    def name(self) -> str:
        return f"{slot_name(self.consumer)} <- {self.peer.name}"


def pairs(config: ProxyConfig) -> list[WarmPair]:
    """The pairs to warm (see the module docstring): each two slots once, PD direction
    first, in a stable order."""
    prefillers: list[Slot[Any]] = list(slots_of(config.prefillers))
    decoders: list[Slot[Any]] = list(slots_of(config.decoders))
    wanted = [(d, p) for d in decoders for p in prefillers]
    if config.policy in PREFIX_POLICIES:
        wanted += [
            (p, q)
            for p in prefillers
            for q in (*prefillers, *decoders)
            if slot_name(q) != slot_name(p)
        ]
    out: dict[frozenset[str], WarmPair] = {}
    for consumer, producer in wanted:
        peer = p2p_peer(producer)
        if peer is not None:
            out.setdefault(
                frozenset((slot_name(consumer), peer.name)), WarmPair(consumer, producer, peer)
            )
    return list(out.values())


def warm_prompt(kv_request_id: str) -> list[int]:
    """A prompt no other request shares (seeded by the warm-up's own kv_request_id)."""
    rng = random.Random(kv_request_id)
    return [rng.choice(TOKEN_IDS) for _ in range(PROMPT_TOKENS)]


class PairWarmer:
    """Warms :func:`pairs` of ``config`` once; :meth:`status` reports each pair."""

    def __init__(self, config: ProxyConfig, call: Call) -> None:
        self._config = config
        self._call = call
        self._pairs = pairs(config)
        self._status: dict[str, dict[str, Any]] = {
            p.name: {"state": "pending"} for p in self._pairs
        }

    def status(self) -> dict[str, dict[str, Any]]:
        """Per pair: ``state`` (``pending``, ``warm``, ``failed``), ``ms`` (the warm-up's
        two legs, from both instances healthy) once done, ``reason`` when failed. A copy."""
        return {name: dict(s) for name, s in self._status.items()}

    async def run(self) -> None:
        """Warm every pair, one at a time; returns when all are done or failed."""
        deadline = time.monotonic() + self._config.warm_pairs_wait
        for pair in self._pairs:
            try:
                await self._wait_healthy(pair, deadline)
                began = time.monotonic()
                await self._warm(pair)
            except (TimeoutError, OSError, ValueError, LookupError, TypeError) as exc:
                reason = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                self._status[pair.name] = {"state": "failed", "reason": reason}
                log.warning("warm pair %s failed: %s", pair.name, reason)
                continue
            ms = round((time.monotonic() - began) * 1000, 3)
            self._status[pair.name] = {"state": "warm", "ms": ms}
            log.info("warm pair %s: session open (%.0f ms)", pair.name, ms)

    async def _wait_healthy(self, pair: WarmPair, deadline: float) -> None:
        """Until both instances answer ``GET /health`` 2xx; ``TimeoutError`` past
        ``deadline``."""
        for url in (pair.producer.upstream.url, pair.consumer.upstream.url):
            while not await self._healthy(url):
                if time.monotonic() + HEALTH_POLL > deadline:
                    raise TimeoutError(f"{url} not healthy within warm_pairs_wait")
                await asyncio.sleep(HEALTH_POLL)

    async def _healthy(self, url: str) -> bool:
        try:
            status, _ = await asyncio.wait_for(
                self._call("GET", f"{url}/health", None, {}), self._config.timeouts.connect
            )
        except (TimeoutError, OSError):
            return False
        return 200 <= status < 300

    async def _warm(self, pair: WarmPair) -> None:
        """The two legs of one warm-up; raises ``OSError`` on a non-2xx answer."""
        t = self._config.timeouts
        kv_id = new_kv_request_id()
        model = await self._model(pair.producer.upstream.url, kv_id)
        body = {"model": model, "prompt": warm_prompt(kv_id), "max_tokens": 1, "temperature": 0}
        legs = (
            (pair.producer, prefill_body(body, producer_params(kv_id)), t.prefill),
            (pair.consumer, decode_body(body, pull_params(kv_id, pair.peer)), t.decode),
        )
        for slot, leg, timeout in legs:
            headers = leg_headers([], kv_id, slot.dp_rank, self._config.api_key)
            status, raw = await asyncio.wait_for(
                self._call("POST", f"{slot.upstream.url}/v1/completions", leg, headers), timeout
            )
            if not 200 <= status < 300:
                raise OSError(f"{slot_name(slot)} answered {status}: {raw[:200]!r}")

    async def _model(self, url: str, kv_id: str) -> str:
        """The first model ``url`` serves (``GET /v1/models``)."""
        headers = leg_headers([], kv_id, 0, self._config.api_key)
        status, raw = await asyncio.wait_for(
            self._call("GET", f"{url}/v1/models", None, headers), self._config.timeouts.connect
        )
        if not 200 <= status < 300:
            raise OSError(f"{url}/v1/models answered {status}")
        return str(json.loads(raw)["data"][0]["id"])
