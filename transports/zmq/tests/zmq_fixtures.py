"""Types of the zmq tests' fixtures, importable by name (a conftest is not).

``conftest.py`` builds the fixtures; test functions annotate their parameters with these.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Protocol

from p2pkv_zmq import ZmqControlTransport


class MakeTransport(Protocol):
    """The ``make_transport`` fixture: a transport on loopback, closed after the test."""

    def __call__(
        self,
        host: str = "127.0.0.1",
        port: int = 0,
        max_frame_bytes: int = 1 << 20,
        dp_rank: int = 0,
        options: Mapping[str, Any] | None = None,
        **kw: Any,
    ) -> ZmqControlTransport: ...
