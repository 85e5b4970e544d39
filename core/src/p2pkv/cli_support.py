"""What the ``p2pkv`` commands share: output consoles, the one-line error, JSON output, the
output-path check, the transport check and the CLI's log format.

Command modules (core's built-ins and the plugins', e.g. p2pkv-tools) import these from
:mod:`p2pkv.cli`, which re-exports them; they live here so that :mod:`p2pkv.cli` can import
the built-in command modules without an import cycle. Imports without rich (it is imported
by :func:`make_console` when called).
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import TYPE_CHECKING, Any

from p2pkv.contracts import TransportKind
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry

if TYPE_CHECKING:
    from rich.console import Console

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure_logging(level: str | int) -> None:
    """Log records of ``level`` and above to stderr, in the CLI's format (also used by the
    demo's role processes, which inherit the level)."""
    logging.basicConfig(level=level, format=_LOG_FORMAT)


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
