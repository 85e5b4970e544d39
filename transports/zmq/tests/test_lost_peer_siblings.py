"""A lost peer never costs its host's other peers a request (found by the chaos suite's
frozen-consumer test, nixl lane, once in CI).

A producer that loses one consumer makes that consumer's host suspect. Its other consumers
on the host looked quiet from the producer's side between two of their loads, so they were
probed: closed with a bye and dialed again. A consumer's fetch already on its way crossed
that bye, reached a connection that had ended, and its load failed ``peer_dead`` ("closed by
the peer") while the producer's store waited out its unbound timeout. Now a session whose
peer ever asked us for blocks is never probed, so a producer never probes its consumers.

Real zmq control between three tiers of one process on 127.0.0.1 (one host), memory data.
"""

from __future__ import annotations

from p2pkv.testing.waiting import wait_until
from p2pkv.types import Outcome
from zmq_tiers import NUM_BLOCKS, Peer, T, contexts, run_request, tick


def test_a_producer_losing_one_consumer_serves_the_fetch_another_has_on_its_way() -> None:
    p, lost, healthy = Peer(1), Peer(2), Peer(3)
    try:
        run_request(p, lost, "warm-lost", [1], consumer_first=False)
        run_request(p, healthy, "warm-healthy", [2], consumer_first=False)
        pctx, cctx = contexts("crossing", p)
        p.tier.on_new_request(pctx)
        healthy.tier.on_new_request(cctx)
        keys = [b"crossing/0"]
        p.job(500, keys, [5], load=False, ctx=pctx)  # producer first: parked
        tick(p, healthy)()
        healthy.job(600, keys, [NUM_BLOCKS - 6], load=True, ctx=cctx)  # its fetch is sent
        connection = p.tier.peer_connection(lost.tier.local_address)
        assert connection is not None
        connection.close()  # the other consumer's connection dies before P reads the fetch
        wait_until(
            lambda: 500 in p.results and 600 in healthy.results,
            timeout=T,
            what="both results of the crossing request",
            pumps=[tick(p, healthy)],
        )
        assert healthy.results[600].outcome is Outcome.DONE, healthy.results[600]
        assert p.results[500].outcome is Outcome.DONE, p.results[500]
        assert (healthy.blocks[NUM_BLOCKS - 6] == p.blocks[5]).all()
        stats = p.tier.stats()
        assert stats["peers_suspected"] == 1 and stats["peers_probed"] == 0, stats
        p.tier.on_request_finished(pctx)
        healthy.tier.on_request_finished(cctx)
        run_request(p, healthy, "after", [3], consumer_first=False)
    finally:
        for peer in (p, lost, healthy):
            peer.tier.shutdown()
