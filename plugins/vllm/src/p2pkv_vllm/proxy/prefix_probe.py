"""Wait until a running proxy's prefix index shows a holder: the hook for real-engine tests.

Engines publish KV events asynchronously, so a test that stores a prefix on instance A must
wait for A's events to reach the proxy before it sends the request that should pull from A.
Stdlib only (``urllib``), blocking: call it from a test thread, not from an event loop.
"""

from __future__ import annotations

import json
import time
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["wait_until_cached"]


def wait_until_cached(
    proxy_url: str,
    holder: str,
    min_tokens: int,
    *,
    token_ids: Sequence[int] | None = None,
    body: Mapping[str, Any] | None = None,
    path: str = "/v1/completions",
    timeout: float = 30.0,
    interval: float = 0.1,
) -> dict[str, int]:
    """Poll ``POST {proxy_url}/prefix-index/match`` until slot ``holder`` (``URL#dp<rank>``,
    as in the access log) matches at least ``min_tokens`` of the prompt; return the matches.

    The prompt is ``token_ids``, or ``body`` (a generate request body, tokenized by the proxy
    like a real request to ``path``). Raises ``TimeoutError`` with the last matches after
    ``timeout`` seconds; each HTTP call is bounded by the time left."""
    query: dict[str, Any] = (
        {"token_ids": list(token_ids)} if token_ids is not None else {**(body or {}), "path": path}
    )
    deadline = time.monotonic() + timeout
    matches: dict[str, int] = {}
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(
                f"{holder} never matched {min_tokens} tokens in {timeout:g}s; "
                f"last matches: {matches}"
            )
        request = urllib.request.Request(
            f"{proxy_url.rstrip('/')}/prefix-index/match",
            data=json.dumps(query).encode(),
            headers={"content-type": "application/json"},
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=left) as response:
            matches = json.loads(response.read())["matches"]
        if matches.get(holder, 0) >= min_tokens:
            return matches
        time.sleep(min(interval, max(0.0, deadline - time.monotonic())))
