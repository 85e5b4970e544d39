"""Accepted sessions at a producer whose zmq context runs out of sockets (issue 48).

A producer accepts one session per consumer, and answers each by dialing it back: a PUSH,
its monitor and libzmq's end of that monitor, three sockets of ``max_sockets``.
``peers.max_dialed`` does not count them. 13 consumers load from one producer, over real zmq:

- with ``max_sockets`` unset, the cap is derived from ``ulimit -n`` (``p2pkv_zmq.socket_cap``,
  at least libzmq's 1,023): all 13 are served;
- with an explicit cap of 40 (4 of the producer's own, room for 12 accepted sessions), the
  13th is refused. Its load fails ``peer_dead`` with a reason naming the likely cause
  (``pairing.REFUSED``), or on a busy host without it (the notice that carries it found no
  socket in time), and its producer's store waits for ``timeouts.unbound_store``.
  The producer logs one WARNING naming ``ZMQ_MAX_SOCKETS`` and where the cap came from.
  Established sessions go on: a second request on each is served, byte-exact.

docs/scale.md ("Accepted sessions and the socket cap") has the finding and what is left.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from p2pkv.testing.waiting import wait_until
from p2pkv.types import Outcome
from p2pkv_zmq.pairing import REFUSED
from p2pkv_zmq.socket_cap import socket_cap
from zmq_tiers import Peer, T, contexts, run_request, tick

MAX_SOCKETS = 40
FITS = 12
"""Accepted sessions that fit: (40 - 4 of the producer's own) / 3."""
PATIENCE = 60.0
"""The consumers' ``timeouts.handshake``: on a busy host the refusal may take longer than
the default 10 s to come back, and a handshake timeout would hide it."""


@contextmanager
def fleet(**control_options: int) -> Iterator[tuple[Peer, list[Peer]]]:
    """A producer with ``control_options`` and 13 consumers, all shut down after."""
    producer = Peer(0, control_options=control_options)
    consumers = [Peer(1 + i, timeouts={"handshake": PATIENCE}) for i in range(FITS + 1)]
    try:
        yield producer, consumers
    finally:
        for peer in (producer, *consumers):
            peer.tier.shutdown()


def test_with_a_derived_cap_every_consumer_is_served(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv.zmq.hub")
    with fleet() as (producer, consumers):
        hub = producer.tier._control._hub  # type: ignore[attr-defined]
        assert hub._sockets.cap == socket_cap(None)
        assert hub._sockets.cap.value >= 1023 > 3 * len(consumers) + 4
        for i, consumer in enumerate(consumers):
            run_request(producer, consumer, f"first-{i}", [i % 8], consumer_first=False)
        assert producer.tier.stats()["sessions_ready"] == len(consumers)
    assert not [r for r in caplog.records if "refused" in r.message]


def test_past_an_explicit_cap_the_newcomer_is_refused_and_established_ones_go_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with fleet(max_sockets=MAX_SOCKETS) as (producer, consumers):
        refused_and_established_go_on(producer, consumers, caplog)


def refused_and_established_go_on(
    producer: Peer, consumers: list[Peer], caplog: pytest.LogCaptureFixture
) -> None:
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
        timeout=PATIENCE + T,
        what="the newcomer's load",
        pumps=[tick(producer, newcomer)],
    )
    result = newcomer.results[2]
    # The reason rides a "gone" notice, which needs a socket of the full context: it gets
    # one once libzmq has reaped the failed dial's. On a busy host that may come too late.
    told = result.outcome is Outcome.PEER_DEAD and REFUSED in result.detail
    assert told or result.outcome in (Outcome.PEER_DEAD, Outcome.LOAD_TIMEOUT), result
    assert "control_options.max_sockets" in REFUSED
    refusals = [
        r.getMessage()
        for r in caplog.records
        if r.name == "p2pkv.zmq.hub" and "refused connections" in r.message
    ]
    assert len(refusals) == 1 and f"ZMQ_MAX_SOCKETS = {MAX_SOCKETS}" in refusals[0]
    assert f"its cap, {MAX_SOCKETS}, is set by control_options.max_sockets" in refusals[0]
    assert 1 not in producer.results  # the store waits for timeouts.unbound_store

    for i, consumer in enumerate(established):
        run_request(producer, consumer, f"again-{i}", [1 + i % 8], consumer_first=False)
    assert producer.tier.stats()["sessions_ready"] == FITS
    producer.tier.on_request_finished(pctx)
    newcomer.tier.on_request_finished(cctx)
