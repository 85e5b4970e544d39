"""The PD routing proxy as a plain ASGI application (served by uvicorn, see ``server``).

Per generate request: a fresh ``kv_request_id``; a prefill leg to a prefiller slot and a decode
leg to a decoder slot, ordered by the configured mode; the decode response is relayed to the
client chunk by chunk as raw bytes (no re-encoding, no buffering).

Failure contract:
- prefill leg fails (error status, timeout, unreachable): ``recompute`` runs the decode leg
  without remote KV; ``fail`` answers 502 naming the prefiller (a 4xx verdict is relayed);
- decoder unreachable: 502 naming it; no response headers within the decode timeout: 504;
- the upstream stream breaks after the response started: the client connection is dropped
  (a truncated body never looks complete);
- the client disconnects: the in-flight legs are cancelled, which closes their upstream
  connections so vLLM aborts those requests;
- every request is bounded by ``prefill + decode + connect`` seconds in all.

One access-log record (JSON, logger ``p2pkv.vllm.proxy.access``) per generate request; with a
prefix policy it names the ``source`` peer and the matched tokens (see ``prefix_routing``).
Threading: everything runs on one event loop, except the KV-event feed threads of the
``prefix-aware`` policy, which only write the (locked) prefix index.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp
from p2pkv.logs import module_logger

from p2pkv_vllm.indexer_client import IndexerClient
from p2pkv_vllm.prefix_index import PrefixIndex
from p2pkv_vllm.proxy import decision_metrics
from p2pkv_vllm.proxy.config import (
    PREFIX_POLICIES,
    Decoder,
    Mode,
    Prefiller,
    PrefillFailure,
    ProxyConfig,
)
from p2pkv_vllm.proxy.kv_feed import KVEventFeeds
from p2pkv_vllm.proxy.legs import (
    FORWARDED_HEADERS,
    consumer_params,
    decode_body,
    leg_headers,
    new_kv_request_id,
    prefill_body,
    producer_params,
    source_params,
    with_kv_source,
)
from p2pkv_vllm.proxy.prefix_routing import (
    PrefixDecision,
    PrefixRouter,
    indexer_matcher,
    local_matcher,
)
from p2pkv_vllm.proxy.prompt_tokens import PromptTokens
from p2pkv_vllm.proxy.selection import Slot, make_policy, slot_name, slots_of
from p2pkv_vllm.proxy.warm_pairs import PairWarmer

__all__ = ["ACCESS_LOGGER", "ProxyApp"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]

ACCESS_LOGGER = "p2pkv.vllm.proxy.access"
GENERATE_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
KV_REQUEST_ID_HEADER = b"x-kv-request-id"
_DROPPED_RESPONSE_HEADERS = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"date",
        b"server",
    }
)

log = module_logger(__name__)
access_log = logging.getLogger(ACCESS_LOGGER)


class _UpstreamError(Exception):
    """A leg failed before any byte reached the client; becomes a JSON error response."""

    def __init__(self, status: int, outcome: str, message: str, upstream: str) -> None:
        super().__init__(message)
        self.status = status
        self.outcome = outcome
        self.upstream = upstream


class _BodyTooLarge(Exception):
    pass


@dataclass(frozen=True)
class _Reply:
    """A fully read upstream response."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes


@dataclass
class _PrefillOutcome:
    ok: bool
    reason: str = ""
    reply: _Reply | None = None


@dataclass
class AccessRecord:
    """One line of the access log."""

    kv_request_id: str
    method: str
    path: str
    mode: str
    stream: bool = False
    prefiller: str = ""
    decoder: str = ""
    prefill: str = "skipped"
    prefill_ms: float = 0.0
    source: str = ""
    """The ``remote_kv_source`` peer the prefill leg was sent to pull from (prefix policies)."""
    matched_tokens: int = 0
    """Cached prefix tokens of the chosen prefiller, as the prefix lookup saw it."""
    source_tokens: int = 0
    prefix_lookup: str = ""
    """Prefix policies: ``hit``, ``miss``, ``no_tokens`` or ``timeout``; else empty."""
    status: int = 0
    bytes: int = 0
    outcome: str = "ok"
    duration_ms: float = 0.0
    started: float = field(default_factory=time.monotonic, repr=False)


class _Exchange:
    """The client side of one request: response start, body chunks, byte count."""

    def __init__(self, send: Send, record: AccessRecord) -> None:
        self._send = send
        self.record = record
        self.started = False

    async def start(self, status: int, headers: list[tuple[bytes, bytes]]) -> None:
        self.started = True
        self.record.status = status
        headers.append((KV_REQUEST_ID_HEADER, self.record.kv_request_id.encode()))
        await self._send({"type": "http.response.start", "status": status, "headers": headers})

    async def body(self, chunk: bytes) -> None:
        self.record.bytes += len(chunk)
        await self._send({"type": "http.response.body", "body": chunk, "more_body": True})

    async def end(self) -> None:
        await self._send({"type": "http.response.body", "body": b"", "more_body": False})

    async def reply(self, reply: _Reply) -> None:
        await self.start(reply.status, list(reply.headers))
        await self.body(reply.body)
        await self.end()

    async def json(self, status: int, payload: Any) -> None:
        await self._whole(status, json.dumps(payload).encode(), b"application/json")

    async def text(self, status: int, text: str) -> None:
        """A Prometheus text-format body (``GET /metrics``)."""
        await self._whole(status, text.encode(), b"text/plain; version=0.0.4; charset=utf-8")

    async def _whole(self, status: int, data: bytes, content_type: bytes) -> None:
        await self.start(
            status, [(b"content-type", content_type), (b"content-length", str(len(data)).encode())]
        )
        await self.body(data)
        await self.end()

    async def error(self, status: int, message: str, *, kind: str, upstream: str = "") -> None:
        err: dict[str, Any] = {
            "message": message,
            "type": kind,
            "code": status,
            "kv_request_id": self.record.kv_request_id,
        }
        if upstream:
            err["upstream"] = upstream
        await self.json(status, {"error": err})


@dataclass
class _Call:
    """One client request being routed: its ASGI scope, client side and parsed body."""

    scope: Scope
    exchange: _Exchange
    body: dict[str, Any]

    @property
    def record(self) -> AccessRecord:
        return self.exchange.record


class ProxyApp:
    """ASGI app routing OpenAI-compatible requests to prefillers and decoders.

    The pooled upstream client (aiohttp, up to ``max_connections`` connections) is created on
    first use, on the serving loop, and closed by the ASGI lifespan shutdown or :meth:`aclose`.
    Upstream bodies are relayed undecoded (no ``Accept-Encoding`` is sent upstream).
    """

    def __init__(self, config: ProxyConfig) -> None:
        self.config = config
        prefix = config.policy in PREFIX_POLICIES
        base = "round-robin" if prefix else config.policy
        self._prefillers = make_policy(base, slots_of(config.prefillers))
        self._decoders = make_policy(base, slots_of(config.decoders))
        self.prefix_index: PrefixIndex | None = None
        self._feeds: KVEventFeeds | None = None
        self.prefix_router = self._prefix_router() if prefix else None
        self._model_sources = itertools.cycle(config.decoders)
        self._session: aiohttp.ClientSession | None = None
        self.warmer = PairWarmer(config, self._call) if config.warm_pairs else None
        self._warming: asyncio.Future[None] | None = None
        t = config.timeouts
        self._deadline = t.prefill + t.decode + t.connect

    def _prefix_router(self) -> PrefixRouter:
        settings = self.config.prefix_routing
        upstreams: tuple[Prefiller | Decoder, ...] = (
            *self.config.prefillers,
            *self.config.decoders,
        )
        tokens = PromptTokens(self._post_json, [u.url for u in upstreams])
        if self.config.policy == "kv-indexer":
            assert settings.indexer_url is not None and settings.block_size is not None
            client = IndexerClient(
                self._post_json,
                settings.indexer_url,
                block_size=settings.block_size,
                tenant=settings.indexer_tenant,
            )
            return PrefixRouter(self.config, indexer_matcher(client, self.config), tokens)
        self.prefix_index = PrefixIndex(
            block_size=settings.block_size, max_blocks=settings.max_blocks_per_instance
        )
        self._feeds = KVEventFeeds(self.prefix_index, upstreams)
        return PrefixRouter(self.config, local_matcher(self.prefix_index), tokens)

    def start(self) -> None:
        """Start the KV-event feeds (``prefix-aware``) and the pair warm-up (``warm_pairs``,
        a background task); the ASGI lifespan startup calls it, on the serving loop."""
        if self._feeds is not None:
            self._feeds.start()
        if self.warmer is not None:
            self._warming = asyncio.ensure_future(self.warmer.run())

    async def _call(self, method: str, url: str, payload: Any, headers: Any) -> tuple[int, bytes]:
        """One upstream call for the warm-up; transport failures raise ``OSError``."""
        data = None if payload is None else json.dumps(payload).encode()
        try:
            reply = await self._fetch(method, url, data=data, headers=dict(headers))
        except aiohttp.ClientError as exc:
            raise OSError(_describe(exc)) from None
        return reply.status, reply.body

    async def _post_json(self, url: str, payload: Any) -> tuple[int, bytes]:
        timeout = self.config.prefix_routing.lookup_timeout
        try:
            reply = await asyncio.wait_for(
                self._fetch(
                    "POST",
                    url,
                    data=json.dumps(payload).encode(),
                    headers={"content-type": "application/json"},
                ),
                timeout,
            )
        except (TimeoutError, aiohttp.ClientError):
            return 0, b""
        return reply.status, reply.body

    def _http(self) -> aiohttp.ClientSession:
        if self._session is None:
            t = self.config.timeouts
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self.config.max_connections, limit_per_host=0),
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=t.connect, sock_read=t.idle),
                auto_decompress=False,
                skip_auto_headers=("Accept-Encoding",),
                trust_env=False,
            )
        return self._session

    async def _fetch(self, method: str, url: str, **kwargs: Any) -> _Reply:
        async with self._http().request(method, url, **kwargs) as response:
            body = await response.read()
            return _Reply(response.status, _response_headers(response.raw_headers), body)

    async def aclose(self) -> None:
        if self._warming is not None:
            await _cancel(self._warming)
            self._warming = None
        if self._feeds is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._feeds.stop)
            self._feeds = None
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        allowed = {
            "/health": "GET",
            "/ready": "GET",
            "/v1/models": "GET",
            "/metrics": "GET",
            "/prefix-index": "GET",
            "/prefix-index/match": "POST",
        }.get(path, "POST" if path in GENERATE_PATHS else None)
        record = AccessRecord(new_kv_request_id(), method, path, self.config.mode.value)
        exchange = _Exchange(send, record)
        if allowed is None:
            await exchange.error(404, f"no route {path}", kind="not_found")
        elif method != allowed:
            await exchange.error(405, f"{path} takes {allowed}", kind="method_not_allowed")
        elif path == "/health":
            await exchange.json(200, {"status": "ok", "mode": self.config.mode.value})
        elif path == "/ready":
            await self._ready(exchange)
        elif path == "/v1/models":
            await self._models(scope, exchange)
        elif path == "/metrics":
            await exchange.text(
                200,
                decision_metrics.render(
                    self.prefix_router.counters if self.prefix_router is not None else {}
                ),
            )
        elif path.startswith("/prefix-index"):
            await self._prefix_status(receive, exchange, match=path.endswith("/match"))
        else:
            await self._generate(scope, receive, exchange)

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                self.start()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # -- /ready ------------------------------------------------------------------------------

    async def _ready(self, exchange: _Exchange) -> None:
        """Probe every upstream's ``GET /health`` at once (each bounded by the connect timeout).

        200 ``ready`` when all answer 2xx; 200 ``degraded`` when some do not but every pool
        (prefillers, decoders) still has a live instance; 503 ``unready`` when a pool has none.
        The body lists every upstream's state and names the dead ones with the reason; with
        ``warm_pairs``, each pair's warm-up state (``warm_pairs``; it never affects status).
        """
        pools = {
            "prefillers": [u.url for u in self.config.prefillers],
            "decoders": [u.url for u in self.config.decoders],
        }
        urls = [url for members in pools.values() for url in members]
        problems = dict(
            zip(urls, await asyncio.gather(*map(self._probe_health, urls)), strict=True)
        )
        dead = {url: why for url, why in problems.items() if why}
        empty = [pool for pool, members in pools.items() if all(problems[u] for u in members)]
        status = "unready" if empty else "degraded" if dead else "ready"
        await exchange.json(
            503 if empty else 200,
            {
                "status": status,
                "mode": self.config.mode.value,
                "dead": dead,
                "no_live_instance": empty,
                **self._prefix_refusals(),
                **({"warm_pairs": self.warmer.status()} if self.warmer else {}),
                **{
                    pool: {url: problems[url] or "ok" for url in members}
                    for pool, members in pools.items()
                },
            },
        )

    async def _probe_health(self, url: str) -> str:
        """Why ``url`` is not healthy ("" when its ``/health`` answered 2xx in time)."""
        timeout = self.config.timeouts.connect
        try:
            reply = await asyncio.wait_for(self._fetch("GET", f"{url}/health"), timeout)
        except TimeoutError:
            return f"no /health answer in {timeout:g}s"
        except aiohttp.ClientError as exc:
            return f"unreachable: {_describe(exc)}"
        return "" if 200 <= reply.status < 300 else f"/health answered {reply.status}"

    # -- /prefix-index ----------------------------------------------------------------------

    def _prefix_refusals(self) -> dict[str, Any]:
        """``/ready``'s ``prefix_index_refused`` (slot -> why), with the in-process index."""
        if self.prefix_index is None:
            return {}
        return {
            "prefix_index_refused": {
                name: s.refused for name, s in self.prefix_index.status().items() if s.refused
            }
        }

    async def _prefix_status(self, receive: Receive, exchange: _Exchange, *, match: bool) -> None:
        """``GET /prefix-index``: policy, counters, per-rank index and feed state.
        ``POST /prefix-index/match``: what the policy would match for a body (``token_ids``,
        or a generate body and its ``path``), without routing anything."""
        router = self.prefix_router
        if router is None:
            await exchange.error(
                404, f"policy {self.config.policy} keeps no prefix index", kind="not_found"
            )
            return
        if not match:
            index = self.prefix_index
            await exchange.json(
                200,
                {
                    "policy": self.config.policy,
                    "decisions": dict(router.counters),
                    "block_size": index.block_size
                    if index
                    else self.config.prefix_routing.block_size,
                    "instances": {
                        n: asdict(s) for n, s in (index.status() if index else {}).items()
                    },
                    "feeds": self._feeds.stats() if self._feeds else {},
                },
            )
            return
        raw = await asyncio.wait_for(
            _read_body(receive, self.config.max_body_bytes), self.config.timeouts.idle
        )
        body = _json_object(raw or b"") or {}
        token_ids = body.get("token_ids")
        path = str(body.pop("path", "/v1/completions"))
        query = {**body, "prompt": token_ids} if isinstance(token_ids, list) else body
        tokens = await router.tokens.of(path, query)
        await exchange.json(
            200,
            {
                "prompt_tokens": len(tokens or ()),
                "matches": await router.matches(tokens or [], query),
            },
        )

    # -- /v1/models --------------------------------------------------------------------------

    async def _models(self, scope: Scope, exchange: _Exchange) -> None:
        decoder = next(self._model_sources)
        headers = {
            k.decode("latin-1"): v.decode("latin-1")
            for k, v in scope["headers"]
            if k.decode("latin-1").lower() in FORWARDED_HEADERS
        }
        t = self.config.timeouts
        try:
            reply = await asyncio.wait_for(
                self._fetch("GET", f"{decoder.url}/v1/models", headers=headers),
                t.connect + t.idle,
            )
        except (TimeoutError, aiohttp.ClientError) as exc:
            await exchange.error(
                502,
                f"decoder {decoder.url} unreachable: {_describe(exc)}",
                kind="bad_gateway",
                upstream=decoder.url,
            )
            return
        await exchange.reply(reply)

    # -- generate ----------------------------------------------------------------------------

    async def _generate(self, scope: Scope, receive: Receive, exchange: _Exchange) -> None:
        record = exchange.record
        try:
            try:
                raw = await asyncio.wait_for(
                    _read_body(receive, self.config.max_body_bytes), self.config.timeouts.idle
                )
            except _BodyTooLarge:
                record.outcome = "bad_request"
                await exchange.error(
                    413,
                    f"request body exceeds {self.config.max_body_bytes} bytes",
                    kind="invalid_request_error",
                )
                return
            except TimeoutError:
                record.outcome = "client_timeout"
                await exchange.error(
                    408, "request body not received in time", kind="invalid_request_error"
                )
                return
            if raw is None:
                record.outcome = "client_disconnected"
                return
            body = _json_object(raw)
            if body is None:
                record.outcome = "bad_request"
                await exchange.error(
                    400, "request body must be a JSON object", kind="invalid_request_error"
                )
                return
            record.stream = bool(body.get("stream"))
            await self._supervise(_Call(scope, exchange, body), receive)
        finally:
            record.duration_ms = round((time.monotonic() - record.started) * 1000, 3)
            access_log.info(
                json.dumps({k: v for k, v in asdict(record).items() if k != "started"}),
                extra={"p2pkv_access": record},
            )

    async def _supervise(self, call: _Call, receive: Receive) -> None:
        """Run the legs; cancel them on client disconnect or at the request deadline."""
        record, exchange = call.record, call.exchange
        work = asyncio.ensure_future(self._route(call))
        watcher = asyncio.ensure_future(_until_disconnect(receive))
        try:
            done, _ = await asyncio.wait(
                {work, watcher}, timeout=self._deadline, return_when=asyncio.FIRST_COMPLETED
            )
            if work in done:
                await work
                return
            record.outcome = "client_disconnected" if watcher in done else "deadline"
            await _cancel(work)
            if record.outcome == "deadline" and not exchange.started:
                await exchange.error(
                    504, f"request exceeded {self._deadline:g}s", kind="gateway_timeout"
                )
        except _UpstreamError as exc:
            record.outcome = exc.outcome
            await exchange.error(
                exc.status, str(exc), kind=_kind(exc.status), upstream=exc.upstream
            )
        except Exception:
            record.outcome = "error"
            log.exception("proxy failure for kv_request_id %s", record.kv_request_id)
            if not exchange.started:
                await exchange.error(500, "internal proxy error", kind="internal_error")
        finally:
            await _cancel(watcher)
            await _cancel(work)

    async def _route(self, call: _Call) -> None:
        record = call.record
        decision = await self._choose(call)
        prefiller, decoder = decision.prefiller, decision.decoder
        try:
            if self.config.mode is Mode.DECODER_FIRST:
                await self._decoder_first(call, decision)
                return
            producer = (
                None
                if self.config.mode is Mode.SYMMETRIC
                else producer_params(record.kv_request_id)
            )
            outcome = await self._prefill(
                call, prefiller, with_kv_source(producer, record.kv_request_id, decision.source)
            )
            if outcome.ok:
                params = (source_params if self.config.mode is Mode.SYMMETRIC else consumer_params)(
                    record.kv_request_id, prefiller
                )
            elif await self._refuse_after_prefill_failure(call, prefiller, outcome):
                return
            else:
                params = None
            await self._relay(call.exchange, await self._open_decode(call, decoder, params))
        finally:
            self._decoders.release(decoder)

    async def _choose(self, call: _Call) -> PrefixDecision:
        """The slots of both legs (and a source peer with a prefix policy), logged."""
        record = call.record
        if self.prefix_router is None:
            decoder = self._decoders.choose()
            decision = PrefixDecision(prefiller=self._prefillers.choose(), decoder=decoder)
        else:
            decision = await self.prefix_router.decide(record.path, call.body)
            record.prefix_lookup = decision.lookup
            record.matched_tokens = decision.matched_tokens
            record.source_tokens = decision.source_tokens
            record.source = decision.source.name if decision.source else ""
        record.decoder = slot_name(decision.decoder)
        record.prefiller = slot_name(decision.prefiller)
        return decision

    async def _decoder_first(self, call: _Call, decision: PrefixDecision) -> None:
        kv_id = call.record.kv_request_id
        prefiller, decoder = decision.prefiller, decision.decoder
        decode = asyncio.ensure_future(
            self._open_decode(call, decoder, consumer_params(kv_id, prefiller))
        )
        try:
            outcome = await self._prefill(
                call, prefiller, with_kv_source(producer_params(kv_id), kv_id, decision.source)
            )
            if outcome.ok:
                response = await decode
            else:
                # The decoder would wait out its load timeout for blocks that never come:
                # cancel that leg (vLLM aborts the request) before deciding what to do.
                await _discard(decode)
                if await self._refuse_after_prefill_failure(call, prefiller, outcome):
                    return
                response = await self._open_decode(call, decoder, None)
            await self._relay(call.exchange, response)
        finally:
            await _discard(decode)

    async def _prefill(
        self, call: _Call, slot: Slot[Prefiller], kv_params: dict[str, Any] | None
    ) -> _PrefillOutcome:
        """Run the prefill leg to completion; never raises for upstream failures."""
        record = call.record
        timeout = self.config.timeouts.prefill
        began = time.monotonic()
        try:
            reply = await asyncio.wait_for(
                self._fetch(
                    "POST",
                    f"{slot.upstream.url}{record.path}",
                    data=json.dumps(prefill_body(call.body, kv_params)).encode(),
                    headers=leg_headers(
                        call.scope["headers"],
                        record.kv_request_id,
                        slot.dp_rank,
                        self.config.api_key,
                    ),
                ),
                timeout,
            )
        except TimeoutError:
            outcome = _PrefillOutcome(False, f"timeout after {timeout:g}s")
        except aiohttp.ClientError as exc:
            outcome = _PrefillOutcome(False, f"unreachable: {_describe(exc)}")
        else:
            if 200 <= reply.status < 300:
                outcome = _PrefillOutcome(True, reply=reply)
            else:
                outcome = _PrefillOutcome(False, f"status {reply.status}", reply)
        finally:
            self._prefillers.release(slot)
        record.prefill_ms = round((time.monotonic() - began) * 1000, 3)
        record.prefill = "ok" if outcome.ok else f"failed: {outcome.reason}"
        if not outcome.ok:
            log.warning(
                "prefill leg %s to %s failed: %s (on_prefill_failure=%s)",
                record.kv_request_id,
                slot_name(slot),
                outcome.reason,
                self.config.on_prefill_failure.value,
            )
        return outcome

    async def _refuse_after_prefill_failure(
        self, call: _Call, slot: Slot[Prefiller], outcome: _PrefillOutcome
    ) -> bool:
        """Answer the client if the failure policy says so; False means: go recompute."""
        record, exchange = call.record, call.exchange
        if self.config.on_prefill_failure is PrefillFailure.RECOMPUTE:
            record.outcome = "recomputed"
            return False
        record.outcome = "prefill_failed"
        reply = outcome.reply
        if reply is not None and 400 <= reply.status < 500 and reply.status not in (408, 429):
            await exchange.reply(reply)
            return True
        url = slot.upstream.url
        await exchange.error(
            502,
            f"prefiller {url} (dp rank {slot.dp_rank}) failed: {outcome.reason}",
            kind="bad_gateway",
            upstream=url,
        )
        return True

    async def _open_decode(
        self, call: _Call, slot: Slot[Decoder], kv_params: dict[str, Any] | None
    ) -> aiohttp.ClientResponse:
        """Send the decode leg; returns once its response headers are in (body unread)."""
        url = slot.upstream.url
        timeout = self.config.timeouts.decode
        try:
            return await asyncio.wait_for(
                self._http().post(
                    f"{url}{call.record.path}",
                    data=json.dumps(decode_body(call.body, kv_params)).encode(),
                    headers=leg_headers(
                        call.scope["headers"],
                        call.record.kv_request_id,
                        slot.dp_rank,
                        self.config.api_key,
                    ),
                ),
                timeout,
            )
        except TimeoutError:
            raise _UpstreamError(
                504, "decoder_timeout", f"decoder {url} sent no response in {timeout:g}s", url
            ) from None
        except aiohttp.ClientError as exc:
            raise _UpstreamError(
                502, "decoder_unreachable", f"decoder {url} unreachable: {_describe(exc)}", url
            ) from None

    async def _relay(self, exchange: _Exchange, response: aiohttp.ClientResponse) -> None:
        """Stream the decode response to the client chunk by chunk, as received."""
        finished = False
        try:
            await exchange.start(response.status, _response_headers(response.raw_headers))
            try:
                async for chunk in response.content.iter_any():
                    await exchange.body(chunk)
            except (TimeoutError, aiohttp.ClientError) as exc:
                exchange.record.outcome = "decode_stream_error"
                log.warning(
                    "decode stream %s broke after %d bytes: %s; dropping the client connection",
                    exchange.record.kv_request_id,
                    exchange.record.bytes,
                    _describe(exc),
                )
                return
            await exchange.end()
            finished = True
        finally:
            # A half-read response must not go back to the pool: closing it drops the
            # upstream connection, which is how vLLM learns to abort the request.
            if finished:
                response.release()
            else:
                response.close()


async def _read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None if the client disconnected first."""
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise _BodyTooLarge
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


async def _cancel(task: asyncio.Future[Any]) -> None:
    if not task.done():
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task


async def _discard(task: asyncio.Future[aiohttp.ClientResponse]) -> None:
    """Cancel a pending decode leg, or close the response it already opened."""
    if not task.done():
        await _cancel(task)
    elif not task.cancelled() and task.exception() is None:
        task.result().close()


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        body = json.loads(raw)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def _response_headers(raw: Any) -> list[tuple[bytes, bytes]]:
    """Upstream response headers minus hop-by-hop ones (and date/server: ours are sent)."""
    return [(k.lower(), v) for k, v in raw if k.lower() not in _DROPPED_RESPONSE_HEADERS]


def _describe(exc: BaseException) -> str:
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _kind(status: int) -> str:
    return {502: "bad_gateway", 504: "gateway_timeout"}.get(status, "error")
