"""Entry point of ``p2pkv-zmq``: the ``zmq`` control transport and the ``p2pkv keys`` and
``p2pkv probe`` commands.

Importing this module never imports zmq, so ``p2pkv plugins`` can explain a missing pyzmq.
"""

from __future__ import annotations

import argparse
from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_zmq.transport import ZmqControlTransport

    return [ZmqControlTransport]


@hookimpl
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from p2pkv_zmq.cli import add_keys_parser
    from p2pkv_zmq.probe_cli import add_probe_parser

    add_keys_parser(subparsers)
    add_probe_parser(subparsers)
