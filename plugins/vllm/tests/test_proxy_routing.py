"""The proxy end to end: real uvicorn servers on loopback, fake vLLM prefillers and decoders.

Each test asserts what the upstreams received (bodies, ``kv_transfer_params``, headers) and
what the client got back, byte for byte where it matters.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import signal
import sys
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, replace
from typing import Any

import aiohttp
import pytest
from p2pkv_vllm.proxy.app import ACCESS_LOGGER, ProxyApp
from p2pkv_vllm.proxy.config import (
    Decoder,
    Mode,
    Prefiller,
    PrefillFailure,
    ProxyConfig,
    ProxyTimeouts,
)
from proxy_kit import Kit

COMPLETION = {
    "model": "m",
    "prompt": "The capital of France is",
    "max_tokens": 16,
    "temperature": 0,
}
CHAT = {
    "model": "m",
    "messages": [{"role": "user", "content": "hi"}],
    "max_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
}
AUTH = {"Authorization": "Bearer sk-test", "Cookie": "session=secret"}


@dataclass(frozen=True)
class Resp:
    status: int
    headers: Any
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


async def fetch(client: aiohttp.ClientSession, method: str, path: str, **kwargs: Any) -> Resp:
    async with client.request(method, path, **kwargs) as r:
        return Resp(r.status, r.headers, await r.read())


@contextlib.asynccontextmanager
async def proxy_for(kit: type[Kit], config: ProxyConfig) -> AsyncIterator[aiohttp.ClientSession]:
    """Serve a ProxyApp for ``config``; yields a client session pointed at it."""
    app = ProxyApp(config)
    async with (
        kit.serving(app) as url,
        aiohttp.ClientSession(
            base_url=url,
            trust_env=False,
            timeout=aiohttp.ClientTimeout(total=30),
            connector=aiohttp.TCPConnector(limit=400),
        ) as client,
    ):
        yield client


@contextlib.asynccontextmanager
async def cluster(
    kit: type[Kit],
    *,
    prefillers: list[Any],
    decoders: list[Any],
    p2p: list[tuple[int, int]] | None = None,
    decoder_dp: list[int] | None = None,
    **overrides: Any,
) -> AsyncIterator[aiohttp.ClientSession]:
    """Serve the fakes and a proxy in front of them.

    ``p2p[i]`` is (base port, DP size) of prefiller ``i``; ``decoder_dp[i]`` the DP size of
    decoder ``i``.
    """
    async with contextlib.AsyncExitStack() as stack:
        p_urls = [await stack.enter_async_context(kit.serving(f)) for f in prefillers]
        d_urls = [await stack.enter_async_context(kit.serving(f)) for f in decoders]
        p2p = p2p or [(5710, 1)] * len(p_urls)
        decoder_dp = decoder_dp or [1] * len(d_urls)
        config = ProxyConfig(
            prefillers=tuple(
                Prefiller(u, f"p2p-host-{i}", port, dp)
                for i, (u, (port, dp)) in enumerate(zip(p_urls, p2p, strict=True))
            ),
            decoders=tuple(Decoder(u, dp) for u, dp in zip(d_urls, decoder_dp, strict=True)),
            **overrides,
        )
        yield await stack.enter_async_context(proxy_for(kit, config))


@pytest.fixture
def access(caplog: pytest.LogCaptureFixture) -> Callable[[], list[dict[str, Any]]]:
    """Returns the proxy's access-log records so far (their ``p2pkv_access`` payload)."""
    caplog.set_level(logging.INFO, logger=ACCESS_LOGGER)
    return lambda: [asdict(r.p2pkv_access) for r in caplog.records if hasattr(r, "p2pkv_access")]


# -- the legs -------------------------------------------------------------------------------


def test_prefiller_first_legs_carry_exactly_the_right_params_and_headers(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], p2p=[(6100, 1)]) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION, headers=AUTH)
        assert r.status == 200
        assert r.json()["id"] == "dec"
        [p], [d] = pre.generate_requests(), dec.generate_requests()
        kv_id = p.kv_params["remote_decoder"]["kv_request_id"]
        assert r.headers["x-kv-request-id"] == kv_id
        assert p.path == d.path == "/v1/completions"
        assert p.body == {
            "model": "m",
            "prompt": "The capital of France is",
            "max_tokens": 1,
            "temperature": 0,
            "stream": False,
            "kv_transfer_params": {"remote_decoder": {"kv_request_id": kv_id}},
        }
        assert d.body == {
            **COMPLETION,
            "kv_transfer_params": {
                "remote_prefiller": {
                    "kv_request_id": kv_id,
                    "remote_host": "p2p-host-0",
                    "remote_port": 6100,
                }
            },
        }
        for leg in (p, d):
            assert leg.headers["authorization"] == "Bearer sk-test"
            assert "cookie" not in leg.headers
            assert leg.headers["x-data-parallel-rank"] == "0"
            assert leg.headers["x-request-id"] == kv_id

    kit.run(main)
    [rec] = access()
    assert rec["outcome"] == "ok" and rec["status"] == 200 and rec["prefill"] == "ok"
    assert rec["kv_request_id"].startswith("p2pkv-")


def test_every_request_gets_a_fresh_kv_request_id(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec]) as client:
            for _ in range(5):
                assert (
                    await fetch(client, "POST", "/v1/completions", json=COMPLETION)
                ).status == 200
        ids = [s.kv_params["remote_decoder"]["kv_request_id"] for s in pre.generate_requests()]
        assert len(set(ids)) == 5
        assert ids == [
            s.kv_params["remote_prefiller"]["kv_request_id"] for s in dec.generate_requests()
        ]

    kit.run(main)


def test_dp_round_robin_and_port_offsets(kit: type[Kit]) -> None:
    pa, pb = kit.FakeVLLM("pa"), kit.FakeVLLM("pb")
    dc = kit.FakeVLLM("dc")

    async def main() -> None:
        async with cluster(
            kit, prefillers=[pa, pb], decoders=[dc], p2p=[(6000, 2), (7000, 1)], decoder_dp=[3]
        ) as client:
            for _ in range(6):
                assert (
                    await fetch(client, "POST", "/v1/completions", json=COMPLETION)
                ).status == 200
        decodes = dc.generate_requests()
        route = [
            (
                d.kv_params["remote_prefiller"]["remote_host"],
                d.kv_params["remote_prefiller"]["remote_port"],
            )
            for d in decodes
        ]
        assert route == [("p2p-host-0", 6000), ("p2p-host-1", 7000), ("p2p-host-0", 6001)] * 2
        assert [d.headers["x-data-parallel-rank"] for d in decodes] == ["0", "1", "2"] * 2
        assert [p.headers["x-data-parallel-rank"] for p in pa.generate_requests()] == [
            "0",
            "1",
            "0",
            "1",
        ]
        assert [p.headers["x-data-parallel-rank"] for p in pb.generate_requests()] == ["0", "0"]
        # The decoder is told the port of the very replica that ran the prefill.
        by_id = {
            p.kv_params["remote_decoder"]["kv_request_id"]: (p, base)
            for f, base in ((pa, 6000), (pb, 7000))
            for p in f.generate_requests()
        }
        for d in decodes:
            src = d.kv_params["remote_prefiller"]
            p, base = by_id[src["kv_request_id"]]
            assert src["remote_port"] == base + int(p.headers["x-data-parallel-rank"])

    kit.run(main)


def test_decoder_first_starts_the_decode_leg_before_the_prefill_finishes(kit: type[Kit]) -> None:
    dec = kit.FakeVLLM("dec")

    async def prefill_after_decode_arrived(fake: Any, seen: Any, send: Any) -> None:
        kv_id = seen.kv_params["remote_decoder"]["kv_request_id"]
        await dec.wait_for(
            lambda: any(
                d.kv_params["remote_prefiller"]["kv_request_id"] == kv_id
                for d in dec.generate_requests()
            ),
            "the decode leg of the same request",
        )
        await kit.reply(fake, seen, send)

    pre = kit.FakeVLLM("pre", prefill_after_decode_arrived)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], mode=Mode.DECODER_FIRST) as c:
            r = await fetch(c, "POST", "/v1/completions", json=COMPLETION)
        assert r.status == 200 and r.json()["id"] == "dec"
        [p], [d] = pre.generate_requests(), dec.generate_requests()
        assert p.kv_params == {"remote_decoder": {"kv_request_id": r.headers["x-kv-request-id"]}}
        assert d.kv_params["remote_prefiller"]["kv_request_id"] == r.headers["x-kv-request-id"]

    kit.run(main)


def test_symmetric_mode_probes_the_prefillers_cache(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(
            kit, prefillers=[pre], decoders=[dec], p2p=[(6200, 2)], mode=Mode.SYMMETRIC
        ) as client:
            for _ in range(2):
                assert (
                    await fetch(client, "POST", "/v1/completions", json=COMPLETION)
                ).status == 200
        assert [p.kv_params for p in pre.generate_requests()] == [None, None]
        params = [d.kv_params for d in dec.generate_requests()]
        assert [list(p) for p in params] == [["remote_kv_source"]] * 2
        assert [p["remote_kv_source"]["remote_port"] for p in params] == [6200, 6201]

    kit.run(main)


def test_models_and_health(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec]) as client:
            models = await fetch(client, "GET", "/v1/models", headers=AUTH)
            health = await fetch(client, "GET", "/health")
            missing = await fetch(client, "GET", "/v1/embeddings")
            wrong = await fetch(client, "GET", "/v1/completions")
            bad = await fetch(client, "POST", "/v1/completions", data=b"[1, 2]")
        assert models.status == 200 and models.json()["data"] == [{"id": "dec"}]
        [m] = [s for s in dec.seen if s.path == "/v1/models"]
        assert m.headers["authorization"] == "Bearer sk-test"
        assert health.status == 200 and health.json()["status"] == "ok"
        assert missing.status == 404
        assert wrong.status == 405
        assert bad.status == 400 and "JSON object" in bad.json()["error"]["message"]
        assert not pre.generate_requests() and not dec.generate_requests()

    kit.run(main)


# -- streaming ------------------------------------------------------------------------------


def test_streaming_relay_is_byte_exact(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")
    # Awkward boundaries: an event split mid-line, a multi-byte character split in two.
    text = 'data: {"text": "h\u00e9llo \u4e16\u754c"}\n\n'.encode()
    dec.stream_chunks = [
        b'data: {"text": "a"}\n',
        b"\n",
        text[:20],
        text[20:21],
        text[21:],
        b"data: [DONE]\n\n",
    ]

    async def main() -> None:
        async with (
            cluster(kit, prefillers=[pre], decoders=[dec]) as client,
            client.post("/v1/chat/completions", json=CHAT) as r,
        ):
            assert r.status == 200
            assert r.headers["content-type"].startswith("text/event-stream")
            body = b"".join([chunk async for chunk in r.content.iter_any()])
        assert body == b"".join(dec.stream_chunks)
        [p] = pre.generate_requests()
        assert p.body["stream"] is False and "stream_options" not in p.body
        [d] = dec.generate_requests()
        assert d.body["stream"] is True and d.body["stream_options"] == {"include_usage": True}

    kit.run(main)


def test_stream_is_relayed_chunk_by_chunk_not_buffered(kit: type[Kit]) -> None:
    pre = kit.FakeVLLM("pre")
    second_chunk_allowed = asyncio.Event()

    async def two_phase(fake: Any, seen: Any, send: Any) -> None:
        await kit.start_stream(send, b"data: first\n\n")
        await asyncio.wait_for(second_chunk_allowed.wait(), 10)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n"})

    dec = kit.FakeVLLM("dec", two_phase)

    async def main() -> None:
        async with (
            cluster(kit, prefillers=[pre], decoders=[dec]) as client,
            client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r,
        ):
            chunks = r.content.iter_any()
            first = await asyncio.wait_for(chunks.__anext__(), 10)
            assert first == b"data: first\n\n"  # arrived while the upstream still streams
            second_chunk_allowed.set()
            rest = b"".join([c async for c in chunks])
        assert rest == b"data: [DONE]\n\n"

    kit.run(main)


def test_200_concurrent_requests(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pres = [kit.FakeVLLM("p0"), kit.FakeVLLM("p1")]
    decs = [kit.FakeVLLM("d0"), kit.FakeVLLM("d1")]

    async def main() -> None:
        async with cluster(
            kit, prefillers=pres, decoders=decs, p2p=[(6000, 2), (7000, 2)], decoder_dp=[2, 2]
        ) as client:

            async def one(i: int) -> tuple[int, bytes, str]:
                body = {**COMPLETION, "stream": i % 2 == 0}
                async with client.post("/v1/completions", json=body) as r:
                    data = b"".join([c async for c in r.content.iter_any()])
                return r.status, data, r.headers["x-kv-request-id"]

            results = await asyncio.gather(*(one(i) for i in range(200)))
        assert [status for status, _, _ in results] == [200] * 200
        ids = [kv for _, _, kv in results]
        assert len(set(ids)) == 200
        for i, (_, data, _) in enumerate(results):
            if i % 2 == 0:
                assert data.endswith(b"data: [DONE]\n\n")
        pre_ids = {
            s.kv_params["remote_decoder"]["kv_request_id"]
            for f in pres
            for s in f.generate_requests()
        }
        dec_ids = {
            s.kv_params["remote_prefiller"]["kv_request_id"]
            for f in decs
            for s in f.generate_requests()
        }
        assert pre_ids == dec_ids == set(ids)
        assert [len(f.generate_requests()) for f in (*pres, *decs)] == [100, 100, 100, 100]

    kit.run(main)
    assert len(access()) == 200


# -- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", [Mode.PREFILLER_FIRST, Mode.DECODER_FIRST])
def test_prefill_error_then_decoder_recomputes(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]], mode: Mode
) -> None:
    pre = kit.FakeVLLM("pre", kit.status(500))

    async def decode_or_wait_for_cancel(fake: Any, seen: Any, send: Any) -> None:
        if seen.kv_params is None:
            await kit.reply(fake, seen, send)
        else:  # the remote-KV attempt (decoder-first): blocks until the proxy cancels it
            await kit.hang(fake, seen, send)

    dec = kit.FakeVLLM("dec", decode_or_wait_for_cancel)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], mode=mode) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        assert r.status == 200 and r.json()["id"] == "dec"
        decodes = dec.generate_requests()
        assert decodes[-1].body == COMPLETION  # no remote KV: the decoder computes the prompt
        if mode is Mode.DECODER_FIRST:
            first, _ = decodes
            assert "remote_prefiller" in first.kv_params
            await dec.wait_for(first.disconnected.is_set, "the cancelled remote-KV decode leg")
        else:
            assert len(decodes) == 1

    kit.run(main)
    [rec] = access()
    assert rec["outcome"] == "recomputed" and rec["prefill"] == "failed: status 500"


@pytest.mark.parametrize("mode", [Mode.PREFILLER_FIRST, Mode.DECODER_FIRST])
def test_prefill_error_with_fail_policy_is_a_502_naming_the_prefiller(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]], mode: Mode
) -> None:
    pre = kit.FakeVLLM("pre", kit.status(503))
    dec = kit.FakeVLLM("dec", kit.hang)

    async def main() -> None:
        async with cluster(
            kit, prefillers=[pre], decoders=[dec], mode=mode, on_prefill_failure=PrefillFailure.FAIL
        ) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
            err = r.json()["error"]
            assert r.status == 502
            assert err["upstream"].startswith("http://127.0.0.1:")
            assert f"prefiller {err['upstream']} (dp rank 0) failed: status 503" == err["message"]
            assert err["kv_request_id"] == r.headers["x-kv-request-id"]
        for d in dec.generate_requests():  # decoder-first: its leg was cancelled
            assert d.disconnected.is_set()

    kit.run(main)
    assert access()[0]["outcome"] == "prefill_failed"


def test_prefill_client_error_is_relayed_under_fail_policy(kit: type[Kit]) -> None:
    pre = kit.FakeVLLM("pre", kit.status(400, "prompt too long"))
    dec = kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(
            kit, prefillers=[pre], decoders=[dec], on_prefill_failure=PrefillFailure.FAIL
        ) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        assert r.status == 400
        assert r.json()["error"]["message"] == "prompt too long"
        assert not dec.generate_requests()

    kit.run(main)


@pytest.mark.parametrize("policy", [PrefillFailure.RECOMPUTE, PrefillFailure.FAIL])
def test_prefill_timeout_cancels_the_leg(kit: type[Kit], policy: PrefillFailure) -> None:
    pre, dec = kit.FakeVLLM("pre", kit.hang), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(
            kit,
            prefillers=[pre],
            decoders=[dec],
            on_prefill_failure=policy,
            timeouts=ProxyTimeouts(prefill=0.3),
        ) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        [p] = pre.generate_requests()
        await pre.wait_for(p.disconnected.is_set, "the timed-out prefill leg to be closed")
        if policy is PrefillFailure.RECOMPUTE:
            assert r.status == 200 and dec.generate_requests()[0].kv_params is None
        else:
            assert r.status == 502 and "timeout after 0.3s" in r.json()["error"]["message"]
            assert not dec.generate_requests()

    kit.run(main)


@pytest.mark.parametrize("policy", [PrefillFailure.RECOMPUTE, PrefillFailure.FAIL])
def test_unreachable_prefiller(kit: type[Kit], policy: PrefillFailure) -> None:
    dec = kit.FakeVLLM("dec")
    dead_url, held = kit.refused_url()

    async def main() -> None:
        async with kit.serving(dec) as d_url:
            config = ProxyConfig(
                prefillers=(Prefiller(dead_url, "h"),),
                decoders=(Decoder(d_url),),
                on_prefill_failure=policy,
            )
            async with proxy_for(kit, config) as client:
                r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        if policy is PrefillFailure.RECOMPUTE:
            assert r.status == 200 and dec.generate_requests()[0].kv_params is None
        else:
            assert r.status == 502
            assert r.json()["error"]["upstream"] == dead_url
            assert "unreachable" in r.json()["error"]["message"]

    try:
        kit.run(main)
    finally:
        held.close()


def test_unreachable_decoder_is_a_502_naming_it(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pre = kit.FakeVLLM("pre")
    dead_url, held = kit.refused_url()

    async def main() -> None:
        async with kit.serving(pre) as p_url:
            config = ProxyConfig(prefillers=(Prefiller(p_url, "h"),), decoders=(Decoder(dead_url),))
            async with proxy_for(kit, config) as client:
                r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        assert r.status == 502
        err = r.json()["error"]
        assert err["upstream"] == dead_url
        assert err["message"].startswith(f"decoder {dead_url} unreachable")

    try:
        kit.run(main)
    finally:
        held.close()
    assert access()[0]["outcome"] == "decoder_unreachable"


def test_silent_decoder_is_a_504(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec", kit.hang)

    async def main() -> None:
        async with cluster(
            kit, prefillers=[pre], decoders=[dec], timeouts=ProxyTimeouts(decode=0.3)
        ) as client:
            r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
        assert r.status == 504
        assert "sent no response in 0.3s" in r.json()["error"]["message"]
        [d] = dec.generate_requests()
        await dec.wait_for(d.disconnected.is_set, "the abandoned decode leg to be closed")

    kit.run(main)


def test_decoder_stream_breaking_midway_drops_the_client_connection(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pre = kit.FakeVLLM("pre")

    async def break_after_one(fake: Any, seen: Any, send: Any) -> None:
        await kit.start_stream(send, b"data: one\n\n")
        # returning without finishing makes uvicorn drop the connection mid-body

    dec = kit.FakeVLLM("dec", break_after_one)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec]) as client:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r:
                    async for _ in r.content.iter_any():
                        pass

    kit.run(main)
    assert access()[0]["outcome"] == "decode_stream_error"


@pytest.mark.parametrize("mode", [Mode.PREFILLER_FIRST, Mode.DECODER_FIRST])
def test_client_disconnect_during_prefill_cancels_both_legs(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]], mode: Mode
) -> None:
    pre = kit.FakeVLLM("pre", kit.hang)
    dec = kit.FakeVLLM("dec", kit.hang)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], mode=mode) as client:
            request = asyncio.ensure_future(
                fetch(client, "POST", "/v1/completions", json=COMPLETION)
            )
            [p] = await pre.wait_for(pre.generate_requests, "the prefill leg")
            if mode is Mode.DECODER_FIRST:
                await dec.wait_for(dec.generate_requests, "the decode leg")
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
            await pre.wait_for(p.disconnected.is_set, "the prefill leg to be cancelled")
            for d in dec.generate_requests():
                await dec.wait_for(d.disconnected.is_set, "the decode leg to be cancelled")
            if mode is Mode.PREFILLER_FIRST:
                assert not dec.generate_requests()
            await pre.wait_for(lambda: len(access()) == 1, "the access-log record")

    kit.run(main)
    assert access()[0]["outcome"] == "client_disconnected"


def test_client_disconnect_mid_stream_cancels_the_decode_leg(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pre = kit.FakeVLLM("pre")

    async def stream_forever(fake: Any, seen: Any, send: Any) -> None:
        await kit.start_stream(send, b"data: one\n\n")
        await kit.hang(fake, seen, send)

    dec = kit.FakeVLLM("dec", stream_forever)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec]) as client:
            async with client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r:
                assert await r.content.iter_any().__anext__() == b"data: one\n\n"
                r.close()  # the client goes away mid-stream
            # leaving the block unread closes the client's connection
            [d] = dec.generate_requests()
            await dec.wait_for(d.disconnected.is_set, "the decode leg to be cancelled")
            await dec.wait_for(lambda: len(access()) == 1, "the access-log record")

    kit.run(main)
    rec = access()[0]
    assert rec["outcome"] == "client_disconnected" and rec["bytes"] == len(b"data: one\n\n")


def test_request_deadline_bounds_everything(
    kit: type[Kit], access: Callable[[], list[dict[str, Any]]]
) -> None:
    pre = kit.FakeVLLM("pre")

    async def headers_then_silence(fake: Any, seen: Any, send: Any) -> None:
        await kit.start_stream(send)
        await kit.hang(fake, seen, send)

    dec = kit.FakeVLLM("dec", headers_then_silence)
    timeouts = ProxyTimeouts(connect=0.2, prefill=0.2, decode=0.2, idle=30)

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], timeouts=timeouts) as client:
            with pytest.raises(aiohttp.ClientPayloadError):
                async with client.post("/v1/completions", json={**COMPLETION, "stream": True}) as r:
                    async for _ in r.content.iter_any():
                        pass
            [d] = dec.generate_requests()
            await dec.wait_for(d.disconnected.is_set, "the decode leg to be cancelled")

    kit.run(main)
    assert access()[0]["outcome"] == "deadline"


def test_oversized_body_is_refused(kit: type[Kit]) -> None:
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(kit, prefillers=[pre], decoders=[dec], max_body_bytes=1000) as client:
            r = await fetch(
                client, "POST", "/v1/completions", json={**COMPLETION, "prompt": "x" * 2000}
            )
        assert r.status == 413
        assert not pre.generate_requests()

    kit.run(main)


def test_least_inflight_policy_end_to_end(kit: type[Kit]) -> None:
    pres = [kit.FakeVLLM("p0"), kit.FakeVLLM("p1")]
    dec = kit.FakeVLLM("dec")

    async def main() -> None:
        async with cluster(kit, prefillers=pres, decoders=[dec], policy="least-inflight") as c:
            for _ in range(4):
                assert (await fetch(c, "POST", "/v1/completions", json=COMPLETION)).status == 200
        assert [len(p.generate_requests()) for p in pres] == [2, 2]

    kit.run(main)


def test_config_replace_keeps_validation() -> None:
    cfg = ProxyConfig(prefillers=(Prefiller("http://p:1", "p"),), decoders=(Decoder("http://d:1"),))
    with pytest.raises(ValueError, match="no decoder"):
        replace(cfg, decoders=())


def test_p2pkv_proxy_command_end_to_end(kit: type[Kit]) -> None:
    """The installed ``p2pkv proxy`` (plugin hook -> CLI -> uvicorn) routes a request and
    writes its access log; SIGTERM stops it."""
    pre, dec = kit.FakeVLLM("pre"), kit.FakeVLLM("dec")

    async def main() -> None:
        async with kit.serving(pre) as p_url, kit.serving(dec) as d_url:
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "p2pkv.cli",
                "--log-level",
                "INFO",
                "proxy",
                "--port",
                "0",
                "--prefiller",
                f"{p_url},p2p_port=6300,dp_size=2",
                "--decoder",
                d_url,
                stderr=asyncio.subprocess.PIPE,
            )
            assert proc.stderr is not None
            try:
                line = await asyncio.wait_for(proc.stderr.readline(), 30)
                match = re.search(rb"listening on (http://\S+)", line)
                assert match, line
                async with aiohttp.ClientSession(base_url=match.group(1).decode()) as client:
                    r = await fetch(client, "POST", "/v1/completions", json=COMPLETION)
                assert r.status == 200
                kv_id = r.headers["x-kv-request-id"]
                while True:
                    line = await asyncio.wait_for(proc.stderr.readline(), 30)
                    assert line, "the proxy exited before logging the request"
                    if line.startswith(b"{"):
                        break
                record = json.loads(line)
                assert record["kv_request_id"] == kv_id and record["status"] == 200
                assert dec.generate_requests()[0].kv_params["remote_prefiller"] == {
                    "kv_request_id": kv_id,
                    "remote_host": "127.0.0.1",
                    "remote_port": 6300,
                }
            finally:
                proc.terminate()
                rest = await asyncio.wait_for(proc.stderr.read(), 30)
                # uvicorn shuts down gracefully, then re-raises SIGTERM as the exit status
                assert await asyncio.wait_for(proc.wait(), 30) == -signal.SIGTERM
            assert b"Application shutdown complete" in rest

    kit.run(main)
