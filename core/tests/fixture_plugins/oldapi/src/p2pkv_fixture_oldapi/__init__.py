"""A plugin built for another plugin API version: it must be refused."""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 99


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    raise AssertionError("a plugin of another API version must never be called")
