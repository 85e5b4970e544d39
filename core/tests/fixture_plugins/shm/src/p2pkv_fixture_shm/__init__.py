"""A plugin whose entry point is named like its data transport ("fixture_shm"), as a
third-party transport's often is, with ``p2pkv doctor`` checks: one passes, one fails, one
raises."""

from __future__ import annotations

from typing import Any, ClassVar

from p2pkv.contracts import Capabilities, DataTransport
from p2pkv.hookspecs import CheckResult, DoctorCheck, hookimpl

P2PKV_PLUGIN_API = 1


class FixtureShmData(DataTransport):
    name: ClassVar[str] = "fixture_shm"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=False)


@hookimpl
def p2pkv_transports() -> list[type[Any]]:
    return [FixtureShmData]


def _raises() -> CheckResult:
    raise RuntimeError("fixture check bug (on purpose)")


@hookimpl
def p2pkv_doctor_checks() -> list[DoctorCheck]:
    return [
        DoctorCheck("fixture passes", lambda: CheckResult(True, "all good")),
        DoctorCheck("fixture fails", lambda: CheckResult(False, "set FIXTURE=1 to fix it")),
        DoctorCheck("fixture raises", _raises),
    ]
