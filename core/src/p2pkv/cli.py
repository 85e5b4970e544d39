"""The ``p2pkv`` command.

Built-in subcommands live in their own modules and are added by p2pkv's own plugin
(``p2pkv.builtin_commands``) through the ``p2pkv_cli_commands`` hook, like the plugins' commands.
The command line needs rich (the ``cli`` extra); without it ``p2pkv`` says so in one line and
exits 2. This module itself imports without rich.

Failure contract: every misuse ends in one plain line on stderr, ``p2pkv <command>: <what
is wrong and how to fix it>``, with exit status 2 (usage errors: bad flags, a bad config, an
unknown or unavailable transport, an unwritable output path) or 1 (any other deliberate
p2pkv error); never a traceback. Commands signal such errors by raising ``ConfigError`` or
``TransportUnavailable``; :func:`main` turns them into that line. The helpers below are what
the built-in commands share: output consoles, the output-path check and the transport check.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NoReturn

from p2pkv import __version__
from p2pkv.contracts import TransportKind
from p2pkv.errors import ConfigError, P2PKVError, TransportUnavailable
from p2pkv.optional import missing_extra
from p2pkv.registry import Registry, default_registry

if TYPE_CHECKING:
    from rich.console import Console

__all__ = [
    "LOG_LEVELS",
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
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class _Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line naming the command and its help."""

    def error(self, message: str) -> NoReturn:
        print_error(self.prog, f"{message} (see '{self.prog} --help')")
        self.exit(2)


def _add_log_level(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--log-level", type=str.upper, choices=LOG_LEVELS, default=default,
        help="Python log level for p2pkv (default WARNING); before or after the command",
    )


def build_parser(registry: Registry) -> argparse.ArgumentParser:
    """The full parser: built-in commands, then the plugins' (every one takes --log-level).
    A plugin whose commands fail to add is recorded in ``registry.failures`` (``p2pkv
    plugins`` lists it) and left out."""
    parser = _Parser(
        prog="p2pkv", description="Peer-to-peer KV-cache block transfer: tools and diagnostics."
    )
    parser.add_argument("--version", action="version", version=f"p2pkv {__version__}")
    _add_log_level(parser, "WARNING")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    registry.add_cli_commands(sub)
    for command in sub.choices.values():
        try:  # SUPPRESS: a --log-level after the command only overrides one given before it
            _add_log_level(command, argparse.SUPPRESS)
        except argparse.ArgumentError:
            pass  # the command defines its own --log-level
    return parser


def _early_log_level(argv: Sequence[str]) -> str:
    """``--log-level`` wherever it is in ``argv`` (read before the plugins load, so their
    load-time messages follow it); exits with status 2 on a value not in ``LOG_LEVELS``."""
    early = _Parser(prog="p2pkv", add_help=False, allow_abbrev=False)
    _add_log_level(early, "WARNING")
    known, _ = early.parse_known_args(argv)
    return str(known.log_level)


def configure_logging(level: str | int) -> None:
    """Log records of ``level`` and above to stderr, in the CLI's format (also used by the
    demo's role processes, which inherit the level)."""
    logging.basicConfig(level=level, format=_LOG_FORMAT)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``p2pkv`` command line; returns the exit status (see the module docstring)."""
    problem = missing_extra("rich", "cli")
    if problem is not None:
        print_error("p2pkv", problem)
        return 2
    args_list = list(sys.argv[1:] if argv is None else argv)
    configure_logging(_early_log_level(args_list))
    parser = build_parser(default_registry())
    args = parser.parse_args(args_list)
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


def print_error(where: str, message: object) -> None:
    """``where: message`` as one plain line on stderr: no markup, no emoji, no wrapping."""
    text = " ".join(str(message).split())
    sys.stderr.write(f"{where}: {text}\n")
    sys.stderr.flush()


def make_console(*, stderr: bool = False) -> Console:
    """A rich console for a command's output. Emoji codes are off, so text that comes from
    the user (``lognormal:abc:0.6``) prints as typed; a console that is not a terminal is
    200 columns wide, so tables written to a file or pipe are not squeezed."""
    from rich.console import Console

    console = Console(stderr=stderr, emoji=False)
    if not console.is_terminal:
        console = Console(stderr=stderr, emoji=False, width=200)
    return console


def print_json(obj: Any) -> None:
    json.dump(obj, sys.stdout, indent=2, sort_keys=True, default=str)
    sys.stdout.write("\n")


def check_output_path(option: str, path: str) -> None:
    """Refuse, before any work starts, an output ``path`` that could not be written later:
    its directory is missing or not writable, or the path is a directory or read-only.
    Raises ``ConfigError`` naming ``option``, the path and the fix."""
    directory = os.path.dirname(os.path.abspath(path))
    problem = ""
    if not os.path.isdir(directory):
        problem = f"directory {directory} does not exist; create it or choose another path"
    elif os.path.isdir(path):
        problem = "is a directory; give a file name"
    elif not os.access(path if os.path.exists(path) else directory, os.W_OK):
        problem = "is not writable here; choose another path"
    if problem:
        raise ConfigError(f"{option} {path}: {problem}")


def usable_transport(registry: Registry, kind: TransportKind, name: str) -> type[Any]:
    """The class of the ``kind`` transport ``name`` if it can run here. Raises
    ``ConfigError`` for an unknown name (the registry's hint: installed names, the closest
    one, the distribution to install or enable) and ``TransportUnavailable`` for a missing
    library (naming the pip package)."""
    cls: type[Any] = registry.transport(kind, name)
    problem = cls.availability()
    if problem is not None:
        raise problem
    return cls


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
