"""The proxy tests' harness: fake vLLM servers on loopback and helpers to drive them.

Fake vLLM instances are small ASGI apps that record every request and answer with canned
completions or streams; ``serving`` runs one under uvicorn on port 0. The ``kit`` fixture
(``conftest.py``) hands :class:`Kit` to the tests; importable by name for its types.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")

# -- fake vLLM servers ----------------------------------------------------------------------

WAIT = 10.0
"""Upper bound of every wait inside the fakes (a test fails long before a fake gives up)."""


@dataclass
class Seen:
    """One request a fake received."""

    method: str
    path: str
    headers: dict[str, str]
    body: Any
    disconnected: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def kv_params(self) -> Any:
        return self.body.get("kv_transfer_params") if isinstance(self.body, dict) else None


Send = Callable[[dict[str, Any]], Awaitable[None]]
Behavior = Callable[["FakeVLLM", Seen, Send], Awaitable[None]]


def sse_chunks(name: str, n: int = 4) -> list[bytes]:
    """Canned streamed completion: ``n`` SSE events then ``[DONE]`` (one body message each)."""
    chunks = [
        f'data: {{"id": "{name}", "choices": [{{"index": 0, "text": "tok{i} é"}}]}}\n\n'.encode()
        for i in range(n)
    ]
    return [*chunks, b"data: [DONE]\n\n"]


async def reply(fake: FakeVLLM, seen: Seen, send: Send) -> None:
    """Default behavior: a JSON completion, or ``sse_chunks`` when the body asks to stream."""
    if seen.path == "/v1/models":
        await send_json(send, 200, {"object": "list", "data": [{"id": fake.name}]})
        return
    if isinstance(seen.body, dict) and seen.body.get("stream"):
        await start_stream(send, *fake.stream_chunks)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return
    await send_json(
        send,
        200,
        {
            "id": fake.name,
            "choices": [{"index": 0, "text": f"{fake.name} ok"}],
            "kv_request_id": seen.headers.get("x-request-id"),
        },
    )


async def start_stream(send: Send, *chunks: bytes) -> None:
    """Start a 200 event stream and send ``chunks`` (each its own body message), unfinished."""
    await send(
        {
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
        }
    )
    for chunk in chunks:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


async def send_json(send: Send, status: int, obj: Any) -> None:
    data = json.dumps(obj).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(data)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": data, "more_body": False})


def status(code: int, message: str = "upstream says no") -> Behavior:
    async def behave(fake: FakeVLLM, seen: Seen, send: Any) -> None:
        await send_json(send, code, {"error": {"message": message, "code": code}})

    return behave


async def hang(fake: FakeVLLM, seen: Seen, send: Any) -> None:
    """Never answer; return when the caller goes away (bounded)."""
    with contextlib.suppress(asyncio.TimeoutError):
        await asyncio.wait_for(seen.disconnected.wait(), WAIT)


class FakeVLLM:
    """An ASGI app standing in for one vLLM OpenAI server.

    ``behavior`` answers each request (default ``reply``); ``seen`` records them in arrival
    order; ``changed`` is set on every arrival and disconnect so tests can wait on it.
    """

    def __init__(self, name: str, behavior: Behavior = reply) -> None:
        self.name = name
        self.behavior = behavior
        self.seen: list[Seen] = []
        self.stream_chunks = sse_chunks(name)
        self._changed: asyncio.Event | None = None

    @property
    def changed(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def generate_requests(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/") and s.path != "/v1/models"]

    async def wait_for(self, predicate: Callable[[], T], what: str, timeout: float = WAIT) -> T:
        """Wait until ``predicate()`` is truthy, re-checking on every arrival/disconnect."""

        async def loop() -> T:
            while True:
                value = predicate()
                if value:
                    return value
                self.changed.clear()
                await self.changed.wait()

        try:
            return await asyncio.wait_for(loop(), timeout)
        except TimeoutError:
            raise AssertionError(
                f"{self.name}: timed out after {timeout}s waiting for {what}"
            ) from None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        raw = b""
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        seen = Seen(scope["method"], scope["path"], headers, json.loads(raw) if raw else None)
        self.seen.append(seen)
        self.changed.set()

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            seen.disconnected.set()
            self.changed.set()

        watcher = asyncio.ensure_future(watch())
        try:
            await self.behavior(self, seen, send)
        finally:
            if not seen.disconnected.is_set():
                watcher.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await watcher


@contextlib.asynccontextmanager
async def serving(app: Any) -> AsyncIterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (ephemeral port); yields its base URL."""
    from p2pkv_vllm.proxy.server import bind, build_server

    sock = bind("127.0.0.1", 0)
    server = build_server(app, log_level="critical")
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    try:
        for _ in range(2000):
            if server.started or task.done():
                break
            await asyncio.sleep(0.005)
        if not server.started:
            raise AssertionError("uvicorn did not start in 10s")
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        try:
            await asyncio.wait_for(task, WAIT)
        finally:
            sock.close()


def refused_url() -> tuple[str, socket.socket]:
    """A URL nobody listens on: a bound, never-listening socket (keep it open for the test)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    return f"http://127.0.0.1:{sock.getsockname()[1]}", sock


class Kit:
    FakeVLLM = FakeVLLM
    Seen = Seen
    serving = staticmethod(serving)
    reply = staticmethod(reply)
    hang = staticmethod(hang)
    status = staticmethod(status)
    send_json = staticmethod(send_json)
    start_stream = staticmethod(start_stream)
    sse_chunks = staticmethod(sse_chunks)
    refused_url = staticmethod(refused_url)

    @staticmethod
    def run(main: Callable[[], Awaitable[T]], timeout: float = 60.0) -> T:
        """Run one async scenario on a fresh event loop, bounded by ``timeout``."""

        async def bounded() -> T:
            return await asyncio.wait_for(main(), timeout)

        return asyncio.run(bounded())
