"""Entry point of ``p2pkv-nixl``: the ``nixl`` data transport, its raw-NIXL bench baseline and
the ``p2pkv nixl-lanes`` command. Importing this module never imports ``nixl``."""

from __future__ import annotations

import argparse
from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_nixl.transport import NixlDataTransport

    return [NixlDataTransport]


@hookimpl
def p2pkv_bench_baselines() -> list[type[Any]]:
    from p2pkv_nixl.baseline import RawNixl

    return [RawNixl]


@hookimpl
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from p2pkv_nixl.ucx import add_parser

    add_parser(subparsers)
