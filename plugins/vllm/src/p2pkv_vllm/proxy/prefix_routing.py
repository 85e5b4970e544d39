"""Prefix-aware routing: pick slots by cached prefix and name a ``remote_kv_source``.

Per request (policies ``prefix-aware`` and ``kv-indexer``):

1. the prompt's token ids (``prompt_tokens``);
2. the cached prefix every known slot holds (a *matcher*: the in-process
   ``PrefixIndex`` or the external ``IndexerClient``), in tokens;
3. in each pool (prefillers, decoders) the slot with the longest prefix; ties, and a prompt
   nobody holds, go round-robin;
4. the *holder*: the slot with a P2P address (any prefiller; a decoder given ``p2p_host``)
   holding the longest prefix, the chosen prefiller excluded. When it leads the chosen
   prefiller by at least ``min_cached_tokens_delta`` tokens, the prefill leg (the leg that
   computes the prompt) carries ``remote_kv_source`` naming it, so that prefiller loads the
   prefix from the holder and computes only the rest.

Steps 1-2 are bounded by ``lookup_timeout``; a timeout, a prompt without token ids or a
failed lookup routes round-robin and says so in :attr:`PrefixDecision.lookup`.

Threading: the event loop only (the index it may read locks for itself).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from p2pkv_vllm.indexer_client import IndexerClient
from p2pkv_vllm.prefix_index import PrefixIndex
from p2pkv_vllm.proxy.config import Decoder, Prefiller, ProxyConfig
from p2pkv_vllm.proxy.legs import P2PPeer, p2p_peer
from p2pkv_vllm.proxy.prompt_tokens import PromptTokens
from p2pkv_vllm.proxy.selection import Slot, slot_name, slots_of

__all__ = ["Matcher", "PrefixDecision", "PrefixRouter", "indexer_matcher", "local_matcher"]

Matcher = Callable[[Sequence[int], Mapping[str, Any]], Awaitable[dict[str, int]]]
"""(prompt token ids, client body) -> matched tokens per slot name; slots absent = 0."""

U = TypeVar("U")


@dataclass(frozen=True)
class PrefixDecision:
    """What routing decided for one request (all of it goes to the access log)."""

    prefiller: Slot[Prefiller]
    decoder: Slot[Decoder]
    source: P2PPeer | None = None
    matched_tokens: int = 0
    """Cached prefix of the chosen prefiller."""
    source_tokens: int = 0
    """Cached prefix of the named source (0 without one)."""
    prompt_tokens: int = 0
    lookup: str = "no_tokens"
    """``hit`` (someone holds a prefix), ``miss``, ``no_tokens``, ``timeout``."""


def local_matcher(index: PrefixIndex) -> Matcher:
    async def match(token_ids: Sequence[int], body: Mapping[str, Any]) -> dict[str, int]:
        return index.match(token_ids)

    return match


def indexer_matcher(client: IndexerClient, config: ProxyConfig) -> Matcher:
    upstreams: tuple[Prefiller | Decoder, ...] = (*config.prefillers, *config.decoders)
    ranks = {u.url: u.dp_size for u in upstreams}

    async def match(token_ids: Sequence[int], body: Mapping[str, Any]) -> dict[str, int]:
        model = body.get("model")
        found = await client.match(token_ids, model if isinstance(model, str) else "", ranks)
        return {f"{url}#dp{rank}": tokens for (url, rank), tokens in found.items()}

    return match


class _Pool(Generic[U]):
    """One pool's slots and its round-robin cursor for ties."""

    def __init__(self, slots: Sequence[Slot[U]]) -> None:
        self.slots = list(slots)
        self.names = [slot_name(s) for s in self.slots]
        self._next = 0

    def best(self, scores: Mapping[str, int]) -> Slot[U]:
        n = len(self.slots)
        order = [(self._next + k) % n for k in range(n)]
        pick = max(order, key=lambda i: scores.get(self.names[i], 0))  # first max wins
        self._next = (pick + 1) % n
        return self.slots[pick]


class PrefixRouter:
    """Decides (prefiller, decoder, source) per request; see the module docstring."""

    def __init__(self, config: ProxyConfig, matcher: Matcher, tokens: PromptTokens) -> None:
        self._settings = config.prefix_routing
        self._matcher = matcher
        self.tokens = tokens
        self._prefillers = _Pool(slots_of(config.prefillers))
        self._decoders = _Pool(slots_of(config.decoders))
        slots: list[Slot[Prefiller] | Slot[Decoder]] = [
            *self._prefillers.slots,
            *self._decoders.slots,
        ]
        self._peers = [peer for slot in slots if (peer := p2p_peer(slot)) is not None]
        self.counters: Counter[str] = Counter()
        """decisions, with_source, lookup_<outcome>, matched_tokens, source_tokens."""

    async def decide(self, path: str, body: Mapping[str, Any]) -> PrefixDecision:
        try:
            decision = await asyncio.wait_for(
                self._decide(path, body), self._settings.lookup_timeout
            )
        except TimeoutError:
            decision = self._decision({}, 0, "timeout")
        self.counters.update(
            {
                "decisions": 1,
                f"lookup_{decision.lookup}": 1,
                "with_source": decision.source is not None,
                "matched_tokens": decision.matched_tokens,
                "source_tokens": decision.source_tokens,
            }
        )
        return decision

    async def _decide(self, path: str, body: Mapping[str, Any]) -> PrefixDecision:
        tokens = await self.tokens.of(path, body)
        if not tokens:
            return self._decision({}, 0, "no_tokens")
        scores = await self.matches(tokens, body)
        return self._decision(
            scores, len(tokens), "hit" if any(v > 0 for v in scores.values()) else "miss"
        )

    async def matches(self, tokens: Sequence[int], body: Mapping[str, Any]) -> dict[str, int]:
        """Matched tokens per slot name for ``tokens`` (nothing routed, nothing counted)."""
        return await self._matcher(tokens, body) if tokens else {}

    def _decision(
        self, scores: Mapping[str, int], prompt_tokens: int, lookup: str
    ) -> PrefixDecision:
        prefiller = self._prefillers.best(scores)
        decoder = self._decoders.best(scores)
        chosen = slot_name(prefiller)
        mine = scores.get(chosen, 0)
        holder = max(
            (p for p in self._peers if p.name != chosen),
            key=lambda p: scores.get(p.name, 0),
            default=None,
        )
        held = scores.get(holder.name, 0) if holder is not None else 0
        if holder is None or held <= mine or held - mine < self._settings.min_cached_tokens_delta:
            return PrefixDecision(prefiller, decoder, None, mine, 0, prompt_tokens, lookup)
        return PrefixDecision(prefiller, decoder, holder, mine, held, prompt_tokens, lookup)
