"""The conformance kit over every transport the project publishes (skipped if not installed:
``missing_transport = "skip"``)."""

from __future__ import annotations

from p2pkv.testing.suites import ControlTransportSuite, DataIsolationSuite, DataTransportSuite


class TestMemoryControl(ControlTransportSuite):
    transport_name = "memory"
    missing_transport = "skip"
    options = {"max_connections": 64}  # so that it reports its session room


class TestMemoryData(DataTransportSuite):
    transport_name = "memory"
    missing_transport = "skip"


class TestZmqControl(ControlTransportSuite):
    transport_name = "zmq"
    missing_transport = "skip"
    options = {"heartbeat_interval": 0.2, "heartbeat_timeout": 1.0, "heartbeat_ttl": 1.0}
    liveness_timeout = 5.0


class TestNixlData(DataTransportSuite):
    transport_name = "nixl"
    missing_transport = "skip"
    options = {"drain_timeout": 1.0, "slice_bytes": 768}  # bounds dead-peer tests; 3-block slices


class TestUcxData(DataTransportSuite):
    transport_name = "ucx"
    missing_transport = "skip"
    options = {"drain_timeout": 1.0, "slice_bytes": 768}


class TestUcxTcpIsolation(DataIsolationSuite):
    """The isolation checks over ucx on tcp (a frozen peer's runs stay half received) with a
    staging budget of two blocks, which the frozen peer's reads could fill."""

    transport_name = "ucx"
    missing_transport = "skip"
    options = {
        "drain_timeout": 1.0,
        "staging_bytes": 512,
        "max_message_bytes": 256,
        "ucx_config": {"TLS": "tcp", "RNDV_THRESH": "128"},
    }


class TestNixlStagedIsolation(DataIsolationSuite):
    """The isolation checks over nixl's staged lane with a pool of four blocks, which the
    frozen peer's reads could fill (the tier's read gate shares it)."""

    transport_name = "nixl"
    missing_transport = "skip"
    options = {"drain_timeout": 1.0, "staging": "always", "staging_blocks": 4}
