"""Fixtures of the ucx transport tests: in-process transports that are always closed.

This directory goes on ``sys.path`` (which ``multiprocessing`` hands to spawned children), so
``ucx_helpers`` and ``ucx_programs`` import by name here and in children.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

_HERE = str(Path(__file__).parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
os.environ.setdefault("UCX_NET_DEVICES", "lo")

from ucx_helpers import Node  # noqa: E402


@pytest.fixture
def nodes() -> Iterator[Callable[..., Node]]:
    made: list[Node] = []

    def make(**kw: Any) -> Node:
        node = Node(**kw)
        made.append(node)
        return node

    yield make
    for node in made:
        node.t.close()
