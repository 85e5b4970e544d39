"""The p2pkv conformance kit against the ``ucx`` transport (real ucxx, same and child process)."""

from __future__ import annotations

from p2pkv.testing.suites import DataTransportSuite
from p2pkv_ucx import UcxDataTransport


class TestUcxConformance(DataTransportSuite):
    transport = UcxDataTransport
    options = {"transfer_timeout": 10.0, "drain_timeout": 1.0}


class TestUcxConformanceWithoutErrorHandling(DataTransportSuite):
    """The fast mode (CMA, no UCX peer-failure handling) must keep the same contract."""

    transport = UcxDataTransport
    options = {"transfer_timeout": 10.0, "drain_timeout": 1.0, "endpoint_error_handling": False}
