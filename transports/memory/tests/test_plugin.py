"""``p2pkv-memory`` registers core's reference transports under the name ``memory``."""

from __future__ import annotations

import p2pkv_memory
from p2pkv import reference
from p2pkv.registry import default_registry


def test_the_entry_point_registers_the_reference_transports_as_memory() -> None:
    registry = default_registry()
    assert registry.transport("control", "memory") is reference.MemoryControlTransport
    assert registry.transport("data", "memory") is reference.MemoryDataTransport


def test_the_plugin_reexports_the_reference_backend() -> None:
    assert p2pkv_memory.__all__ == reference.__all__
    assert all(getattr(p2pkv_memory, n) is getattr(reference, n) for n in reference.__all__)
