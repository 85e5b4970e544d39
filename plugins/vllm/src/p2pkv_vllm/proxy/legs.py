"""What each leg of a proxied request carries: body, ``kv_transfer_params``, headers.

Pure functions over plain dicts (no I/O), so the wire contract with the vLLM tier is tested
on its own. The routing dict names are the tier's current ones (``remote_prefiller``,
``remote_decoder``, ``remote_kv_source``; see docs/vllm.md).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv_vllm.proxy.config import Prefiller
from p2pkv_vllm.proxy.selection import Slot, slot_name

__all__ = [
    "DP_RANK_HEADER",
    "FORWARDED_HEADERS",
    "P2PPeer",
    "consumer_params",
    "decode_body",
    "leg_headers",
    "new_kv_request_id",
    "p2p_peer",
    "prefill_body",
    "producer_params",
    "pull_params",
    "source_params",
    "with_kv_source",
]

DP_RANK_HEADER = "X-data-parallel-rank"

FORWARDED_HEADERS = frozenset(
    {"authorization", "x-api-key", "openai-organization", "openai-project", "accept"}
)
"""Client headers copied onto both legs (auth, and the client's ``Accept``)."""

_DECODE_ONLY_FIELDS = (
    "stream",
    "stream_options",
    "max_completion_tokens",
    "min_tokens",
    "min_completion_tokens",
    "n",
    "best_of",
    "kv_transfer_params",
)
"""Dropped from the prefill leg: it produces one token of one sequence, unstreamed."""


def new_kv_request_id() -> str:
    """A fresh join key for one request's two legs (unique across proxies and restarts)."""
    return f"p2pkv-{uuid.uuid4().hex}"


def producer_params(kv_request_id: str) -> dict[str, Any]:
    """The prefill leg's routing: this instance produces the blocks for a remote decoder."""
    return {"remote_decoder": {"kv_request_id": kv_request_id}}


@dataclass(frozen=True)
class P2PPeer:
    """One DP rank's P2P tier: ``name`` (its slot name, for logs), host and (rank) port."""

    name: str
    host: str
    port: int


def p2p_peer(slot: Slot[Any]) -> P2PPeer | None:
    """The P2P tier of ``slot`` (its upstream's ``p2p_address``, port + DP rank), or None
    when the upstream has no P2P address (a decoder without ``p2p_host``)."""
    addr = slot.upstream.p2p_address
    return None if addr is None else P2PPeer(slot_name(slot), addr[0], addr[1] + slot.dp_rank)


def pull_params(kv_request_id: str, peer: P2PPeer) -> dict[str, Any]:
    """A PD consumer's routing: pull every prompt block from ``peer`` (any P2P peer)."""
    return {"remote_prefiller": _peer(kv_request_id, peer.host, peer.port)}


def _source(kv_request_id: str, slot: Slot[Prefiller]) -> dict[str, Any]:
    return _peer(kv_request_id, slot.upstream.p2p_host, slot.upstream.p2p_port + slot.dp_rank)


def _peer(kv_request_id: str, host: str, port: int) -> dict[str, Any]:
    return {"kv_request_id": kv_request_id, "remote_host": host, "remote_port": port}


def with_kv_source(
    params: Mapping[str, Any] | None, kv_request_id: str, peer: P2PPeer | None
) -> dict[str, Any] | None:
    """``params`` plus ``remote_kv_source`` naming ``peer`` (unchanged when ``peer`` is None).

    Legal alone or next to ``remote_decoder`` (a prefill leg pulling a cached prefix)."""
    if peer is None:
        return None if params is None else dict(params)
    return {**(params or {}), "remote_kv_source": _peer(kv_request_id, peer.host, peer.port)}


def consumer_params(kv_request_id: str, prefiller: Slot[Prefiller]) -> dict[str, Any]:
    """The decode leg's routing (PD): pull every prompt block from that prefiller replica."""
    return {"remote_prefiller": _source(kv_request_id, prefiller)}


def source_params(kv_request_id: str, prefiller: Slot[Prefiller]) -> dict[str, Any]:
    """The decode leg's routing (symmetric): probe that replica's cache, load what it has."""
    return {"remote_kv_source": _source(kv_request_id, prefiller)}


def prefill_body(body: Mapping[str, Any], kv_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """A copy of the client body for the prefill leg: one token, not streamed."""
    out = {k: v for k, v in body.items() if k not in _DECODE_ONLY_FIELDS}
    out["max_tokens"] = 1
    out["stream"] = False
    if kv_params is not None:
        out["kv_transfer_params"] = dict(kv_params)
    return out


def decode_body(body: Mapping[str, Any], kv_params: Mapping[str, Any] | None) -> dict[str, Any]:
    """The client body for the decode leg; the proxy owns ``kv_transfer_params``."""
    out = {k: v for k, v in body.items() if k != "kv_transfer_params"}
    if kv_params is not None:
        out["kv_transfer_params"] = dict(kv_params)
    return out


def leg_headers(
    client_headers: Iterable[tuple[bytes, bytes]],
    kv_request_id: str,
    dp_rank: int,
    api_key: str | None = None,
) -> dict[str, str]:
    """Headers of one leg: forwarded client auth, the request id, the pinned DP rank."""
    headers: dict[str, str] = {}
    for raw_name, raw_value in client_headers:
        name = raw_name.decode("latin-1").lower()
        if name in FORWARDED_HEADERS:
            headers[name] = raw_value.decode("latin-1")
    if api_key and "authorization" not in headers and "x-api-key" not in headers:
        headers["authorization"] = f"Bearer {api_key}"
    headers["content-type"] = "application/json"
    headers["x-request-id"] = kv_request_id
    headers[DP_RANK_HEADER.lower()] = str(dp_rank)
    return headers
