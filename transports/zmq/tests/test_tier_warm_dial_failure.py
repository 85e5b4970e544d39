"""A failed pre-connect dial refuses no request, over real zmq (issue 48, item 5).

Engines started together from one ``peers.connect`` list dial each other before every
listener is up. The tier lets a request dial such a peer at once (its warm dial's failure
paces pre-connect only); the zmq hub's own memory of failed dials
(:class:`~p2pkv_zmq.dialing.DialFailures`) must agree, or the request's dial is answered
with the remembered refusal. The hub's memory lasts ``FAR`` here, so only forgetting it
lets the request through: no race with its one second.
"""

from __future__ import annotations

import logging
import socket

import pytest
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq import dialing
from zmq_tiers import Peer, T, run_request, tick

FAR = 3600.0


def test_a_listed_peer_that_was_not_up_when_pre_connect_dialed_it_is_served_at_once(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(dialing, "DIAL_BACKOFF", FAR)
    caplog.set_level(logging.WARNING, logger="p2pkv")
    with socket.socket() as reserved:  # refuses: bound, not listening
        reserved.bind(("127.0.0.1", 0))
        port = reserved.getsockname()[1]
        address = f"127.0.0.1:{port}"
        consumer = Peer(2, peers={"connect": [address], "dial_backoff": 8})
        refused = f"connection to {address} failed: connection refused"
        wait_until(
            lambda: refused in caplog.text,
            timeout=T,
            what="the warm dial to be refused",
            pumps=[tick(consumer)],
        )
    producer = Peer(1, port=port)  # up now, within both memories of the failed dial
    try:
        for _ in range(3):  # the tier's ticks after the failure: its session closes
            tick(consumer)()
        run_request(producer, consumer, "late", [0, 1], consumer_first=True)
        assert consumer.tier.stats()["peers_backed_off"] == 0
    finally:
        consumer.tier.shutdown()
        producer.tier.shutdown()
