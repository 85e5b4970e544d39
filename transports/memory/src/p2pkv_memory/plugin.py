"""Entry point of ``p2pkv-memory``: registers the ``memory`` control and data transports (core's
reference backend, :mod:`p2pkv.reference`)."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv.reference import MemoryControlTransport, MemoryDataTransport

    return [MemoryControlTransport, MemoryDataTransport]
