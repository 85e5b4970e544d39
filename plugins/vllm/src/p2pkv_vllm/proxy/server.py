"""Serve the proxy with uvicorn on a socket bound up front (so port 0 reports its port)."""

from __future__ import annotations

import asyncio
import logging
import socket
import sys

import uvicorn
from p2pkv.errors import ConfigError

from p2pkv_vllm.proxy.app import ACCESS_LOGGER, ProxyApp
from p2pkv_vllm.proxy.config import ProxyConfig

__all__ = ["bind", "build_server", "run"]


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (0 = ephemeral; read it back from the socket).

    Raises ``ConfigError`` for a port outside 0..65535, ``OSError`` when the bind fails."""
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port}: a listen port must be 0..65535 (0 = any free port)")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must be IPPROTO_TCP (not 0): asyncio only disables Nagle on accepted sockets whose
    # proto says TCP, and with Nagle on every small streamed chunk can stall ~40 ms.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host.strip("[]"), port))
        sock.listen(2048)
    except OSError:
        sock.close()
        raise
    return sock


def build_server(app: object, *, log_level: str = "warning") -> uvicorn.Server:
    """A uvicorn server for ``app`` (own access log off: the proxy writes a structured one)."""
    config = uvicorn.Config(
        app,  # type: ignore[arg-type]
        log_level=log_level.lower(),
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=10,
    )
    return uvicorn.Server(config)


def run(config: ProxyConfig, host: str, port: int, *, log_level: str, access_log: bool) -> int:
    """Serve until SIGINT/SIGTERM; returns the exit code. A config the app refuses (e.g. an
    unknown selection policy) raises ``ConfigError`` before anything is bound or printed."""
    app = ProxyApp(config)
    if access_log:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger = logging.getLogger(ACCESS_LOGGER)
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    sock = bind(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host
    print(
        f"p2pkv proxy listening on http://{shown}:{bound_port} (mode {config.mode.value}, "
        f"{len(config.prefillers)} prefiller(s), {len(config.decoders)} decoder(s))",
        file=sys.stderr,
        flush=True,
    )
    server = build_server(app, log_level=log_level)
    try:
        asyncio.run(server.serve(sockets=[sock]))
    finally:
        sock.close()
    return 0
