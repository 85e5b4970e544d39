"""Entry point of ``p2pkv-ucx``: registers the ``ucx`` data transport and its bench baseline."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_ucx.transport import UcxDataTransport

    return [UcxDataTransport]


@hookimpl
def p2pkv_bench_baselines() -> list[type[Any]]:
    from p2pkv_ucx.baseline import RawUcxxBaseline

    return [RawUcxxBaseline]
