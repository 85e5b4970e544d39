"""Which instance holds which prompt prefix, learnt from vLLM's KV events.

Keys: the index does not reproduce vLLM's block hash. It keys every block by its own
*content key*, a 64-bit BLAKE2b chain over the block's token ids and its parent's content key
(:func:`chain_keys`), computed the same way from an event's ``token_ids`` and from a request's
prompt tokens; the engine's hash is kept only to resolve ``parent_block_hash`` and
``BlockRemoved``. So the proxy needs the prompt's token ids, not vLLM's hashing.

Agreement: every instance must use the same block size and the same block hashing (seed and
algorithm), otherwise a peer cannot find a prefix in another peer's cache by hash. The index
checks both from the events and **refuses** an instance that disagrees: the first block size
seen (or the configured one) is the cluster's, and two instances caching the same first
block (same tokens, no extra keys) must report the same engine hash for it. A refused
instance is dropped from matching, named in one warning log line and in :meth:`status`.

Bounds: at most ``max_blocks`` blocks per instance, least recently stored evicted first
(LRU); at most ``ROOT_SAMPLES`` first blocks remembered for the hash check.

Lost events are tolerated: a block whose ``BlockStored`` was lost, or whose parent is
unknown, is simply missing (the prefix match stops there); a block whose ``BlockRemoved`` was
lost stays until LRU eviction, and a pull of it misses and degrades to recompute.

Not indexed (counted as ``skipped``): blocks of KV-cache groups other than 0, blocks of LoRA
requests, blocks whose hash has extra keys (multimodal inputs, ``cache_salt``) and events
whose ``token_ids`` do not cover exactly ``block_size`` tokens per block.

Threading: every public method takes one internal lock, so event feed threads and the
proxy's event loop may call concurrently. Lookups are O(prompt blocks x instances) dict
probes under that lock.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from p2pkv_vllm.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    EngineBlockHash,
    KVEventBatch,
)

__all__ = ["DEFAULT_MAX_BLOCKS", "ROOT_SAMPLES", "InstanceStatus", "PrefixIndex", "chain_keys"]

DEFAULT_MAX_BLOCKS = 131_072
"""Default LRU cap per instance: 2M tokens at block size 16, ~40 MB of index per instance."""
ROOT_SAMPLES = 4096
"""First blocks remembered (cluster-wide) to compare the instances' block hashing."""
ROOT_KEY = 0
UNSPECIFIED_MEDIUM = "unspecified"

log = logging.getLogger(__name__)


def chain_keys(token_ids: Sequence[int], block_size: int, parent: int = ROOT_KEY) -> list[int]:
    """The content keys of the full blocks of ``token_ids`` following ``parent``."""
    keys: list[int] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        h = hashlib.blake2b(parent.to_bytes(8, "little"), digest_size=8)
        h.update(array("q", token_ids[start : start + block_size]).tobytes())
        parent = int.from_bytes(h.digest(), "little")
        keys.append(parent)
    return keys


@dataclass
class InstanceStatus:
    blocks: int = 0
    stored: int = 0
    removed: int = 0
    evicted: int = 0
    skipped: int = 0
    orphans: int = 0
    """Stored blocks whose parent the index did not know (lost or evicted parent)."""
    clears: int = 0
    refused: str = ""


class _Block:
    """One cached block of one instance: on which mediums (bit mask), under which hash."""

    __slots__ = ("engine_hash", "mediums")

    def __init__(self, mediums: int, engine_hash: EngineBlockHash) -> None:
        self.mediums = mediums
        self.engine_hash = engine_hash


@dataclass
class _Instance:
    blocks: OrderedDict[int, _Block] = field(default_factory=OrderedDict)
    """Content key -> block, least recently stored first."""
    by_engine_hash: dict[EngineBlockHash, int] = field(default_factory=dict)
    status: InstanceStatus = field(default_factory=InstanceStatus)


class PrefixIndex:
    """Per-instance, per-medium block chains; see the module docstring for the contract."""

    def __init__(
        self, *, block_size: int | None = None, max_blocks: int = DEFAULT_MAX_BLOCKS
    ) -> None:
        if max_blocks < 1 or (block_size is not None and block_size < 1):
            raise ValueError("block_size and max_blocks must be >= 1")
        self._lock = threading.Lock()
        self._block_size = block_size
        self._block_size_from = "configuration" if block_size else ""
        self._max_blocks = max_blocks
        self._instances: dict[str, _Instance] = {}
        self._mediums: dict[str, int] = {}
        self._roots: OrderedDict[int, tuple[EngineBlockHash, str]] = OrderedDict()

    @property
    def block_size(self) -> int | None:
        return self._block_size

    def apply(self, instance: str, batch: KVEventBatch) -> None:
        """Apply one batch published by ``instance`` (events in order)."""
        with self._lock:
            state = self._instances.setdefault(instance, _Instance())
            for event in batch.events:
                if state.status.refused:
                    return
                if isinstance(event, BlockStored):
                    self._stored(instance, state, event)
                elif isinstance(event, BlockRemoved):
                    self._removed(state, event)
                elif isinstance(event, AllBlocksCleared):
                    self._clear(state)

    def forget(self, instance: str) -> None:
        """Drop everything known about ``instance`` (its publisher restarted), refusal too."""
        with self._lock:
            self._instances.pop(instance, None)
            for key in [k for k, (_, who) in self._roots.items() if who == instance]:
                del self._roots[key]

    def match(self, token_ids: Sequence[int]) -> dict[str, int]:
        """Tokens of the longest cached prefix of ``token_ids`` per accepted instance.

        A block counts when the instance holds it on any medium. Instances never heard of
        are absent; accepted ones with no match are present with 0."""
        with self._lock:
            if self._block_size is None:
                return {}
            keys = chain_keys(token_ids, self._block_size)
            out: dict[str, int] = {}
            for name, state in self._instances.items():
                if state.status.refused:
                    continue
                depth = 0
                for key in keys:
                    if key not in state.blocks:
                        break
                    depth += 1
                out[name] = depth * self._block_size
            return out

    def status(self) -> dict[str, InstanceStatus]:
        """A copy of every instance's counters (``refused`` says why when refused)."""
        with self._lock:
            return {
                name: InstanceStatus(**{**s.status.__dict__, "blocks": len(s.blocks)})
                for name, s in self._instances.items()
            }

    # -- events (lock held) ---------------------------------------------------------------

    def _stored(self, instance: str, state: _Instance, event: BlockStored) -> None:
        bs = self._agreed_block_size(instance, state, event.block_size)
        if bs is None:
            return
        n = len(event.block_hashes)
        if (
            event.group_idx
            or event.lora_name is not None
            or event.lora_id is not None
            or len(event.token_ids) != n * bs
        ):
            state.status.skipped += n
            return
        if event.extra_keys is not None:
            n = next((i for i, extra in enumerate(event.extra_keys) if extra is not None), n)
            state.status.skipped += len(event.block_hashes) - n
        parent = ROOT_KEY
        if event.parent_block_hash is not None:
            found = state.by_engine_hash.get(event.parent_block_hash)
            if found is None:
                state.status.orphans += n
                return
            parent = found
        keys = chain_keys(event.token_ids[: n * bs], bs, parent)
        if (
            event.parent_block_hash is None
            and keys
            and not self._same_hashing(instance, state, keys[0], event.block_hashes[0])
        ):
            return
        bit = self._medium_bit(event.medium)
        for key, engine_hash in zip(keys, event.block_hashes, strict=False):
            self._insert(state, key, engine_hash, bit)

    def _insert(self, state: _Instance, key: int, engine_hash: EngineBlockHash, bit: int) -> None:
        block = state.blocks.get(key)
        if block is None:
            state.blocks[key] = _Block(bit, engine_hash)
        else:
            block.mediums |= bit
            block.engine_hash = engine_hash
            state.blocks.move_to_end(key)
        state.by_engine_hash[engine_hash] = key
        state.status.stored += 1
        while len(state.blocks) > self._max_blocks:
            _, old = state.blocks.popitem(last=False)
            state.by_engine_hash.pop(old.engine_hash, None)
            state.status.evicted += 1

    def _removed(self, state: _Instance, event: BlockRemoved) -> None:
        if event.group_idx:
            return
        bit = self._medium_bit(event.medium)
        for engine_hash in event.block_hashes:
            key = state.by_engine_hash.get(engine_hash)
            block = state.blocks.get(key) if key is not None else None
            if key is None or block is None:
                continue
            block.mediums &= ~bit
            state.status.removed += 1
            if not block.mediums:
                del state.blocks[key]
                del state.by_engine_hash[engine_hash]

    def _clear(self, state: _Instance) -> None:
        state.blocks.clear()
        state.by_engine_hash.clear()
        state.status.clears += 1

    # -- agreement ------------------------------------------------------------------------

    def _agreed_block_size(self, instance: str, state: _Instance, size: int) -> int | None:
        if self._block_size is None:
            self._block_size, self._block_size_from = size, instance
        if size == self._block_size:
            return size
        self._refuse(
            instance,
            state,
            f"its BlockStored events say block_size {size}, the "
            f"cluster's is {self._block_size} (from {self._block_size_from}); "
            "start every instance with the same --block-size",
        )
        return None

    def _same_hashing(
        self, instance: str, state: _Instance, key: int, engine_hash: EngineBlockHash
    ) -> bool:
        seen = self._roots.get(key)
        if seen is None:
            self._roots[key] = (engine_hash, instance)
            if len(self._roots) > ROOT_SAMPLES:
                self._roots.popitem(last=False)
            return True
        if seen[0] == engine_hash or seen[1] == instance:
            return True
        self._refuse(
            instance,
            state,
            f"the same first block hashes differently here and on "
            f"{seen[1]}: block hash seed or algorithm differ; start every instance "
            "with the same PYTHONHASHSEED and --prefix-caching-hash-algo",
        )
        return False

    def _refuse(self, instance: str, state: _Instance, why: str) -> None:
        state.status.refused = why
        state.blocks.clear()
        state.by_engine_hash.clear()
        log.warning("prefix index: refusing %s: %s", instance, why)

    def _medium_bit(self, medium: str | None) -> int:
        name = medium or UNSPECIFIED_MEDIUM
        bit = self._mediums.get(name)
        if bit is None:
            bit = self._mediums[name] = 1 << len(self._mediums)
        return bit
