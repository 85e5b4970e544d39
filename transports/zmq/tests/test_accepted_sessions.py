"""Accepted sessions at a producer whose zmq context runs out of sockets (issue 48).

A producer accepts one session per consumer, and answers each by dialing it back: a PUSH,
its monitor and libzmq's end of that monitor, three sockets of ``max_sockets``.
``peers.max_dialed`` does not count them. 13 consumers load from one producer, over real zmq:

- with ``max_sockets`` unset, the cap is derived from ``ulimit -n`` (``p2pkv_zmq.socket_cap``,
  at least libzmq's 1,023): all 13 are served, and nothing gives way;
- with an explicit cap of 40, the transport reports room for 8 sessions (after 16 sockets
  of its own; ``session_room``), and the tier keeps one of them free
  (:mod:`p2pkv.tiering.accept_room`): idle accepted sessions give way, least recently
  active first, and all 13 consumers are served, the first again after it gave way;
- with the same cap and 12 sessions working (loads waiting for their stores: libzmq holds
  12 with the producer's 4 own sockets), the 13th is refused and counted
  (``peers_accept_refused``). Its load fails ``peer_dead`` with a reason naming the likely
  cause (``pairing.REFUSED``), or on a busy host without it (the notice that carries it
  found no socket in time). The producer logs one WARNING naming ``ZMQ_MAX_SOCKETS`` and
  where the cap came from. The working sessions go on, byte-exact; once they are idle the
  reserve comes back, and the refused consumer is served.

docs/scale.md ("Accepted sessions and the socket cap") has the finding and the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
from p2pkv.testing.waiting import wait_until
from p2pkv.types import JobResult, Outcome
from p2pkv_zmq.pairing import REFUSED
from p2pkv_zmq.socket_cap import OWN_SOCKETS, SOCKETS_PER_SESSION, socket_cap
from zmq_tiers import Peer, T, contexts, run_request, tick

MAX_SOCKETS = 40
FITS = 12
"""Sessions libzmq holds under the cap of 40: (40 - 4 of the producer's own) / 3."""
ROOM = (MAX_SOCKETS - OWN_SOCKETS) // SOCKETS_PER_SESSION
"""Sessions the transport reports it holds (it counts 16 sockets of its own: notices in
flight included), one of them kept free."""
PATIENCE = 60.0
"""The consumers' ``timeouts.handshake``: on a busy host the refusal may take longer than
the default 10 s to come back, and a handshake timeout would hide it. Loads may take four
times as long, on both sides: the working sessions' loads wait for their stores until the
refusal is in, and the producer's lease (its ``timeouts.load`` and a margin, counted by each
consumer from its fetch) must outlast that wait."""


@contextmanager
def fleet(**control_options: int) -> Iterator[tuple[Peer, list[Peer]]]:
    """A producer with ``control_options`` and 13 consumers, all shut down after."""
    timeouts = {"handshake": PATIENCE, "load": 4 * PATIENCE}  # working loads outwait a refusal
    producer = Peer(0, control_options=control_options, timeouts=timeouts)  # and its lease
    consumers = [Peer(1 + i, timeouts=timeouts) for i in range(FITS + 1)]
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
        stats = producer.tier.stats()
        assert stats["sessions_ready"] == stats["peers_accepted"] == len(consumers), stats
        assert stats["peers_accepted_gave_way"] == stats["peers_accept_refused"] == 0, stats
    assert not [r for r in caplog.records if "refused" in r.message]


def test_past_an_explicit_cap_idle_sessions_give_way_and_every_consumer_is_served() -> None:
    with fleet(max_sockets=MAX_SOCKETS) as (producer, consumers):
        assert ROOM == 8 and producer.tier.stats()["sessions_free"] == ROOM
        for i, consumer in enumerate(consumers):
            reserve_kept(producer, consumers)
            run_request(producer, consumer, f"first-{i}", [i % 8], consumer_first=False)
        reserve_kept(producer, consumers)
        stats = producer.tier.stats()
        assert stats["peers_accepted"] == len(consumers) and stats["sessions"] == ROOM - 1
        assert stats["peers_accepted_gave_way"] == len(consumers) - (ROOM - 1), stats
        assert stats["peers_accept_refused"] == 0, stats
        first = consumers[0]  # the least recently active gave way first; it dials again
        assert first.tier.peer_connection(producer.tier.local_address) is None
        run_request(producer, first, "again", [3], consumer_first=False)


def reserve_kept(producer: Peer, consumers: list[Peer]) -> None:
    """Tick everyone until the producer has a session free (idle ones gave way)."""
    wait_until(
        lambda: producer.tier.stats()["sessions_free"] >= 1,
        timeout=T,
        what="a free session at the producer",
        pumps=[tick(producer, *consumers)],
    )


def test_past_an_explicit_cap_with_every_session_working_the_newcomer_is_refused(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with fleet(max_sockets=MAX_SOCKETS) as (producer, consumers):
        working, newcomer = consumers[:FITS], consumers[FITS]
        waiting = [start_load(producer, consumer, f"w{i}", i) for i, consumer in enumerate(working)]
        wait_until(
            lambda: producer.tier.stats()["sessions_ready"] == FITS,
            timeout=T,
            what="the working sessions",
            pumps=[tick(producer, *working)],
        )
        caplog.set_level(logging.WARNING, logger="p2pkv.zmq.hub")
        pctx, cctx = start_load(producer, newcomer, "late", FITS)
        wait_until(  # every tier ticks: one left unticked for a minute is a paused peer
            lambda: 2 * FITS in newcomer.results,
            timeout=PATIENCE + T,
            what="the newcomer's load",
            pumps=[tick(producer, *consumers)],
        )
        refused(newcomer.results[2 * FITS], producer, caplog)
        for i, (wctx, _) in enumerate(waiting):
            producer.job(i, [f"w{i}/0".encode()], [i], load=False, ctx=wctx)
        wait_until(
            lambda: all(FITS + i in c.results for i, c in enumerate(working)),
            timeout=T,
            what="the working sessions' loads",
            pumps=[tick(producer, *consumers)],
        )
        for i, (consumer, (wctx, cwctx)) in enumerate(zip(working, waiting, strict=True)):
            assert consumer.results[FITS + i].outcome is Outcome.DONE
            assert (consumer.blocks[FITS + i] == producer.blocks[i]).all()
            producer.tier.on_request_finished(wctx)
            consumer.tier.on_request_finished(cwctx)
        producer.tier.on_request_finished(pctx)
        newcomer.tier.on_request_finished(cctx)
        reserve_kept(producer, consumers)
        run_request(producer, newcomer, "again", [5], consumer_first=False, timeout=PATIENCE)


def start_load(producer: Peer, consumer: Peer, kv: str, i: int) -> tuple[Any, Any]:
    """A PD request whose consumer loads block ``i`` into slot ``FITS + i`` (job
    ``FITS + i``) before its producer stores anything: its sessions work until the store."""
    pctx, cctx = contexts(kv, producer)
    producer.tier.on_new_request(pctx)
    consumer.tier.on_new_request(cctx)
    consumer.job(FITS + i, [f"{kv}/0".encode()], [FITS + i], load=True, ctx=cctx)
    return pctx, cctx


def refused(result: JobResult, producer: Peer, caplog: pytest.LogCaptureFixture) -> None:
    """``result`` is a refused dial's, counted and logged once by the producer."""
    # The reason rides a "gone" notice, which needs a socket of the full context: it gets
    # one once libzmq has reaped the failed dial's. On a busy host that may come too late.
    told = result.outcome is Outcome.PEER_DEAD and REFUSED in result.detail
    assert told or result.outcome in (Outcome.PEER_DEAD, Outcome.LOAD_TIMEOUT), result
    assert "control_options.max_sockets" in REFUSED
    assert producer.tier.stats()["peers_accept_refused"] >= 1
    refusals = [
        r.getMessage()
        for r in caplog.records
        if r.name == "p2pkv.zmq.hub" and "refused connections" in r.message
    ]
    assert len(refusals) == 1 and f"ZMQ_MAX_SOCKETS = {MAX_SOCKETS}" in refusals[0]
    assert f"its cap, {MAX_SOCKETS}, is set by control_options.max_sockets" in refusals[0]
