"""The CLI reference of docs/cli.md: the help of every ``p2pkv`` command (written into the
page by ``reference_pages.py``).

The text is what ``p2pkv <command> --help`` prints, taken from the parser the CLI builds
(``p2pkv.cli.build_parser`` over the installed plugins), so the reference cannot drift from
the code: the core's commands, p2pkv-tools' (``demo``, ``bench``, ``doctor``) and those of the
plugins installed where the site is built.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterator

from p2pkv.cli import build_parser
from p2pkv.registry import default_registry

WIDTH = "100"


def _commands(parser: argparse.ArgumentParser, prog: str) -> Iterator[tuple[str, str]]:
    """(``p2pkv ...`` command line, its help text) for ``parser`` and every subcommand."""
    yield prog, parser.format_help()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _commands(sub, f"{prog} {name}")


def render() -> str:
    previous = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = WIDTH  # argparse wraps at the terminal's width
    try:
        parser = build_parser(default_registry())
        sections = [
            f"### `{prog}`\n\n```text\n{text.rstrip()}\n```"
            for prog, text in _commands(parser, "p2pkv")
        ]
    finally:
        if previous is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = previous
    return "\n\n".join(sections)
