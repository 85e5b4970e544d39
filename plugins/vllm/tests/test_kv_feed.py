"""The KV-event feed drops vLLM's placeholder ``BlockStored`` events before the index.

vLLM 0.32's OffloadingConnector publishes a placeholder (``block_size`` 0, no tokens) for an
offloaded block it kept no metadata for; seen by the index, its ``block_size`` 0 would get a
healthy instance refused (found with real engines, ``test_engine_prefix``).
"""

from __future__ import annotations

from p2pkv_vllm.kv_events import BlockRemoved, BlockStored, KVEventBatch
from p2pkv_vllm.prefix_index import PrefixIndex
from p2pkv_vllm.proxy.kv_feed import without_placeholders

TOKENS = list(range(3, 35))


def stored(token_ids: list[int], block_size: int, medium: str) -> BlockStored:
    return BlockStored(
        block_hashes=[b"h" * 32],
        parent_block_hash=None,
        token_ids=token_ids,
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def test_placeholders_are_dropped_and_the_instance_stays_indexed() -> None:
    gpu, placeholder = stored(TOKENS, 32, "GPU"), stored([], 0, "CPU")
    removed = BlockRemoved(block_hashes=[b"h" * 32], medium="CPU")
    batch = KVEventBatch(ts=1.0, events=[gpu, placeholder, removed])
    assert without_placeholders(batch).events == [gpu, removed]
    index = PrefixIndex()
    index.apply("a#dp0", without_placeholders(batch))
    assert index.status()["a#dp0"].refused == ""
    assert index.match([*TOKENS, 1]) == {"a#dp0": 32}


def test_a_batch_without_placeholders_is_passed_as_is() -> None:
    batch = KVEventBatch(ts=1.0, events=[stored(TOKENS, 32, "GPU")])
    assert without_placeholders(batch) is batch
