"""Warm pairs: which pairs the proxy pre-connects, and the two legs of each warm-up, against
fake vLLM servers on loopback (the real proxy app over HTTP)."""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

import aiohttp
import pytest
from p2pkv.errors import ConfigError
from p2pkv_vllm.cli_plugin import config_from_args, p2pkv_cli_commands
from p2pkv_vllm.proxy.app import ProxyApp
from p2pkv_vllm.proxy.config import Decoder, Prefiller, ProxyConfig
from p2pkv_vllm.proxy.warm_pairs import PROMPT_TOKENS, pairs
from proxy_kit import Kit

P1, P2 = Prefiller("http://p1:1", "p1", 5710), Prefiller("http://p2:1", "p2", 5720, dp_size=2)
HOLDER = Decoder("http://d1:1", p2p_host="d1", p2p_port=6200, kv_events="tcp://d1:5557")
PLAIN = Decoder("http://d2:1")


def names(config: ProxyConfig) -> list[str]:
    return [p.name for p in pairs(config)]


def test_pd_pairs_every_decoder_with_every_prefiller_rank() -> None:
    config = ProxyConfig(prefillers=(P1, P2), decoders=(PLAIN,))
    assert names(config) == [
        "http://d2:1#dp0 <- http://p1:1#dp0",
        "http://d2:1#dp0 <- http://p2:1#dp0",
        "http://d2:1#dp0 <- http://p2:1#dp1",
    ]
    assert [p.peer.port for p in pairs(config)] == [5710, 5720, 5721]


def test_prefix_policies_add_prefiller_pairs_and_each_two_slots_are_warmed_once() -> None:
    p3 = Prefiller("http://p3:1", "p3", 5730)
    config = ProxyConfig(prefillers=(P1, p3), decoders=(HOLDER, PLAIN), policy="prefix-aware")
    assert names(config) == [
        "http://d1:1#dp0 <- http://p1:1#dp0",
        "http://d1:1#dp0 <- http://p3:1#dp0",
        "http://d2:1#dp0 <- http://p1:1#dp0",
        "http://d2:1#dp0 <- http://p3:1#dp0",
        "http://p1:1#dp0 <- http://p3:1#dp0",
    ]  # one session both ways


async def warm_status(client: aiohttp.ClientSession, timeout: float = 10.0) -> Any:
    """``/ready``'s ``warm_pairs`` once no pair is pending (bounded)."""

    async def loop() -> Any:
        while True:
            async with client.get("/ready") as resp:
                status = (await resp.json())["warm_pairs"]
            if all(s["state"] != "pending" for s in status.values()):
                return status
            await asyncio.sleep(0.02)

    return await asyncio.wait_for(loop(), timeout)


def run_warm_up(kit: type[Kit], consumer_behavior: Any) -> tuple[Any, Any, Any]:
    """A proxy with ``warm_pairs`` over one prefiller and one decoder; returns the warm-up
    status and what the two fakes saw."""
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec", consumer_behavior)

    async def main() -> Any:
        async with kit.serving(pre) as p_url, kit.serving(dec) as d_url:
            config = ProxyConfig(
                prefillers=(Prefiller(p_url, "127.0.0.1", 5710),),
                decoders=(Decoder(d_url),),
                warm_pairs=True,
            )
            async with (
                kit.serving(ProxyApp(config)) as url,
                aiohttp.ClientSession(
                    base_url=url, trust_env=False, timeout=aiohttp.ClientTimeout(total=10)
                ) as client,
            ):
                return await warm_status(client)

    return kit.run(main), pre.generate_requests(), dec.generate_requests()


def test_a_warm_up_is_one_tiny_pd_request_naming_the_producer(kit: type[Kit]) -> None:
    status, (prefill,), (decode,) = run_warm_up(kit, kit.reply)
    (state,) = status.values()
    assert state["state"] == "warm" and state["ms"] > 0
    kv_id = prefill.kv_params["remote_decoder"]["kv_request_id"]
    assert decode.kv_params == {
        "remote_prefiller": {
            "kv_request_id": kv_id,
            "remote_host": "127.0.0.1",
            "remote_port": 5710,
        }
    }
    for leg in (prefill, decode):
        assert leg.body["model"] == "pre" and leg.body["max_tokens"] == 1
        assert leg.body["prompt"] == prefill.body["prompt"]
        assert leg.headers["x-request-id"] == kv_id
    assert len(prefill.body["prompt"]) == PROMPT_TOKENS


def test_a_failed_warm_up_is_reported_not_retried(kit: type[Kit]) -> None:
    refuse = kit.status(500, "no tier")

    async def behave(fake: Any, seen: Any, send: Any) -> None:
        await (refuse if seen.path == "/v1/completions" else kit.reply)(fake, seen, send)

    status, _, decodes = run_warm_up(kit, behave)
    (state,) = status.values()
    assert state["state"] == "failed" and "answered 500" in state["reason"]
    assert len(decodes) == 1


def test_warm_pairs_flag() -> None:
    parser = argparse.ArgumentParser()
    p2pkv_cli_commands(parser.add_subparsers())
    base = ["proxy", "--prefiller", "http://p1:1", "--decoder", "http://d1:1"]
    assert config_from_args(parser.parse_args([*base, "--warm-pairs"])).warm_pairs is True
    assert config_from_args(parser.parse_args(base)).warm_pairs is False


def test_warm_pairs_config_keys() -> None:
    raw = {"prefillers": [{"url": "http://p1:1"}], "decoders": [{"url": "http://d1:1"}]}
    config = ProxyConfig.from_mapping({**raw, "warm_pairs": True, "warm_pairs_wait": 30})
    assert (config.warm_pairs, config.warm_pairs_wait) == (True, 30.0)
    for bad in ({"warm_pairs": "yes"}, {"warm_pairs_wait": 0}):
        with pytest.raises(ConfigError, match="warm_pairs"):
            ProxyConfig.from_mapping({**raw, **bad})
