"""A frozen peer never stalls another (issue 46), ucx specifics: staging shared by per-peer
shares, ``remove_peer`` that never waits for a peer (``held`` accounts for what it leaves),
and NOTICEs applied per sender. In-process transports over tcp with rendezvous for every
run, so a run a frozen producer started stays half received; "frozen": not progressed."""

from __future__ import annotations

from collections.abc import Callable

from p2pkv_ucx.records import Peer
from p2pkv_ucx.staging import Staging
from ucx_helpers import Node, T

Make = Callable[..., Node]
BLOCK = 1024
TCP_RNDV = {"TLS": "tcp", "RNDV_THRESH": "512"}
"""Runs (a block and more) go by rendezvous, NOTICEs (under 512 bytes) eagerly."""
ROUNDS = 200
"""Progress rounds within which a healthy peer's reads complete here."""


def _rounds_until(pumps: list[Callable[[], object]], done: Callable[[], bool]) -> int | None:
    for count in range(1, ROUNDS + 1):
        for pump in pumps:
            pump()
        if done():
            return count
    return None


def _warm(consumer: Node, producer: Node, peer: str, slot: int) -> None:
    """One read, so the endpoints are wired up (as a serving peer's are)."""
    tid = consumer.t.read_blocks(peer, [slot], [0])
    assert _rounds_until(
        [producer.t.progress, lambda: consumer.poll(peer)], lambda: tid in consumer.done
    )


def _star(nodes: Make, center_as: str, **opts: object) -> tuple[Node, Node, Node]:
    """A center node and two peers of it, ``frozen`` and ``healthy`` (its names for them;
    they call it ``center_as``), registered both ways."""
    center = nodes(seed=1, **opts)
    frozen, healthy = nodes(seed=2, **opts), nodes(seed=3, **opts)
    frozen.link(center_as, center, back_as="frozen")
    healthy.link(center_as, center, back_as="healthy")
    return center, frozen, healthy


def test_a_peer_holds_at_most_its_share_of_staging() -> None:
    staging: Staging[str] = Staging(block_len=1, budget=8, largest=2)
    assert staging.share() == 4, "one peer alone: half the budget"
    staging.take("a", 2)
    staging.take("a", 2)
    assert not staging.admits("a", 2), "a is at its share"
    assert staging.admits("b", 2), "b takes the rest"
    staging.take("b", 2)
    staging.wait("c", True)
    assert staging.share() == 2, "a third peer waiting: shares of a third (one message at least)"
    assert staging.admits("c", 2) and not staging.admits("b", 2)
    staging.release("a", 4)
    assert staging.held_by("a") == 0 and staging.used == 2
    assert Staging(1, budget=1, largest=2).budget == 4, "at least two largest messages"


def test_a_frozen_producer_holds_half_the_staging_and_another_producers_reads_land(
    nodes: Make,
) -> None:
    """A frozen producer's runs are half received (it stopped after sending their headers):
    they hold its share of the staging budget (half) and its other runs wait, parked; a
    healthy producer's reads meanwhile land within ``ROUNDS`` rounds."""
    consumer, frozen, healthy = _star(
        nodes, "c", max_message_bytes=BLOCK, staging_bytes=4 * BLOCK, ucx_config=TCP_RNDV
    )
    _warm(consumer, frozen, "frozen", 31)
    _warm(consumer, healthy, "healthy", 30)
    stuck = consumer.t.read_blocks("frozen", list(range(8)), list(range(8)))
    staging = consumer.t.state.staging
    frozen_peer = consumer.t.attached_peer("frozen")
    assert isinstance(frozen_peer, Peer)
    taken = _rounds_until(
        [frozen.t.progress, consumer.t.progress], lambda: staging.held_by(frozen_peer) > 0
    )
    assert taken, "the frozen producer's runs never started"
    # frozen from here on: never progressed again
    ids = {consumer.t.read_blocks("healthy", [16 + i], [i]) for i in range(8)}
    rounds = _rounds_until(
        [healthy.t.progress, lambda: consumer.poll("healthy")],
        lambda: ids <= consumer.done | consumer.failed,
    )
    assert rounds is not None, "a healthy producer's reads stalled behind a frozen one's"
    assert ids <= consumer.done
    assert (consumer.blocks[16:24] == healthy.blocks[:8]).all()
    peer = consumer.t.attached_peer("frozen")
    assert isinstance(peer, Peer)
    assert 0 < staging.held_by(peer) <= staging.budget // 2
    assert peer.parked, "the frozen producer's runs beyond its share wait, parked"
    consumer.t.cancel([stuck])
    assert staging.held_by(peer) == 0, "a cancelled read gives its share back at once"


def test_removing_a_frozen_consumer_returns_at_once_and_held_accounts_for_its_sends(
    nodes: Make,
) -> None:
    opts = {"ucx_config": TCP_RNDV, "drain_timeout": T}
    producer, frozen = nodes(seed=1, **opts), nodes(seed=2, **opts)
    producer.link("frozen", frozen, back_as="p")
    _warm(frozen, producer, "p", 31)
    frozen.t.read_blocks("p", list(range(8)), list(range(8)))
    started = _rounds_until([producer.t.progress], lambda: bool(producer.t.state.serves))
    assert started, "the producer never served the read"
    # the consumer is frozen from here on: the sends serving it cannot finish
    left = producer.t.remove_peer("frozen")
    assert left, "sends serving a frozen consumer are still running"
    held = producer.t.held()
    assert held["sends_to_removed_peers"] == len(left) and held["retired_endpoints"] == 1
    # it resumes: its receives complete, the producer's sends settle, everything is released
    assert _rounds_until(
        [frozen.t.progress, producer.t.progress, lambda: frozen.poll("p")],
        lambda: not producer.t.held(),
    )


def test_a_frozen_peers_half_received_notice_holds_up_no_other_peer(nodes: Make) -> None:
    """With rendezvous for every message, a frozen consumer's READ notice stays half received
    at its producer; another consumer's READs are still applied and served. (NOTICEs of a
    sender that tags them without its instance, as the raw producer of ``test_inprocess``
    does, share one order and still apply.)"""
    producer, frozen, healthy = _star(nodes, "p", ucx_config={"TLS": "tcp", "RNDV_THRESH": "0"})
    _warm(frozen, producer, "p", 31)
    _warm(healthy, producer, "p", 31)
    frozen.t.read_blocks("p", [0, 1], [0, 1])  # its READ leaves; then it is frozen
    ids = {healthy.t.read_blocks("p", [i], [i]) for i in range(2, 6)}
    rounds = _rounds_until(
        [producer.t.progress, lambda: healthy.poll("p")],
        lambda: ids <= healthy.done | healthy.failed,
    )
    assert rounds is not None, "a healthy consumer's READs waited behind a frozen one's"
    assert ids <= healthy.done
