"""Shutdown winds sessions down before closing them (docs/protocol.md §10).

A consumer shutting down cancels its reads (final) before anything else, so its region is
deregistered with no read into it live; a producer shutting down fails its peers' rounds and
keeps the blocks it offered pinned until the consumer released them (bounded by the drain
budget). One thread drives both tiers: the shutting-down tier's data ``progress()`` ticks the
other one, so the peer answers while ``shutdown`` runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from p2pkv.testing import harness as h
from p2pkv.types import Outcome


class Watched:
    """A node's data transport, logging ``(name, "cancel"|"ended", id)`` and
    ``(name, "close")`` into a shared list and running ``on_progress`` after each
    ``progress()``."""

    def __init__(
        self,
        node: h.Node,
        name: str,
        events: list[tuple[Any, ...]],
        on_progress: Callable[[], object] | None = None,
    ) -> None:
        self.inner, self.name, self.events, self.on_progress = node.data, name, events, on_progress
        # A duck-typed stand-in (attribute access falls through to the real transport).
        node.data = node.tier._data = node.tier._env.data = self  # type: ignore[assignment]

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

    def cancel(self, ids: Any) -> None:
        self.events.extend((self.name, "cancel", t) for t in ids)
        self.inner.cancel(ids)

    def close(self) -> list[int]:
        self.events.append((self.name, "close"))
        return list(self.inner.close())


SLOW_READS = {"completion_polls": 8}
"""Reads stay in flight for 8 polls."""


def read_in_flight(p: h.Node, c: h.Node) -> None:
    """Consumer-first request ``r``: load 1 into slots 0-1, then store 2; the consumer's read
    of it is in flight."""
    pctx, cctx = p.producer_ctx("r"), c.consumer_ctx("r", p)
    p.tier.on_new_request(pctx)
    c.load(1, h.keys("r", 2), [0, 1], cctx)
    h.pump_until([p, c], lambda: p.tier.state_sizes()["demand"] == 2)
    p.store(2, h.keys("r", 2), [4, 5], pctx)
    p.tier.tick()
    c.tier.tick()
    assert c.tier.stats()["in_flight_transfers"] == 1


def test_consumer_cancels_its_reads_before_releasing_its_region(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster(data_options=SLOW_READS)
    events: list[tuple[Any, ...]] = []
    Watched(c, "C", events, on_progress=p.collect)
    read_in_flight(p, c)
    before = c.blocks[0:2].copy()
    c.shutdown()
    kinds = [e[1] for e in events]
    assert "cancel" in kinds and kinds.index("cancel") < kinds.index("close"), events
    assert "ended" not in kinds  # a cancelled read is never reported
    assert c.outcome(1) is Outcome.SHUTDOWN
    assert (c.blocks[0:2] == before).all()
    h.pump_until([p], lambda: 2 in p.results)
    assert p.outcome(2) is Outcome.ABORTED  # released unread


def test_producer_keeps_its_pins_until_the_consumer_released_them(cluster: h.Cluster) -> None:
    p, c = cluster(), cluster(data_options=SLOW_READS)
    events: list[tuple[Any, ...]] = []
    Watched(c, "C", events)
    Watched(p, "P", events, on_progress=c.collect)
    read_in_flight(p, c)
    p.shutdown()
    assert 1 in c.results and c.outcome(1) is Outcome.PEER_DEAD
    assert "the producer is shutting down" in c.results[1].detail
    assert p.outcome(2) is Outcome.ABORTED  # its pin ended with the consumer's release
    kinds = [e[:2] for e in events]
    assert kinds.index(("C", "cancel")) < kinds.index(("P", "close")), events
    assert p.tier.state_sizes()["pins"] == 0


def test_a_fetch_during_wind_down_fails_at_once(cluster: h.Cluster) -> None:
    p, c, late = cluster(), cluster(data_options=SLOW_READS), cluster()
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

    Watched(p, "P", [], on_progress=late_asks)
    read_in_flight(p, c)
    stopping.append(True)
    p.shutdown()
    h.pump_until([late], lambda: 12 in late.results)
    assert late.outcome(12) is Outcome.PEER_DEAD
    assert "the producer is shutting down" in late.results[12].detail
