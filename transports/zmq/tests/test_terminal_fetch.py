"""The terminal fetch rides the next frame to its producer: a pull costs the consumer two
pushes to libzmq, not three.

A PD pull sends four control frames: the consumer's ``fetch``, the producer's ``ready``, the
consumer's ``release`` and, once the engine finished the request, its terminal ``fetch``. The
terminal one is cleanup no peer waits on. It no longer asks for a flush of its own: it leaves
with the next frame the consumer sends, or at the consumer's next tick (the zmq ``poll``
flushes first). These tests count pushes and frames (work, never time) and check the bound.
"""

from __future__ import annotations

from collections.abc import Callable

from p2pkv.addressing import format_address
from p2pkv.testing.waiting import wait_until
from p2pkv.types import Outcome, RequestContext
from p2pkv_zmq.connection import ZmqConnection
from zmq_tiers import Peer, T, contexts, run_request, tick

REQUESTS = 20


def _count_pushes(consumer: Peer, producer: Peer) -> list[int]:
    """The frames of each push the consumer's connection to ``producer`` makes from now on."""
    conn = consumer.tier.peer_connection(format_address(producer.host, producer.port))
    assert isinstance(conn, ZmqConnection)
    pushes: list[int] = []
    push = conn.push

    def counted() -> bool:
        if conn._unsent:  # a push that hands frames to libzmq
            pushes.append(len(conn._unsent))
        return push()

    conn.push = counted  # type: ignore[method-assign]
    return pushes


def _pull(producer: Peer, consumer: Peer, n: int) -> tuple[RequestContext, RequestContext]:
    """Request ``n``, stored then at once loaded, both sides ticked until their results (as
    an engine steps); its contexts, the request not finished yet."""
    run_request(producer, consumer, f"r{n}", [n % 32], False, settle=False, finish=False)
    return contexts(f"r{n}", producer)


def _quiet(*peers: Peer) -> Callable[[], bool]:
    """No per-request state left but the producer's tombstones (and their timers)."""
    kept = {"tombstones", "timers"}
    return lambda: all(
        not any(v for k, v in p.tier.state_sizes().items() if k not in kept) for p in peers
    )


def test_a_pull_costs_the_consumer_two_pushes(pair: tuple[Peer, Peer]) -> None:
    producer, consumer = pair
    for ctx, peer in zip(_pull(producer, consumer, 0), (producer, consumer), strict=True):
        peer.tier.on_request_finished(ctx)  # the session is up; this terminal fetch waits
    pushes = _count_pushes(consumer, producer)
    for n in range(1, REQUESTS + 1):
        pctx, cctx = _pull(producer, consumer, n)
        producer.tier.on_request_finished(pctx)
        consumer.tier.on_request_finished(cctx)
    # each pull: [the previous terminal fetch, its fetch], then [its release]
    assert pushes == [2, 1] * REQUESTS
    consumer.tier.tick()  # the last terminal fetch leaves at the next tick, alone
    assert pushes[-1] == 1 and len(pushes) == 2 * REQUESTS + 1
    wait_until(
        _quiet(producer, consumer), timeout=T, what="no request state left", pumps=[tick(producer)]
    )


def test_the_terminal_fetch_leaves_at_the_next_tick(pair: tuple[Peer, Peer]) -> None:
    """The producer stored a block the consumer never asked for: its store job ends
    ``nothing_to_do`` only on the terminal fetch, which the consumer's next tick sends."""
    producer, consumer = pair
    for ctx, peer in zip(_pull(producer, consumer, 0), (producer, consumer), strict=True):
        peer.tier.on_request_finished(ctx)
    consumer.tier.tick()
    pctx, cctx = contexts("spare", producer)
    producer.tier.on_new_request(pctx)
    producer.job(1, [b"spare/0"], [1], load=False, ctx=pctx)
    producer.job(2, [b"spare/1"], [2], load=False, ctx=pctx)
    consumer.tier.on_new_request(cctx)
    consumer.job(3, [b"spare/0"], [40], load=True, ctx=cctx)
    wait_until(
        lambda: {1, 3} <= set(producer.results) | set(consumer.results),
        timeout=T,
        what="the delivered block's results",
        pumps=[tick(producer, consumer)],
    )
    producer.tier.on_request_finished(pctx)
    pushes = _count_pushes(consumer, producer)
    consumer.tier.on_request_finished(cctx)  # queues the terminal fetch, pushes nothing
    for _ in range(20):
        producer.collect()
    assert pushes == []
    assert 2 not in producer.results  # the producer has not heard of the end yet
    consumer.tier.tick()
    assert pushes == [1]
    wait_until(
        lambda: 2 in producer.results,
        timeout=T,
        what="the spare store's result",
        pumps=[tick(producer)],
    )
    assert producer.results[2].outcome is Outcome.NOTHING_TO_DO
