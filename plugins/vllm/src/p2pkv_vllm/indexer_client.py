"""A client of an external KV indexer speaking Mooncake RFC #1403's HTTP API.

Used instead of the proxy's own index by the ``kv-indexer`` policy (Mooncake Conductor and
Dynamo's standalone indexer implement the API). One call, ``POST {base}/query``::

    request  {"model": M, "token_ids": [...], "block_size": B, "tenant_id": T}
    response {T: {instance_id: {"longest_matched": N, "DP": {"0": n0, "1": n1}, "GPU": g, ...}}}

What this client assumes (the RFC leaves it to deployments): the ``instance_id`` each engine
was registered under is the URL the proxy knows it by (``--prefiller``/``--decoder`` URL,
without a trailing slash); a DP rank's match is ``DP[str(rank)]`` when the answer has a
``DP`` map, else ``longest_matched`` for every rank. Per-medium counts are not used.

Threading: the event loop only. Failure: an unreachable indexer, a non-2xx answer or an
answer of another shape gives an empty match (routing falls back to round-robin) and
counts in :attr:`IndexerClient.failures`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from p2pkv_vllm.proxy.prompt_tokens import PostJson

__all__ = ["IndexerClient"]


class IndexerClient:
    """Queries ``base_url`` for the prefix every (instance URL, DP rank) holds."""

    def __init__(
        self, post_json: PostJson, base_url: str, *, block_size: int, tenant: str = "default"
    ) -> None:
        self._post = post_json
        self._url = f"{base_url.rstrip('/')}/query"
        self._block_size = block_size
        self._tenant = tenant
        self.failures = 0

    async def match(
        self, token_ids: Sequence[int], model: str, ranks: Mapping[str, int]
    ) -> dict[tuple[str, int], int]:
        """Matched tokens per (instance URL, DP rank) for the instances in ``ranks``
        (URL -> DP size); instances the indexer does not name are absent."""
        status, raw = await self._post(
            self._url,
            {
                "model": model,
                "token_ids": list(token_ids),
                "block_size": self._block_size,
                "tenant_id": self._tenant,
            },
        )
        try:
            if not 200 <= status < 300:
                raise ValueError(f"status {status}")
            return _matches(json.loads(raw)[self._tenant], ranks)
        except (ValueError, KeyError, TypeError, AttributeError):
            self.failures += 1
            return {}


def _matches(answer: Mapping[str, Any], ranks: Mapping[str, int]) -> dict[tuple[str, int], int]:
    out: dict[tuple[str, int], int] = {}
    for url, dp_size in ranks.items():
        entry = answer.get(url)
        if entry is None:
            continue
        per_rank = entry.get("DP")
        for rank in range(dp_size):
            value = per_rank.get(str(rank), 0) if per_rank else entry["longest_matched"]
            out[url, rank] = int(value)
    return out
