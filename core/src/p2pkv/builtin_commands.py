"""p2pkv's own plugin: core's subcommands, through the ``p2pkv_cli_commands`` hook.

:func:`p2pkv.cli.build_parser` registers this module as plugin ``p2pkv`` (see
``registry.INTERNAL_PLUGIN``; the registry itself imports no command module), so built-in
and plugin commands are added the same way: through pluggy, traced by ``P2PKV_TRACE_HOOKS``,
a failure recorded like a plugin's. The command modules (which need rich, the ``cli`` extra)
are imported only when the CLI builds its parser. ``demo``, ``bench`` and ``doctor`` are
p2pkv-tools' (plugin ``p2pkv_tools.plugin``), added right after these.
"""

from __future__ import annotations

import argparse

from p2pkv.hookspecs import hookimpl


@hookimpl(tryfirst=True)  # before the plugins', so `p2pkv --help` lists the built-ins first
def p2pkv_cli_commands(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    from p2pkv import check_config, cli_plugins

    for command in (cli_plugins, check_config):
        command.add_parser(subparsers)
