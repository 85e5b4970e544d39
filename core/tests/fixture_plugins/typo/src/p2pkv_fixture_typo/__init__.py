"""A plugin that misspells a hook name: it must be refused naming the hook, not ignored."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


@hookimpl
def p2pkv_transprots() -> list[type[Any]]:
    raise AssertionError("a hook that has no hookspec must never be called")
