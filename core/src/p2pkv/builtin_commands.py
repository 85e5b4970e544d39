"""p2pkv's own plugin: the built-in subcommands, through the ``p2pkv_cli_commands`` hook.

Every registry registers this module as plugin ``p2pkv`` (see ``registry.INTERNAL_PLUGIN``),
so built-in and plugin commands are added the same way: through pluggy, traced by
``P2PKV_TRACE_HOOKS``, a failure recorded like a plugin's. The command modules (which need
rich, the ``cli`` extra) are imported only when the CLI builds its parser.
"""

from __future__ import annotations

import argparse

from p2pkv.hookspecs import hookimpl

__all__ = ["p2pkv_cli_commands"]


@hookimpl(tryfirst=True)  # before the plugins', so `p2pkv --help` lists the built-ins first
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from p2pkv import check_config, cli_plugins, doctor
    from p2pkv.bench import cli as bench_cli
    from p2pkv.demo import cli as demo_cli

    for command in (cli_plugins, demo_cli, bench_cli, doctor, check_config):
        command.add_parser(subparsers)
