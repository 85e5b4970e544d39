"""Prefix-aware routing: decisions in isolation, config, and the proxy end to end with fake
vLLM servers plus publishers speaking vLLM's KV-event wire format on loopback."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import asdict
from typing import Any

import aiohttp
import pytest
from p2pkv.errors import ConfigError
from p2pkv_vllm.indexer_client import IndexerClient
from p2pkv_vllm.kv_events import BlockStored, KVEventBatch
from p2pkv_vllm.proxy.app import ACCESS_LOGGER, ProxyApp
from p2pkv_vllm.proxy.config import (
    Decoder,
    Mode,
    Prefiller,
    PrefixRouting,
    ProxyConfig,
    parse_decoder,
    parse_prefiller,
)
from p2pkv_vllm.proxy.prefix_probe import wait_until_cached
from p2pkv_vllm.proxy.prefix_routing import PrefixRouter
from p2pkv_vllm.proxy.prompt_tokens import PromptTokens
from proxy_kit import Kit
from test_kv_events import VLLMStylePublisher

BS = 4
P1, P2 = Prefiller("http://p1:1", "p1", 5710), Prefiller("http://p2:1", "p2", 5720, dp_size=2)
HOLDER = Decoder("http://d1:1", p2p_host="d1", p2p_port=6200)
PLAIN = Decoder("http://d2:1")


def router(
    scores: Mapping[str, int], delta: int = 8, decoders: tuple[Decoder, ...] = (HOLDER, PLAIN)
) -> PrefixRouter:
    config = ProxyConfig(
        prefillers=(P1, P2),
        decoders=decoders,
        policy="kv-indexer",
        prefix_routing=PrefixRouting(
            min_cached_tokens_delta=delta, indexer_url="http://ix:1", block_size=BS
        ),
    )

    async def matcher(tokens: Sequence[int], body: Mapping[str, Any]) -> dict[str, int]:
        return dict(scores)

    async def no_post(url: str, payload: Any) -> tuple[int, bytes]:
        return 0, b""

    return PrefixRouter(config, matcher, PromptTokens(no_post, ["http://tok:1"]))


def decide(r: PrefixRouter, prompt: Any = (1, 2, 3, 4)) -> Any:
    return asyncio.run(r.decide("/v1/completions", {"prompt": list(prompt)}))


def test_prefiller_with_longest_prefix_wins_and_no_source_when_it_holds_most() -> None:
    d = decide(router({"http://p2:1#dp1": 32, "http://d1:1#dp0": 24}))
    assert d.prefiller.upstream is P2 and d.prefiller.dp_rank == 1
    assert (d.source, d.matched_tokens, d.lookup) == (None, 32, "hit")


def test_source_named_when_it_leads_by_the_delta() -> None:
    r = router({"http://p1:1#dp0": 8, "http://d1:1#dp0": 16})
    d = decide(r)
    assert d.prefiller.upstream is P1 and d.decoder.upstream is HOLDER
    assert d.source is not None and (d.source.host, d.source.port) == ("d1", 6200)
    assert (d.matched_tokens, d.source_tokens) == (8, 16)
    assert decide(router({"http://p1:1#dp0": 8, "http://d1:1#dp0": 15})).source is None
    assert r.counters["with_source"] == 1 and r.counters["lookup_hit"] == 1


def test_ties_and_misses_go_round_robin_and_rank_ports_are_offset() -> None:
    r = router({})
    picks = [decide(r).prefiller for _ in range(3)]
    assert [(s.upstream.url, s.dp_rank) for s in picks] == [
        ("http://p1:1", 0),
        ("http://p2:1", 0),
        ("http://p2:1", 1),
    ]
    d = decide(router({"http://p2:1#dp1": 64}))
    assert d.prefiller.dp_rank == 1 and d.source is None  # the holder itself was chosen
    assert decide(router({"http://d2:1#dp0": 64})).source is None  # d2 has no p2p address


def test_no_token_ids_means_round_robin_without_lookup() -> None:
    d = asyncio.run(router({"http://d1:1#dp0": 64}).decide("/v1/completions", {"prompt": "text"}))
    assert (d.lookup, d.source) == ("no_tokens", None)


def test_specs_and_config_for_prefix_policies() -> None:
    p = parse_prefiller("http://h:8100,kv_events=tcp://h:5557,kv_replay=tcp://h:5558,dp_size=2")
    assert (p.kv_events, p.kv_replay, p.dp_size) == ("tcp://h:5557", "tcp://h:5558", 2)
    d = parse_decoder("http://d:8200,p2p_host=d,p2p_port=5800,kv_events=tcp://d:5557")
    assert (d.p2p_address, d.kv_events) == (("d", 5800), "tcp://d:5557")
    with pytest.raises(ConfigError, match="tcp://HOST:PORT"):
        parse_decoder("http://d:8200,kv_events=tcp://*:5557")
    with pytest.raises(ConfigError, match="needs kv_events"):
        ProxyConfig(prefillers=(P1,), decoders=(PLAIN,), policy="prefix-aware")
    with pytest.raises(ConfigError, match="indexer_url"):
        ProxyConfig(prefillers=(P1,), decoders=(PLAIN,), policy="kv-indexer")
    cfg = ProxyConfig.from_mapping(
        {
            "prefillers": [{"url": "http://h:1", "kv_events": "tcp://h:5557"}],
            "decoders": [{"url": "http://d:1"}],
            "policy": "prefix-aware",
            "prefix_routing": {"min_cached_tokens_delta": 0, "max_blocks_per_instance": 10},
        }
    )
    assert cfg.prefix_routing.min_cached_tokens_delta == 0
    with pytest.raises(ConfigError, match="unknown key"):
        ProxyConfig.from_mapping(
            {
                "prefillers": [{"url": "http://h:1"}],
                "decoders": [{"url": "http://d:1"}],
                "prefix_routing": {"min_delta": 1},
            }
        )


def test_indexer_client_speaks_rfc_1403_query() -> None:
    sent: list[tuple[str, Any]] = []
    answer = {
        "default": {
            "http://a:1": {"longest_matched": 64, "GPU": 32, "DP": {"0": 32, "1": 64}},
            "http://b:1": {"longest_matched": 16},
        }
    }

    async def post(url: str, payload: Any) -> tuple[int, bytes]:
        sent.append((url, payload))
        return 200, json.dumps(answer).encode()

    client = IndexerClient(post, "http://ix:9/", block_size=16)
    got = asyncio.run(
        client.match([1, 2], "m", {"http://a:1": 2, "http://b:1": 1, "http://c:1": 1})
    )
    assert got == {("http://a:1", 0): 32, ("http://a:1", 1): 64, ("http://b:1", 0): 16}
    assert sent == [
        (
            "http://ix:9/query",
            {"model": "m", "token_ids": [1, 2], "block_size": 16, "tenant_id": "default"},
        )
    ]

    async def broken(url: str, payload: Any) -> tuple[int, bytes]:
        return 200, b"[]"

    failing = IndexerClient(broken, "http://ix:9", block_size=16)
    assert asyncio.run(failing.match([1], "m", {"http://a:1": 1})) == {}
    assert failing.failures == 1


# -- end to end -----------------------------------------------------------------------------

PROMPT = list(range(100, 120))  # 5 blocks of 4


def holds(tokens: list[int], hashes: list[bytes | int], block_size: int = BS) -> KVEventBatch:
    return KVEventBatch(
        ts=0.0,
        events=[
            BlockStored(
                block_hashes=hashes,
                parent_block_hash=None,
                token_ids=tokens,
                block_size=block_size,
                lora_id=None,
                medium="GPU",
                lora_name=None,
            )
        ],
    )


@contextlib.asynccontextmanager
async def prefix_cluster(
    kit: type[Kit],
    pre: Any,
    dec: Any,
    pub_p: VLLMStylePublisher,
    pub_d: VLLMStylePublisher,
    mode: Mode = Mode.PREFILLER_FIRST,
) -> AsyncIterator[Any]:
    async with kit.serving(pre) as p_url, kit.serving(dec) as d_url:
        config = ProxyConfig(
            prefillers=(
                Prefiller(
                    p_url, "p-host", 6100, kv_events=pub_p.endpoint, kv_replay=pub_p.replay_endpoint
                ),
            ),
            decoders=(
                Decoder(
                    d_url,
                    kv_events=pub_d.endpoint,
                    kv_replay=pub_d.replay_endpoint,
                    p2p_host="d-host",
                    p2p_port=6200,
                ),
            ),
            mode=mode,
            policy="prefix-aware",
            prefix_routing=PrefixRouting(min_cached_tokens_delta=8),
        )
        app = ProxyApp(config)
        async with (
            kit.serving(app) as url,
            aiohttp.ClientSession(
                base_url=url, trust_env=False, timeout=aiohttp.ClientTimeout(total=30)
            ) as c,
        ):
            yield c, p_url, d_url, url


async def wait_indexed(
    client: aiohttp.ClientSession,
    pubs: list[VLLMStylePublisher],
    holder: str,
    tokens: int,
    timeout: float = 10.0,
) -> None:
    """Poll the match endpoint (the engine-test hook) until ``holder`` shows ``tokens``;
    publishes empty batches meanwhile so late subscribers notice and replay."""

    async def loop() -> None:
        while True:
            for pub in pubs:
                pub.publish(KVEventBatch(ts=0.0, events=[]))
            async with client.post("/prefix-index/match", json={"token_ids": PROMPT}) as r:
                if (await r.json())["matches"].get(holder, 0) >= tokens:
                    return
            await asyncio.sleep(0.02)

    await asyncio.wait_for(loop(), timeout)


@pytest.mark.parametrize("mode", [Mode.PREFILLER_FIRST, Mode.SYMMETRIC])
def test_proxy_routes_by_prefix_and_names_the_holder_as_source(
    kit: type[Kit], caplog: pytest.LogCaptureFixture, mode: Mode
) -> None:
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")
    pub_p, pub_d = VLLMStylePublisher(), VLLMStylePublisher()

    async def main() -> None:
        async with prefix_cluster(kit, pre, dec, pub_p, pub_d, mode) as (client, _, d_url, url):
            pub_d.publish(holds(PROMPT[:16], [11, 12, 13, 14]))
            await wait_indexed(client, [pub_p, pub_d], f"{d_url}#dp0", 16)
            matches = await asyncio.to_thread(
                wait_until_cached, url, f"{d_url}#dp0", 16, token_ids=PROMPT, timeout=5.0
            )
            assert matches[f"{d_url}#dp0"] == 16
            body = {"model": "m", "prompt": PROMPT, "max_tokens": 4}
            async with client.post("/v1/completions", json=body) as r:
                assert r.status == 200
            async with client.post("/v1/completions", json={**body, "prompt": [7] * 12}) as r:
                assert r.status == 200
            async with client.get("/prefix-index") as r:
                status = await r.json()
            async with client.get("/metrics") as r:
                assert r.content_type == "text/plain"
                metrics = await r.text()
        first, second = pre.generate_requests()
        kv_id = first.headers["x-request-id"]
        assert first.kv_params["remote_kv_source"] == {
            "kv_request_id": kv_id,
            "remote_host": "d-host",
            "remote_port": 6200,
        }
        assert ("remote_decoder" in first.kv_params) is (mode is Mode.PREFILLER_FIRST)
        assert second.kv_params is None or "remote_kv_source" not in second.kv_params
        records = [asdict(r.p2pkv_access) for r in caplog.records if hasattr(r, "p2pkv_access")]
        assert [
            (x["source"], x["source_tokens"], x["matched_tokens"], x["prefix_lookup"])
            for x in records
        ] == [(f"{d_url}#dp0", 16, 0, "hit"), ("", 0, 0, "miss")]
        assert status["decisions"]["with_source"] == 1
        assert status["instances"][f"{d_url}#dp0"]["blocks"] == 4
        samples = dict(
            line.rsplit(" ", 1) for line in metrics.splitlines() if not line.startswith("#")
        )
        assert samples["p2pkv_proxy_prefix_decisions_total"] == "2"
        assert samples["p2pkv_proxy_prefix_decisions_with_source_total"] == "1"
        assert samples['p2pkv_proxy_prefix_lookups_total{outcome="hit"}'] == "1"
        assert samples['p2pkv_proxy_prefix_lookups_total{outcome="miss"}'] == "1"
        assert samples["p2pkv_proxy_prefix_source_tokens_total"] == "16"

    try:
        kit.run(main)
    finally:
        pub_p.close()
        pub_d.close()


def test_proxy_tokenizes_text_prompts_and_reports_refused_instances(kit: type[Kit]) -> None:
    async def with_tokenize(fake: Any, seen: Any, send: Any) -> None:
        if seen.path == "/tokenize":
            await kit.send_json(
                send, 200, {"tokens": PROMPT, "count": len(PROMPT), "max_model_len": 64}
            )
        else:
            await kit.reply(fake, seen, send)

    pre, dec = kit.FakeVLLM("pre", with_tokenize), kit.FakeVLLM("dec", with_tokenize)
    pub_p, pub_d = VLLMStylePublisher(), VLLMStylePublisher()

    async def main() -> None:
        async with prefix_cluster(kit, pre, dec, pub_p, pub_d) as (client, p_url, d_url, _):
            pub_d.publish(holds(PROMPT[:16], [11, 12, 13, 14]))
            await wait_indexed(client, [pub_p, pub_d], f"{d_url}#dp0", 16)
            pub_p.publish(holds(PROMPT[:8], [21], block_size=8))  # disagrees: refused

            async def refused() -> dict[str, Any]:
                while True:
                    pub_p.publish(KVEventBatch(ts=0.0, events=[]))
                    async with client.get("/ready") as r:
                        body: dict[str, Any] = await r.json()
                    if body.get("prefix_index_refused"):
                        return body
                    await asyncio.sleep(0.02)

            ready = await asyncio.wait_for(refused(), 10.0)
            assert "block_size 8" in ready["prefix_index_refused"][f"{p_url}#dp0"]
            async with client.post(
                "/v1/completions", json={"model": "m", "prompt": "a text prompt"}
            ) as r:
                assert r.status == 200
        [tok] = [s for s in (*pre.seen, *dec.seen) if s.path == "/tokenize"]
        assert tok.body == {"model": "m", "prompt": "a text prompt"}
        [leg] = pre.generate_requests()
        assert leg.kv_params["remote_kv_source"]["remote_host"] == "d-host"

    try:
        kit.run(main)
    finally:
        pub_p.close()
        pub_d.close()


def test_prefix_flags_overlay_the_config_files_table(tmp_path: Any) -> None:
    import argparse

    from p2pkv_vllm.cli_plugin import config_from_args, p2pkv_cli_commands

    cfg = tmp_path / "proxy.toml"
    cfg.write_text("[prefix_routing]\nmin_cached_tokens_delta = 64\nlookup_timeout = 0.5\n")
    parser = argparse.ArgumentParser()
    p2pkv_cli_commands(parser.add_subparsers())
    args = parser.parse_args(
        [
            "proxy",
            "--config",
            str(cfg),
            "--prefiller",
            "http://a:1,kv_events=tcp://127.0.0.1:5557",
            "--decoder",
            "http://b:2",
            "--policy",
            "prefix-aware",
            "--min-cached-tokens-delta",
            "512",
        ]
    )
    routing = config_from_args(args).prefix_routing
    assert routing.min_cached_tokens_delta == 512 and routing.lookup_timeout == 0.5
