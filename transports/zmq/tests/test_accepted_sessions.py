"""Accepted sessions at a producer whose zmq context runs out of sockets (issue 48).

A producer accepts one session per consumer, and answers each by dialing it back: a PUSH,
its monitor and libzmq's end of that monitor, three sockets of ``max_sockets``.
``peers.max_dialed`` does not count them. Here the producer's context has 40 sockets: 4
of its own (listener, its monitor) and room for 12 accepted sessions. A 13th consumer
then arrives. What each side sees today, over real zmq:

- the newcomer's load fails ``peer_dead``, "closed by the peer": no reason names the cap,
  and its producer's store waits for ``timeouts.unbound_store``;
- the producer logs one WARNING naming ``ZMQ_MAX_SOCKETS``, whose hint (``peers.max_dialed``)
  is no fix for accepted sessions;
- established sessions go on: a second request on each is served, byte-exact.

docs/scale.md ("Accepted sessions and the socket cap") has the finding and what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from p2pkv.testing.waiting import wait_until
from p2pkv.types import Outcome
from zmq_tiers import Peer, T, contexts, run_request, tick

MAX_SOCKETS = 40
FITS = 12
"""Accepted sessions that fit: (40 - 4 of the producer's own) / 3."""


@pytest.fixture
def fleet() -> Iterator[tuple[Peer, list[Peer]]]:
    producer = Peer(0, control_options={"max_sockets": MAX_SOCKETS})
    consumers = [Peer(1 + i) for i in range(FITS + 1)]
    yield producer, consumers
    for peer in (producer, *consumers):
        peer.tier.shutdown()


def test_a_consumer_past_the_socket_cap_is_refused_and_established_ones_go_on(
    fleet: tuple[Peer, list[Peer]], caplog: pytest.LogCaptureFixture
) -> None:
    producer, consumers = fleet
    established, newcomer = consumers[:FITS], consumers[FITS]
    for i, consumer in enumerate(established):
        run_request(producer, consumer, f"first-{i}", [i % 8], consumer_first=False)
    assert producer.tier.stats()["sessions_ready"] == FITS

    caplog.set_level(logging.WARNING, logger="p2pkv.zmq.hub")
    pctx, cctx = contexts("late", producer)
    producer.tier.on_new_request(pctx)
    newcomer.tier.on_new_request(cctx)
    producer.job(1, [b"late/0"], [0], load=False, ctx=pctx)
    newcomer.job(2, [b"late/0"], [9], load=True, ctx=cctx)
    wait_until(
        lambda: 2 in newcomer.results,
        timeout=T,
        what="the newcomer's load",
        pumps=[tick(producer, newcomer)],
    )
    result = newcomer.results[2]
    assert result.outcome is Outcome.PEER_DEAD and "closed by the peer" in result.detail
    refusals = [r.getMessage() for r in caplog.records if "refused connections" in r.message]
    assert len(refusals) == 1 and f"ZMQ_MAX_SOCKETS = {MAX_SOCKETS}" in refusals[0]
    assert 1 not in producer.results  # the store waits for timeouts.unbound_store

    for i, consumer in enumerate(established):
        run_request(producer, consumer, f"again-{i}", [1 + i % 8], consumer_first=False)
    assert producer.tier.stats()["sessions_ready"] == FITS
    producer.tier.on_request_finished(pctx)
    newcomer.tier.on_request_finished(cctx)
