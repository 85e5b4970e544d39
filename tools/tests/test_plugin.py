"""p2pkv-tools as a plugin of the ``p2pkv`` CLI: its commands come right after core's
built-ins, before other plugins' (entry point ``tools`` in group ``p2pkv``)."""

from __future__ import annotations

import argparse
import importlib.metadata as md
from typing import Any

from p2pkv.cli import TOOL_COMMANDS, build_parser
from p2pkv.hookspecs import hookimpl
from p2pkv.registry import Registry
from p2pkv_tools import plugin


class _Other:
    P2PKV_PLUGIN_API = 1

    @hookimpl
    def p2pkv_cli_commands(self, subparsers: Any) -> None:
        subparsers.add_parser("other").set_defaults(func=lambda args: 0)


def test_commands_follow_the_builtins_before_other_plugins() -> None:
    reg = Registry.from_plugins([("other", _Other()), ("tools", plugin)], environ={})
    parser = build_parser(reg)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == ["plugins", "check-config", *TOOL_COMMANDS, "other"]
    assert not reg.failures


def test_the_entry_point_is_registered_in_group_p2pkv() -> None:
    (ep,) = [ep for ep in md.entry_points(group="p2pkv") if ep.name == "tools"]
    assert ep.value == "p2pkv_tools.plugin" and ep.dist is not None
    assert ep.dist.name == "p2pkv-tools"
    assert Registry.load(environ={}).plugins["tools"] == "p2pkv-tools"
