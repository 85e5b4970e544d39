"""A well-formed plugin: a control and a data transport named "fixture"."""

from __future__ import annotations

from typing import Any, ClassVar

from p2pkv.contracts import Capabilities, ControlTransport, DataTransport
from p2pkv.hookspecs import hookimpl

P2PKV_PLUGIN_API = 1


class FixtureControl(ControlTransport):
    name: ClassVar[str] = "fixture"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=False)


class FixtureData(DataTransport):
    name: ClassVar[str] = "fixture"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=False)


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    return [FixtureControl, FixtureData]
