"""Failure domains (issue 48, item 4): a lost peer makes its host suspect, and the quiet
sessions to its sibling ranks (the same host) are probed at once.

Memory transports on a fake clock; every node listens on 127.0.0.1, so all of a consumer's
peers are ranks of one host. A session is *lost* when its connection dies under it (closed
here through the tier's debug view, as a dead TCP connection would be reported). A probe is
not a death: a live sibling answers it and is warm again; a paused one fails it, its loads
then fail fast (``peer_dead``, no dial) until its backoff passes, and once it resumes it is
served again.
"""

from __future__ import annotations

from typing import Any

import pytest
from p2pkv.tiering.domains import PROBE_SHARE
from p2pkv.types import Outcome

HANDSHAKE = 10.0
"""The nodes' ``timeouts.handshake`` (the default)."""


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


def pd_load(h: Any, p: Any, c: Any, kv: str, job: int, nodes: list[Any]) -> Any:
    """A PD request from ``p`` to ``c``; the load's result."""
    pctx, cctx = p.producer_ctx(kv), c.consumer_ctx(kv, p)
    p.tier.on_new_request(pctx)
    c.tier.on_new_request(cctx)
    c.load(job, h.keys(kv, 1), [0], cctx)
    p.store(job + 1, h.keys(kv, 1), [3], pctx)
    h.pump_until(nodes, lambda: job in c.results)
    p.tier.on_request_finished(pctx)
    c.tier.on_request_finished(cctx)
    h.pump(nodes, 2)
    return c.results[job]


def ranks(h: Any, cluster: Any, n: int) -> tuple[Any, list[Any]]:
    """A consumer with a ready, quiet session to each of ``n`` ranks of one host."""
    c, rs = cluster(), [cluster() for _ in range(n)]
    for i, r in enumerate(rs):
        assert pd_load(h, r, c, f"warm{i}", 10 * i + 1, [c, *rs]).outcome is Outcome.DONE
    return c, rs


def test_a_lost_rank_gets_its_quiet_siblings_probed_and_live_ones_answer(
    h: Any,
    cluster: Any,
) -> None:
    c, rs = ranks(h, cluster, 4)
    c.tier.peer_connection(rs[0].address).close()  # rank 0 lost
    h.pump([c, *rs], 4)
    stats = c.tier.stats()
    assert stats["peers_suspected"] == 1 and stats["peers_probed"] == 3, stats
    h.pump_until([c, *rs], lambda: c.tier.stats()["sessions_ready"] == 3)
    assert pd_load(h, rs[2], c, "after", 100, [c, *rs]).outcome is Outcome.DONE


def test_a_paused_sibling_fails_its_probe_then_is_served_again_once_resumed(
    h: Any,
    cluster: Any,
) -> None:
    c, rs = ranks(h, cluster, 3)
    live, paused = [c, rs[0], rs[1]], rs[2]  # rank 2 stops ticking: paused
    c.tier.peer_connection(rs[0].address).close()
    h.pump(live, 4)
    c.clock.advance(HANDSHAKE * PROBE_SHARE + 0.1)  # past the probe's deadline
    h.pump(live, 4)
    assert c.tier.peer_connection(paused.address) is None
    ctx = c.consumer_ctx("while-paused", paused)
    c.tier.on_new_request(ctx)
    c.load(200, [b"k"], [0], ctx)
    c.collect()  # failed at once: backed off, nothing dialed
    assert c.outcome(200) is Outcome.PEER_DEAD and "peers.dial_backoff" in c.results[200].detail
    c.tier.on_request_finished(ctx)
    c.clock.advance(30)  # past the backoff; the rank resumes
    assert pd_load(h, paused, c, "resumed", 300, [c, *rs]).outcome is Outcome.DONE


def test_a_sibling_with_work_open_is_not_probed(h: Any, cluster: Any) -> None:
    c, rs = ranks(h, cluster, 2)
    ctx = c.consumer_ctx("open", rs[1])
    c.tier.on_new_request(ctx)
    c.load(50, h.keys("open", 1), [0], ctx)  # waits for its store: rank 1 works
    h.pump([c, *rs], 2)
    c.tier.peer_connection(rs[0].address).close()
    h.pump([c, *rs], 4)
    assert c.tier.stats()["peers_probed"] == 0
    pctx = rs[1].producer_ctx("open")
    rs[1].tier.on_new_request(pctx)
    rs[1].store(51, h.keys("open", 1), [2], pctx)
    h.pump_until([c, *rs], lambda: 50 in c.results)
    assert c.outcome(50) is Outcome.DONE


def test_a_producer_losing_a_consumer_never_probes_its_other_consumers(
    h: Any,
    cluster: Any,
) -> None:
    """A consumer's next fetch may be on its way when its session looks quiet here: a probe's
    bye would cross it (transports/zmq/tests/test_lost_peer_siblings.py has the crossing)."""
    p, lost, other = cluster(), cluster(), cluster()
    nodes = [p, lost, other]
    assert pd_load(h, p, lost, "lost", 1, nodes).outcome is Outcome.DONE
    assert pd_load(h, p, other, "other", 3, nodes).outcome is Outcome.DONE
    p.tier.peer_connection(lost.address).close()
    h.pump(nodes, 4)
    stats = p.tier.stats()
    assert stats["peers_suspected"] == 1 and stats["peers_probed"] == 0, stats
    assert stats["sessions_ready"] == 1, stats
    assert pd_load(h, p, other, "after", 5, nodes).outcome is Outcome.DONE
