"""Entry point of ``p2pkv-example-loopback`` (group ``p2pkv``, name ``loopback``).

``P2PKV_TEST_ONLY``: this distribution is a test fixture, so the registry hides it from what a
user runs (``p2pkv plugins``, ``doctor``, ``bench``) unless ``P2PKV_TEST_PLUGINS=1`` is set
or the process runs under pytest.
"""

from __future__ import annotations

from typing import Any

from p2pkv import hookimpl

P2PKV_PLUGIN_API = 1
P2PKV_TEST_ONLY = True


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    from p2pkv_loopback.control import LoopbackControlTransport
    from p2pkv_loopback.data import LoopbackDataTransport

    return [LoopbackControlTransport, LoopbackDataTransport]
