"""The ``p2pkv`` command.

Built-in subcommands live in their own modules and register themselves through
``_BUILTIN_COMMANDS``; plugins add theirs through the ``p2pkv_cli_commands`` hook.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
from collections.abc import Sequence
from typing import Any

from p2pkv import __version__
from p2pkv.registry import Registry, default_registry

__all__ = ["main"]

# module path -> function add_parser(subparsers) that sets ``func``.
_BUILTIN_COMMANDS = (
    "p2pkv.cli_plugins",
    "p2pkv.demo.cli",
    "p2pkv.bench.cli",
    "p2pkv.doctor",
)


def build_parser(registry: Registry) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="p2pkv", description="Peer-to-peer KV-cache block transfer: tools and diagnostics."
    )
    parser.add_argument("--version", action="version", version=f"p2pkv {__version__}")
    parser.add_argument(
        "--log-level", default="WARNING", help="Python log level for p2pkv (default WARNING)"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in _BUILTIN_COMMANDS:
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            # Only a command whose own module (or package) is absent is skipped.
            if exc.name is None or not (module == exc.name or module.startswith(exc.name + ".")):
                raise
            continue
        mod.add_parser(sub)
    registry.add_cli_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    registry = default_registry()
    parser = build_parser(registry)
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=getattr(logging, str(args.log_level).upper(), logging.WARNING),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    func: Any = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    return int(func(args) or 0)


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
