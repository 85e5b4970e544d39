"""Entry point of ``p2pkv-memory``: registers the ``memory`` control and data transports."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_memory.control import MemoryControlTransport
    from p2pkv_memory.data import MemoryDataTransport

    return [MemoryControlTransport, MemoryDataTransport]
