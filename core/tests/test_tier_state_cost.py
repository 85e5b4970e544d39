"""An engine step that changes no gauge reports none (issue 47, the fixed cost per request).

``on_schedule_end`` runs once per engine step; the ``p2pkv_tier_state`` gauges change a few
times per request. Reporting only a change keeps the observers (Prometheus: three gauge sets)
off the steps between. Counted in calls, never timed.
"""

from __future__ import annotations

from typing import Any

from p2pkv.hookspecs import hookimpl
from p2pkv.registry import Registry
from p2pkv.tier import P2PTier
from p2pkv.types import Job, RequestContext

STEPS = 100
"""Idle engine steps counted."""


class Gauges:
    """Records every ``p2pkv_tier_state`` report."""

    P2PKV_PLUGIN_API = 1

    def __init__(self) -> None:
        self.reports: list[tuple[int, int, int]] = []

    @hookimpl
    def p2pkv_tier_state(self, in_flight_transfers: int, parked_stores: int, sessions: int) -> None:
        self.reports.append((in_flight_transfers, parked_stores, sessions))


def test_only_a_changed_gauge_is_reported(tier_harness: Any, cluster: Any) -> None:
    import p2pkv_memory.plugin as memory_plugin

    gauges = Gauges()
    reg = Registry.from_plugins([("memory", memory_plugin), ("gauges", gauges)])
    tier = P2PTier(
        tier_harness.config(), memoryview(bytearray(8 * 16)), 16, registry=reg, clock=cluster.clock
    )
    try:
        tier.on_schedule_end()
        assert gauges.reports == [(0, 0, 0)], "the first step reports"
        for _ in range(STEPS):
            tier.get_finished_jobs()
            tier.on_schedule_end()
        assert len(gauges.reports) == 1, "idle steps report nothing"
        ctx = RequestContext("p", {"remote_decoder": {"kv_request_id": "r"}})
        tier.on_new_request(ctx)
        tier.submit_store(Job(1, [b"a"], [0], False, ctx))
        for _ in range(STEPS):
            tier.on_schedule_end()
        assert gauges.reports == [(0, 0, 0), (0, 1, 0)], "a parked store is reported once"
    finally:
        tier.shutdown()
