"""The reference backend: in-process ``memory`` transports and a :class:`FaultInjector`.

The memory control and data transports are real, documented transports for
single-process deployments and for protocol tests; ``FaultInjector`` wraps any pair of
transports and injects drops, delays, kills and failed transfers. They live in core so the
conformance kit (:mod:`p2pkv.testing`) and core's own tests use them without a plugin; the
``p2pkv-memory`` distribution registers the two transports under the name ``memory``
through the ``p2pkv`` entry-point group, like any transport plugin, and re-exports these
names.
"""

from __future__ import annotations

from p2pkv.reference.control import MemoryConnection, MemoryControlTransport
from p2pkv.reference.data import MemoryDataTransport
from p2pkv.reference.faults import Fault, FaultInjector, FaultRule

__all__ = [
    "Fault",
    "FaultInjector",
    "FaultRule",
    "MemoryConnection",
    "MemoryControlTransport",
    "MemoryDataTransport",
]
