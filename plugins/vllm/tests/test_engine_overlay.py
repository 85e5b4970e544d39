"""The shipped llm-d overlay on real engines: the guide's ``"type": "p2p"`` entry, the
overlay's environment (zero-edit mode, the fleet's CURVE keys from one directory, the peers
the tier may dial and the ones it connects to before any request) and the connector keys
of its ``--kv-transfer-config``, taken from ``kubectl kustomize deploy/llm-d/overlay``
(:mod:`overlay` lists the few values a cluster or the CPU platform fills in). PD in both
arrival orders and a prefix pull between the two, as ``test_engine_pd`` runs its rows; and,
since the guide's keys offload generated tokens too (``offload_prompt_only: false``, with
``self_describing_kv_events: true``), a conversation's second turn pulling the first turn's
generated tokens from the engine that generated them."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]  # engines boot for minutes
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("yaml", reason="needs PyYAML (vLLM's dependency) to read the overlay")

from engine_kit import (  # noqa: E402
    EXTERNAL_TOKENS,
    WAIT,
    Engine,
    delta,
    free_port,
    full_blocks,
    prompt,
    running,
)
from llm_host import BLOCK_SIZE  # noqa: E402
from overlay import engine_settings, render  # noqa: E402
from p2pkv_zmq.keys import write_fleet_keys  # noqa: E402
from test_engine_pd import (  # noqa: E402, F401 - the tests run again on the overlay's pair
    MAX_TOKENS,
    STORED,
    Pair,
    Reference,
    ref,
    reference,
    test_decoder_first,
    test_prefiller_first,
    test_symmetric_a_busy_source_shares_its_prefix,
)


@pytest.fixture(scope="module")
def pair(tiny_model: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    """A prefiller and a decoder configured by the rendered overlay."""
    try:
        render()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot render the overlay: {exc}")
    keys = tmp_path_factory.mktemp("curve")
    write_fleet_keys(Path(keys))
    ports = [free_port(), free_port()]
    engines = []
    for name, port in zip(("pre", "dec"), ports, strict=True):
        tier, connector, env = engine_settings(port, ports, Path(keys))
        engines.append(Engine(name, tiny_model, tier, env, extra=connector))
    with running(*engines) as (pre, dec):
        assert pre.runs_p2pkv and dec.runs_p2pkv
        yield pre, dec


def test_a_second_turn_pulls_the_first_turns_generated_tokens(
    reference: Reference,  # noqa: F811 - the fixture imported above
    pair: Pair,
) -> None:
    """Turn 1 (150 prompt tokens, 100 generated) on the source; turn 2 (turn 1, its answer and
    20 new tokens) on the other engine with ``remote_kv_source`` naming the source: the
    blocks it loads reach past the first prompt, into the generated tokens."""
    source, consumer = pair
    first = prompt(41, 150)
    stored = source.metrics().get(STORED, 0.0)
    answer = source.generate("turn-1", first, 100)[0]
    conversation = first + answer
    held = full_blocks(conversation)  # the last token has no KV yet: as for a prompt
    assert held * BLOCK_SIZE > len(first)  # some of them hold generated tokens only
    enough = stored + held * source.chunk_bytes()
    deadline = time.monotonic() + WAIT
    while source.metrics().get(STORED, 0.0) < enough:
        assert time.monotonic() < deadline, f"the source did not store {held} blocks in {WAIT}s"
    second = conversation + prompt(42, 20)
    before = consumer.metrics()
    params = {
        "remote_kv_source": {
            "kv_request_id": "kv-turn-2",
            "remote_host": "127.0.0.1",
            "remote_port": source.port,
        }
    }
    out, cached = consumer.generate("turn-2", second, MAX_TOKENS, params)
    assert out == reference(second)
    assert cached == held * BLOCK_SIZE
    assert delta(consumer.metrics(), before, EXTERNAL_TOKENS) == cached
