"""The ``p2pkv`` command.

Core's own subcommands (``plugins``, ``check-config``) live in their own modules and are
added by p2pkv's own plugin (``p2pkv.builtin_commands``, which :func:`build_parser` registers
as plugin ``p2pkv``) through the ``p2pkv_cli_commands`` hook, like the plugins' commands;
``demo``, ``bench`` and ``doctor`` come from the p2pkv-tools plugin (installed by the ``cli``
extra). Without p2pkv-tools (or with it disabled or broken) those three still parse and end
in one line naming the fix, exit status 2. The command line needs rich (the ``cli`` extra);
without it ``p2pkv`` says so in one line and exits 2. This module itself imports without rich.

Failure contract: every misuse ends in one plain line on stderr, ``p2pkv <command>: <what
is wrong and how to fix it>``, with exit status 2 (usage errors: bad flags, a bad config, an
unknown or unavailable transport, an unwritable output path, a command whose distribution
is missing) or 1 (any other deliberate p2pkv error); never a traceback. Commands signal such
errors by raising ``ConfigError`` or ``TransportUnavailable``; :func:`main` turns them into
that line. The helpers the commands share (output consoles, the output-path check, the
transport check) are re-exported here from :mod:`p2pkv.cli_support`.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from typing import Any, NoReturn

from p2pkv import __version__, builtin_commands
from p2pkv.cli_support import (
    check_output_path,
    configure_logging,
    make_console,
    print_error,
    print_json,
    usable_transport,
)
from p2pkv.errors import ConfigError, P2PKVError, TransportUnavailable
from p2pkv.optional import missing_extra
from p2pkv.registry import Registry, default_registry

__all__ = [
    "LOG_LEVELS",
    "TOOLS_DISTRIBUTION",
    "TOOL_COMMANDS",
    "check_output_path",
    "configure_logging",
    "main",
    "make_console",
    "print_error",
    "print_json",
    "usable_transport",
]

LOG_LEVELS = ("CRITICAL", "ERROR", "WARNING", "INFO", "DEBUG")
"""Values ``--log-level`` accepts (any case)."""
TOOLS_DISTRIBUTION = "p2pkv-tools"
"""The distribution (a plugin, installed by the ``cli`` extra) providing :data:`TOOL_COMMANDS`."""
TOOL_COMMANDS: Mapping[str, str] = {
    "demo": "move a verified KV request stream between a producer and a consumer process",
    "bench": "measure transports against the raw libraries and memcpy",
    "doctor": "diagnose this host: transports, versions, UCX lanes, ports",
}
"""The commands p2pkv-tools adds, with their help (p2pkv-tools uses these texts too): listed,
and explained when run, without it."""


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line naming the command and its help."""

    def error(self, message: str) -> NoReturn:
        print_error(self.prog, f"{message} (see '{self.prog} --help')")
        self.exit(2)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level",
        type=str.upper,
        choices=LOG_LEVELS,
        default=default,
        help="Python log level for p2pkv (default WARNING); before or after the command",
    )


def build_parser(registry: Registry) -> argparse.ArgumentParser:
    """The full parser: built-in commands (registering p2pkv's own plugin in ``registry``),
    then the plugins' (every one takes --log-level), then a stand-in for each of
    :data:`TOOL_COMMANDS` no plugin added (see :func:`_add_missing_tools`). A plugin whose
    commands fail to add is recorded in ``registry.failures`` (``p2pkv plugins`` lists it)
    and left out."""
    parser = _Parser(
        prog="p2pkv", description="Peer-to-peer KV-cache block transfer: tools and diagnostics."
    )
    parser.add_argument("--version", action="version", version=f"p2pkv {__version__}")
    _add_log_level(parser, "WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    registry.add_internal_plugin(builtin_commands)
    registry.add_cli_commands(sub)
    _add_missing_tools(registry, sub)
    for command in sub.choices.values():
        try:  # SUPPRESS: a --log-level after the command only overrides one given before it
            _add_log_level(command, argparse.SUPPRESS)
        except argparse.ArgumentError:
            pass  # the command defines its own --log-level
    return parser


def _add_missing_tools(registry: Registry, sub: Any) -> None:
    """Add a stand-in for each of :data:`TOOL_COMMANDS` that no plugin added: it accepts any
    arguments (``accepts_any``, see :func:`main`) and raises ``ConfigError`` naming the fix,
    so ``p2pkv demo`` without p2pkv-tools ends in that one line with exit status 2."""
    missing = [name for name in TOOL_COMMANDS if name not in sub.choices]
    if not missing:
        return
    fix = _tools_fix(registry)

    def not_installed(args: argparse.Namespace) -> int:
        raise ConfigError(fix)

    for name in missing:
        p = sub.add_parser(
            name, help=f"{TOOL_COMMANDS[name]} (needs {TOOLS_DISTRIBUTION})", add_help=False
        )
        p.set_defaults(func=not_installed, accepts_any=True)


def _tools_fix(registry: Registry) -> str:
    """Why p2pkv-tools' commands are missing from ``registry``, and what to do."""
    failed = [f.reason for f in registry.failures if f.distribution == TOOLS_DISTRIBUTION]
    if failed:
        return f"{TOOLS_DISTRIBUTION} failed to load ({failed[0]}); see 'p2pkv plugins'"
    if TOOLS_DISTRIBUTION in registry.disabled.values():
        return registry.install_hint(TOOLS_DISTRIBUTION)
    return f"not installed: pip install 'p2pkv[cli]' (or {TOOLS_DISTRIBUTION})"


def _early_log_level(argv: Sequence[str]) -> str:
    """``--log-level`` wherever it is in ``argv`` (read before the plugins load, so their
    load-time messages follow it); exits with status 2 on a value not in ``LOG_LEVELS``."""
    early = _Parser(prog="p2pkv", add_help=False, allow_abbrev=False)
    _add_log_level(early, "WARNING")
    known, _ = early.parse_known_args(argv)
    return str(known.log_level)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``p2pkv`` command line; returns the exit status (see the module docstring)."""
    problem = missing_extra("rich", "cli")
    if problem is not None:
        print_error("p2pkv", problem)
        return 2
    args_list = list(sys.argv[1:] if argv is None else argv)
    configure_logging(_early_log_level(args_list))
    parser = build_parser(default_registry())
    args, extra = parser.parse_known_args(args_list)
    if extra and not getattr(args, "accepts_any", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    func: Any = getattr(args, "func", None)
    if func is None:
        parser.print_help()
        return 2
    where = f"p2pkv {args.command}"
    try:
        return int(func(args) or 0)
    except (ConfigError, TransportUnavailable) as exc:
        print_error(where, exc)
        return 2
    except P2PKVError as exc:
        print_error(where, f"{type(exc).__name__}: {exc}")
        return 1
    except KeyboardInterrupt:
        print_error(where, "interrupted")
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
