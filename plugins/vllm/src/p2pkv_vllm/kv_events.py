"""vLLM's KV-event wire format, declared here so the proxy decodes it without vLLM installed.

The structs mirror vLLM 0.33's published event schema (``vllm.distributed.kv_events``; the
fields a consumer relies on, same names, same types, same required/optional split):

- a PUB socket sends multipart ``[topic, seq, payload]``: ``topic`` the configured topic
  (bytes, default empty), ``seq`` an 8-byte big-endian counter that starts at 0 in every
  publisher process and grows by one per batch, ``payload`` one msgpack-encoded
  :class:`KVEventBatch`, encoded as an array ``[ts, events, data_parallel_rank]``;
- each event is a msgpack map tagged by its class name in the ``type`` key: ``BlockStored``,
  ``BlockRemoved``, ``AllBlocksCleared``. Fields this module does not declare are ignored
  (newer vLLM versions add optional ones); a missing required field, a wrong type or an
  unknown tag fails the whole batch (:func:`decode_batch` raises ``msgspec.ValidationError``);
- the replay ROUTER takes ``[b"", start_seq]`` from a DEALER (``start_seq`` 8-byte big-endian)
  and answers every buffered batch with ``seq >= start_seq`` as ``[b"", topic, seq, payload]``,
  then the end marker ``[b"", b"", END_SEQ, b""]``;
- DP rank ``r`` of an engine publishes on the configured port ``+ r`` (both sockets; a port of
  0 is not offset), see :func:`endpoint_for_rank`.

vLLM 0.33 offers no snapshot endpoint; a subscriber recovers from gaps with the replay buffer
only (see ``p2pkv_vllm.kv_subscriber``).
"""

from __future__ import annotations

from typing import Any

import msgspec

__all__ = [
    "END_SEQ",
    "AllBlocksCleared",
    "BlockRemoved",
    "BlockStored",
    "EngineBlockHash",
    "KVEventBatch",
    "decode_batch",
    "encode_batch",
    "endpoint_for_rank",
]

EngineBlockHash = bytes | int
"""A block hash as the engine publishes it: sha256 bytes by default, or a 64-bit int when
vLLM runs with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``."""

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The ``seq`` frame of the replay's end marker."""


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Consecutive full blocks were cached: ``block_hashes[0]`` follows ``parent_block_hash``
    (None at the start of a sequence); ``token_ids`` covers all of them."""

    block_hashes: list[EngineBlockHash]
    parent_block_hash: EngineBlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    """Per block: what besides the tokens went into its hash (multimodal, cache_salt, ...)."""
    group_idx: int | None = None
    """KV-cache group (hybrid models); None or 0 for the main attention group."""


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """Blocks were evicted from ``medium``."""

    block_hashes: list[EngineBlockHash]
    medium: str | None
    group_idx: int | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True, gc=False):
    """The engine dropped its whole prefix cache."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """One published batch: the events of one engine step, in order."""

    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_ENCODER = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """Decode one payload frame (strict types; raises ``msgspec.DecodeError`` subclasses)."""
    return _DECODER.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    """The payload frame vLLM would publish for ``batch`` (used by test publishers)."""
    return _ENCODER.encode(batch)


def endpoint_for_rank(endpoint: str, dp_rank: int) -> str:
    """The endpoint DP rank ``dp_rank`` of an engine configured with ``endpoint`` uses.

    ``tcp://host:port`` -> ``tcp://host:(port + dp_rank)`` unless the port is 0;
    ``inproc://name`` -> ``inproc://name_dp<rank>``. vLLM refuses other schemes with DP > 0,
    and so does this function (``ValueError``)."""
    if dp_rank == 0:
        return endpoint
    if endpoint.startswith("tcp://"):
        base, _, port = endpoint.rpartition(":")
        return endpoint if int(port) == 0 else f"{base}:{int(port) + dp_rank}"
    if endpoint.startswith("inproc://"):
        return f"{endpoint}_dp{dp_rank}"
    raise ValueError(f"{endpoint!r}: only tcp:// and inproc:// endpoints follow the DP rank")
