"""A new connection claiming a live session's address is held, not obeyed (protocol §4.1/6).

Anyone who reaches the control port can claim any address, so the newcomer never replaces
a usable session: it waits, unread beyond a few frames, until that session's connection
ends (a restarted peer's old connection ends by itself) and then takes over with the frames
it sent; or it is closed when it sends too much or ``timeouts.handshake`` passes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR, Hello, decode, encode
from p2pkv.reference.delegating import DelegatingControlTransport
from p2pkv.types import Outcome


@pytest.fixture
def h(tier_harness: Any) -> Any:
    return tier_harness


class Claimant:
    """A hand-made inbound connection claiming ``peer_address``; frames it "sent" are queued
    in ``inbox``, frames the tier sends land in ``sent``."""

    def __init__(self, peer_address: str, *frames: bytes) -> None:
        self.peer_address = peer_address
        self.inbox = list(frames)
        self.sent: list[bytes] = []
        self.alive = True

    def send(self, frame: bytes) -> None:
        self.sent.append(frame)

    def recv(self) -> Sequence[bytes]:
        got, self.inbox = self.inbox, []
        return got

    def close(self) -> None:
        self.alive = False


class Arriving(DelegatingControlTransport):
    """A node's control transport whose next ``poll`` also returns ``pending`` connections.
    It tracks no active connections (claimants are not the inner transport's): the tier
    visits every session each tick."""

    def __init__(self, inner: Any) -> None:
        super().__init__(inner)
        self.pending: list[Any] = []

    def poll(self, timeout: float = 0.0) -> list[Any]:
        got, self.pending = [*super().poll(timeout), *self.pending], []
        return got

    def take_active(self) -> None:
        return None


class Arrivals:
    """Wraps a node's control transport in an :class:`Arriving` as the node is built (the
    node's ``faults`` hook)."""

    def __init__(self) -> None:
        self.arriving: Arriving | None = None

    def control(self, inner: Any) -> Arriving:
        self.arriving = Arriving(inner)
        return self.arriving

    def data(self, inner: Any, *, local: str) -> Any:
        return inner


def hello_from(node: Any, epoch: int) -> bytes:
    return encode(
        Hello(
            (WIRE_MAJOR, WIRE_MINOR),
            epoch,
            node.address,
            node.data.descriptor(),
            node.data.num_blocks,
            node.data.block_len,
            "",
            "",
        )
    )


def live_pair(h: Any, cluster: Any) -> tuple[Any, Any, Arriving]:
    """A producer with a ready session to a consumer (one request done), its control wrapped."""
    arrivals = Arrivals()
    p, c = cluster(faults=arrivals), cluster()
    assert arrivals.arriving is not None
    arriving = arrivals.arriving
    p.store(1, h.keys("r", 2), [0, 1], p.producer_ctx("r"))
    c.load(2, h.keys("r", 2), [4, 5], c.consumer_ctx("r", p))
    h.pump_until([p, c], lambda: 2 in c.results)
    return p, c, arriving


def load_completes(h: Any, p: Any, c: Any, kv: str, job: int) -> None:
    p.store(job, h.keys(kv, 1), [2], p.producer_ctx(kv))
    c.load(job + 1, h.keys(kv, 1), [6], c.consumer_ctx(kv, p))
    h.pump_until([p, c], lambda: job + 1 in c.results and job in p.results)
    assert c.outcome(job + 1) is Outcome.DONE and p.outcome(job) is Outcome.DONE


def test_an_impostors_frames_do_not_disturb_the_live_session(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    conn = p.tier.peer_connection(c.address)
    impostor = Claimant(c.address, b"\x80")
    arriving.pending.append(impostor)
    load_completes(h, p, c, "after", 10)
    assert p.tier.peer_connection(c.address) is conn and impostor.alive and not impostor.sent
    h.advance(p.clock, [p, c], p.tier._config.timeouts.handshake)
    assert not impostor.alive and not impostor.sent
    assert p.tier.peer_connection(c.address) is conn
    load_completes(h, p, c, "later", 20)
    assert p.tier.stats()["protocol_errors"] == 0


def test_a_newcomer_that_sends_too_much_is_closed(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    flood = Claimant(c.address, *[b"\x80"] * 5)
    arriving.pending.append(flood)
    h.pump([p, c], 2)
    assert not flood.alive and not flood.sent
    load_completes(h, p, c, "after", 10)


def test_a_newer_claimant_replaces_an_older_one(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    first, second = Claimant(c.address), Claimant(c.address)
    arriving.pending.append(first)
    h.pump([p], 1)
    arriving.pending.append(second)
    h.pump([p], 1)
    assert not first.alive and second.alive and p.tier.state_sizes()["newcomers"] == 1


def test_the_newcomer_takes_over_once_the_old_connection_ends(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    restarted = Claimant(c.address, hello_from(c, epoch=7))
    arriving.pending.append(restarted)
    h.pump([p, c], 2)
    assert not restarted.sent
    old = p.tier.peer_connection(c.address)
    assert old is not None
    old.close()  # what the transport reports when the old incarnation's connection dies
    h.pump([p], 2)
    assert p.tier.peer_connection(c.address) is restarted
    sent = [type(decode(f, p.tier._config.limits)).__name__ for f in restarted.sent]
    assert sent == ["Hello", "HelloAck"]  # our hello, then the ack of the held hello
    assert p.tier.state_sizes()["newcomers"] == 0


def test_dialing_a_dead_sessions_address_uses_the_held_newcomer(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    held = Claimant(c.address, hello_from(c, epoch=9))
    arriving.pending.append(held)
    h.pump([p], 1)
    conn = p.tier.peer_connection(c.address)
    assert conn is not None
    conn.close()
    p.load(30, h.keys("back", 1), [9], p.consumer_ctx("back", c))  # dials c's address
    assert p.tier.peer_connection(c.address) is held  # no new dial: the held one serves


def test_shutdown_closes_held_newcomers(h: Any, cluster: Any) -> None:
    p, c, arriving = live_pair(h, cluster)
    held = Claimant(c.address)
    arriving.pending.append(held)
    h.pump([p], 1)
    p.shutdown()
    assert not held.alive
