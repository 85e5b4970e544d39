"""Fixtures of the ucx transport tests: in-process transports that are always closed.

This directory is on ``sys.path`` (pytest's ``pythonpath``, root pyproject.toml; spawned
children inherit it), so ``ucx_helpers`` and ``ucx_programs`` import by name here and in
children.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from ucx_helpers import Node

os.environ.setdefault("UCX_NET_DEVICES", "lo")


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
