"""Entry point of ``p2pkv-tools``: adds ``demo``, ``bench`` and ``doctor`` to the ``p2pkv`` CLI.

The command modules (which need rich) are imported only when the CLI builds its parser, so
loading this plugin (every registry does) costs nothing.
"""

from __future__ import annotations

import argparse

from p2pkv.hookspecs import hookimpl

__all__ = ["P2PKV_PLUGIN_API", "p2pkv_cli_commands"]

P2PKV_PLUGIN_API = 1


@hookimpl(tryfirst=True)  # right after core's built-ins in `p2pkv --help`, before other plugins
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from p2pkv_tools import doctor
    from p2pkv_tools.bench import cli as bench_cli
    from p2pkv_tools.demo import cli as demo_cli

    for command in (demo_cli, bench_cli, doctor):
        command.add_parser(subparsers)
