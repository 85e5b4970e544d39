"""Entry point of ``p2pkv-example-loopback`` (group ``p2pkv``, name ``loopback``)."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_loopback.control import LoopbackControlTransport
    from p2pkv_loopback.data import LoopbackDataTransport

    return [LoopbackControlTransport, LoopbackDataTransport]
