"""Shutdown winds sessions down before closing them (docs/protocol.md §10).

A tier shutting down aborts its loads and waits for the producer's confirmation, and stops
its writes and fails their rounds once they ended, all before ``bye``; its region is
deregistered only after that. One thread drives both tiers: the shutting-down tier's data
``progress()`` ticks the other one, so the peer answers while ``shutdown`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
from p2pkv.types import Outcome


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


class Watched:
    """A node's data transport, logging ``(name, "ended", id)`` and ``(name, "close")`` into a
    shared list and running ``on_progress`` after each ``progress()``."""

    def __init__(self, node: Any, name: str, events: list[tuple[Any, ...]],
                 on_progress: Callable[[], object] | None = None) -> None:
        self.inner, self.name, self.events, self.on_progress = node.data, name, events, on_progress
        node.data = node.tier._data = node.tier._env.data = self

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.inner, attr)

    def progress(self) -> None:
        self.inner.progress()
        if self.on_progress is not None:
            self.on_progress()

    def poll(self, peer_id: str | None = None) -> Any:
        res = self.inner.poll(peer_id)
        self.events.extend((self.name, "ended", t) for t in [*res.done, *res.failed])
        return res

    def close(self) -> list[int]:
        self.events.append((self.name, "close"))
        return list(self.inner.close())


SLOW_WRITES = {"completion_polls": 8, "wait_cancel_refuses": True}
"""Writes stay in flight for 8 polls and a wait-cancel cannot stop them."""


def write_in_flight(h: Any, p: Any, c: Any) -> None:
    """Consumer-first request ``r``: load 1 into slots 0-1, then store 2 whose write is held."""
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.load(1, h.keys("r", 2), [0, 1], cctx)
    h.pump_until([p, c], lambda: p.tier._state_sizes()["demand"] == 2)
    p.store(2, h.keys("r", 2), [4, 5], pctx)
    p.tier.tick()
    assert p.tier.stats()["in_flight_transfers"] == 1


def writes_ended_before_close(events: list[tuple[Any, ...]], writer: str, closer: str) -> bool:
    """Every write ``writer`` made had ended when ``closer`` closed its data transport."""
    ended = [i for i, e in enumerate(events) if e[:2] == (writer, "ended")]
    return bool(ended) and ended[-1] < events.index((closer, "close"))


def test_consumer_releases_its_region_only_after_the_producer_confirms(
        h: Any, cluster: Any) -> None:
    p, c = cluster(data_options=SLOW_WRITES), cluster()
    events: list[tuple[Any, ...]] = []
    Watched(p, "P", events)
    Watched(c, "C", events, on_progress=p.collect)
    write_in_flight(h, p, c)
    c.shutdown()
    assert writes_ended_before_close(events, "P", "C"), events
    assert c.outcome(1) is Outcome.SHUTDOWN
    h.pump_until([p], lambda: 2 in p.results)


def test_producer_confirms_before_bye_so_the_consumer_fences_nothing(
        h: Any, cluster: Any) -> None:
    p, c = cluster(data_options=SLOW_WRITES), cluster()
    events: list[tuple[Any, ...]] = []
    Watched(p, "P", events, on_progress=c.collect)
    write_in_flight(h, p, c)
    p.shutdown()
    h.pump_until([c], lambda: 1 in c.results)
    assert c.outcome(1) is Outcome.PEER_DEAD
    assert "the producer is shutting down" in c.results[1].detail
    assert c.tier.stats()["fences"] == 0  # confirmed: no slot is held against the producer
    assert p.outcome(2) is Outcome.SHUTDOWN
    assert writes_ended_before_close(events, "P", "P"), events


def test_a_fetch_during_wind_down_fails_at_once(h: Any, cluster: Any) -> None:
    p, c, late = cluster(data_options=SLOW_WRITES), cluster(), cluster()
    pctx0, lctx0 = p.producer_ctx("r0"), late.consumer_ctx("r0", p)
    p.store(10, h.keys("r0", 1), [8], pctx0)
    late.load(11, h.keys("r0", 1), [8], lctx0)
    h.pump_until([p, late], lambda: 11 in late.results)  # a ready session between them
    stopping: list[bool] = []

    def late_asks() -> None:
        if stopping == [True]:
            stopping.append(True)
            late.load(12, h.keys("q", 1), [3], late.consumer_ctx("q", p))
        late.collect()
        c.collect()

    Watched(p, "P", [], on_progress=late_asks)
    write_in_flight(h, p, c)
    stopping.append(True)
    p.shutdown()
    h.pump_until([late], lambda: 12 in late.results)
    assert late.outcome(12) is Outcome.PEER_DEAD
    assert "the producer is shutting down" in late.results[12].detail
