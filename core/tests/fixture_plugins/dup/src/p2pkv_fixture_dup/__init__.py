"""Claims the data transport name "fixture" too: both claims must be refused."""

from __future__ import annotations

from typing import Any, ClassVar

from p2pkv.contracts import Capabilities, DataTransport
from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


class DuplicateData(DataTransport):
    name: ClassVar[str] = "fixture"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=False, cross_host=False)


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    return [DuplicateData]
