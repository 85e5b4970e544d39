"""``p2pkv proxy``'s readiness follows its backends: ``/ready`` names the dead ones and turns
503 once a pool has no live instance; ``/health`` stays 200 (liveness).

The real CLI in a subprocess, against two tiny HTTP backends in this process (their
``/health`` answers 200) and one address that refuses connections (a socket bound without
``listen``, kept open so nothing else takes the port).
"""

from __future__ import annotations

import json
import queue
import re
import socket
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

for _module in ("p2pkv_vllm", "uvicorn", "aiohttp"):
    pytest.importorskip(_module, reason="needs p2pkv-vllm with its proxy extra")

LISTENING = re.compile(r"listening on (http://\S+) ")
WAIT = 20.0


class _Health(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        self.send_response(200 if self.path == "/health" else 404)
        self.send_header("content-length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def _backend() -> tuple[ThreadingHTTPServer, str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, f"http://127.0.0.1:{server.server_address[1]}"


@pytest.fixture
def refused() -> Iterator[str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{s.getsockname()[1]}"


def _get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=WAIT) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _start_proxy(*args: str) -> tuple[subprocess.Popen[str], str]:
    script = Path(sys.executable).parent / "p2pkv"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "p2pkv.cli"]
    proc = subprocess.Popen(
        [*command, "proxy", "--port", "0", "--connect-timeout", "2", *args],
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str] = queue.Queue()
    assert proc.stderr is not None
    stderr = proc.stderr

    def pump() -> None:
        for line in stderr:
            lines.put(line)

    threading.Thread(target=pump, daemon=True).start()
    while True:
        try:
            line = lines.get(timeout=WAIT)
        except queue.Empty:
            proc.kill()
            raise AssertionError("the proxy did not say where it listens") from None
        found = LISTENING.search(line)
        if found:
            return proc, found.group(1)


def test_ready_reflects_the_backends(refused: str) -> None:
    live_prefiller, prefiller_url = _backend()
    live_decoder, decoder_url = _backend()
    proc, proxy = _start_proxy(
        "--prefiller", prefiller_url, "--prefiller", refused, "--decoder", decoder_url
    )
    try:
        status, body = _get(f"{proxy}/ready")
        assert status == 200 and body["status"] == "degraded", body
        assert list(body["dead"]) == [refused] and "unreachable" in body["dead"][refused]
        assert body["decoders"] == {decoder_url: "ok"}

        live_prefiller.shutdown()
        live_prefiller.server_close()
        status, body = _get(f"{proxy}/ready")
        assert status == 503 and body["status"] == "unready", body
        assert sorted(body["dead"]) == sorted([prefiller_url, refused])
        assert body["no_live_instance"] == ["prefillers"]
        assert _get(f"{proxy}/health")[0] == 200
    finally:
        proc.terminate()
        proc.wait(timeout=WAIT)
        live_decoder.shutdown()
        live_decoder.server_close()
