"""In-process ``memory`` transports for p2pkv and a :class:`FaultInjector` for any transport.

The memory transports are real, documented transports for single-process deployments and for
protocol tests; they register through the ``p2pkv`` entry-point group like any plugin.
"""

from __future__ import annotations

from p2pkv_memory.control import MemoryConnection, MemoryControlTransport
from p2pkv_memory.data import MemoryDataTransport
from p2pkv_memory.faults import Fault, FaultInjector, FaultRule

__all__ = [
    "Fault",
    "FaultInjector",
    "FaultRule",
    "MemoryConnection",
    "MemoryControlTransport",
    "MemoryDataTransport",
]
