"""Example p2pkv plugin: in-process ``loopback`` control and data transports."""

from __future__ import annotations

from p2pkv_loopback.control import LoopbackConnection, LoopbackControlTransport
from p2pkv_loopback.data import LoopbackDataTransport

__all__ = ["LoopbackConnection", "LoopbackControlTransport", "LoopbackDataTransport"]
