"""The conformance kit over every transport the project publishes (skipped if not installed)."""

from __future__ import annotations

import pytest
from p2pkv.testing.suites import ControlTransportSuite, DataTransportSuite

MEMORY_EARLY_ACCEPT = pytest.mark.xfail(
    strict=False,
    reason="p2pkv-memory returns an inbound connection from poll before its first frame",
)


class TestMemoryControl(ControlTransportSuite):
    transport_name = "memory"

    @MEMORY_EARLY_ACCEPT
    def test_inbound_connection_is_returned_once_with_its_first_frames(self, pair):  # type: ignore[no-untyped-def]
        super().test_inbound_connection_is_returned_once_with_its_first_frames(pair)


class TestMemoryData(DataTransportSuite):
    transport_name = "memory"

    @pytest.mark.xfail(
        strict=False,
        reason="p2pkv-memory keeps its (num_blocks, block_len) view of the region after close()",
    )
    def test_close_is_idempotent_and_releases_the_region(self, pair):  # type: ignore[no-untyped-def]
        super().test_close_is_idempotent_and_releases_the_region(pair)


class TestZmqControl(ControlTransportSuite):
    transport_name = "zmq"
    options = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "heartbeat_ttl": 1.0}
    liveness_timeout = 5.0


class TestNixlData(DataTransportSuite):
    transport_name = "nixl"
    options = {"drain_timeout": 1.0}  # bounds the dead-peer tests


class TestUcxData(DataTransportSuite):
    transport_name = "ucx"
    options = {"drain_timeout": 1.0}
