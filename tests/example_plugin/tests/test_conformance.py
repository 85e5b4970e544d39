"""The subclass route: the whole conformance kit in ten lines."""

from p2pkv.testing.suites import ControlTransportSuite, DataTransportSuite
from p2pkv_loopback import LoopbackControlTransport, LoopbackDataTransport


class TestLoopbackControl(ControlTransportSuite):
    transport = LoopbackControlTransport


class TestLoopbackData(DataTransportSuite):
    transport = LoopbackDataTransport
