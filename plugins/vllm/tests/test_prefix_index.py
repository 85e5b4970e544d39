"""The prefix index: chains, removal, LRU eviction, refusals, and a model under random events."""

from __future__ import annotations

import logging

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from p2pkv_vllm.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from p2pkv_vllm.prefix_index import PrefixIndex

BS = 4


def tokens(prompt: int, blocks: int) -> list[int]:
    return [prompt * 1000 + i for i in range(blocks * BS)]


def stored(
    prompt: int, first: int, count: int, *, seed: int = 0, medium: str = "GPU", block_size: int = BS
) -> BlockStored:
    """Blocks ``first .. first+count-1`` of prompt ``prompt`` (engine hash: (seed, prompt, i))."""
    return BlockStored(
        block_hashes=[hash((seed, prompt, i)) for i in range(first, first + count)],
        parent_block_hash=hash((seed, prompt, first - 1)) if first else None,
        token_ids=tokens(prompt, first + count)[first * BS :],
        block_size=block_size,
        lora_id=None,
        medium=medium,
        lora_name=None,
    )


def removed(prompt: int, blocks: list[int], medium: str = "GPU", seed: int = 0) -> BlockRemoved:
    return BlockRemoved(block_hashes=[hash((seed, prompt, i)) for i in blocks], medium=medium)


def batch(*events: BlockStored | BlockRemoved | AllBlocksCleared) -> KVEventBatch:
    return KVEventBatch(ts=0.0, events=list(events))


def test_longest_prefix_per_instance_across_events_and_mediums() -> None:
    index = PrefixIndex()
    index.apply("A", batch(stored(1, 0, 2), stored(1, 2, 2, medium="CPU")))
    index.apply("B", batch(stored(1, 0, 1)))
    assert index.block_size == BS
    assert index.match(tokens(1, 6)) == {"A": 16, "B": 4}
    assert index.match(tokens(1, 6)[:10]) == {"A": 8, "B": 4}  # only full blocks count
    index.apply("A", batch(removed(1, [1])))
    assert index.match(tokens(1, 6))["A"] == 4  # the chain breaks at the removed block
    index.apply("A", batch(removed(1, [2], medium="GPU")))  # held on CPU, not GPU: no-op
    index.apply("A", batch(stored(1, 1, 1)))
    assert index.match(tokens(1, 6))["A"] == 16
    index.apply("A", batch(AllBlocksCleared()))
    assert index.match(tokens(1, 6))["A"] == 0


def test_lost_parent_and_unindexable_blocks_are_skipped_not_guessed() -> None:
    index = PrefixIndex()
    index.apply("A", batch(stored(1, 2, 2)))  # parent never seen: an orphan
    lora = stored(2, 0, 1)
    lora.lora_name = "adapter"
    salted = stored(3, 0, 2)
    salted.extra_keys = [None, ("salt",)]
    index.apply("A", batch(lora, salted))
    assert index.match(tokens(1, 4)) == {"A": 0}
    assert index.match(tokens(2, 1)) == {"A": 0}
    assert index.match(tokens(3, 2)) == {"A": 4}  # up to the first block with extra keys
    status = index.status()["A"]
    assert (status.orphans, status.skipped) == (2, 2)


def test_lru_eviction_bounds_each_instance() -> None:
    index = PrefixIndex(max_blocks=3)
    index.apply("A", batch(stored(1, 0, 2), stored(2, 0, 2)))
    assert index.status()["A"].blocks == 3 and index.status()["A"].evicted == 1
    assert index.match(tokens(1, 2))["A"] == 0  # block 0 of prompt 1 was the oldest
    assert index.match(tokens(2, 2))["A"] == 8
    index.apply("A", batch(stored(1, 0, 1)))  # re-stored: newest again, evicts prompt 1 blk 1
    assert index.match(tokens(2, 2))["A"] == 8 and index.match(tokens(1, 1))["A"] == 4


def test_refuses_an_instance_with_another_block_size(caplog: pytest.LogCaptureFixture) -> None:
    index = PrefixIndex()
    index.apply("A", batch(stored(1, 0, 2)))
    with caplog.at_level(logging.WARNING):
        index.apply("B", batch(stored(1, 0, 1, block_size=8)))
        index.apply("B", batch(stored(1, 0, 1, block_size=8)))
    [line] = [r.getMessage() for r in caplog.records]
    assert "refusing B" in line and "block_size 8" in line and "cluster's is 4 (from A)" in line
    assert index.status()["B"].refused and "B" not in index.match(tokens(1, 2))
    index.forget("B")  # a restarted publisher gets a fresh chance
    assert "B" not in index.status()


def test_refuses_an_instance_hashing_the_same_block_differently() -> None:
    index = PrefixIndex(block_size=BS)
    index.apply("A", batch(stored(1, 0, 2, seed=0)))
    index.apply("B", batch(stored(1, 0, 2, seed=1)))
    assert "hashes differently" in index.status()["B"].refused
    assert index.match(tokens(1, 2)) == {"A": 8}
    index.apply("C", batch(stored(1, 0, 2, seed=0)))
    assert index.match(tokens(1, 2)) == {"A": 8, "C": 8}


events = st.lists(
    st.tuples(
        st.sampled_from(["store", "remove", "clear"]),
        st.sampled_from(["A", "B"]),
        st.integers(0, 2),
        st.integers(0, 3),
        st.integers(1, 3),
        st.sampled_from(["GPU", "CPU"]),
        st.booleans(),
    ),
    max_size=40,
)


@settings(max_examples=150, deadline=None)
@given(events)
def test_index_matches_a_model_under_random_events(script: list[tuple]) -> None:  # type: ignore[type-arg]
    """Model: per instance, which (prompt, block, medium) are held. Events may be lost
    (``lost``): then the index is merely stale (never an error); without losses its match
    equals the model's chain length."""
    index = PrefixIndex(block_size=BS)
    held: dict[str, set[tuple[int, int, str]]] = {"A": set(), "B": set()}
    any_lost = False
    for kind, who, prompt, first, count, medium, lost in script:
        any_lost |= lost
        if kind == "store":
            # stores extend a chain only from its current end (as an engine does)
            first = min(first, chain_depth(held[who], prompt))
            event: BlockStored | BlockRemoved | AllBlocksCleared = stored(
                prompt, first, count, medium=medium
            )
            held[who] |= {(prompt, i, medium) for i in range(first, first + count)}
        elif kind == "remove":
            event = removed(prompt, list(range(first, first + count)), medium)
            held[who] -= {(prompt, i, medium) for i in range(first, first + count)}
        else:
            event = AllBlocksCleared()
            held[who].clear()
        if not lost:
            index.apply(who, batch(event))
    for prompt in range(3):
        got = index.match(tokens(prompt, 8))
        for who in ("A", "B"):
            if not any_lost:
                assert got.get(who, 0) == chain_depth(held[who], prompt) * BS


def chain_depth(held: set[tuple[int, int, str]], prompt: int) -> int:
    depth = 0
    while any((prompt, depth, m) in held for m in ("GPU", "CPU")):
        depth += 1
    return depth
