"""A hub answering the probe exchange (docs/protocol.md §11) over raw zmq sockets: a
well-formed ``probe`` gets one ``identity`` at the prober's address and nothing else (no
connection, no drop); a probe with a bad nonce is dropped and counted, never answered."""

from __future__ import annotations

from typing import Any

import zmq
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq.identity import link_id, new_incarnation
from p2pkv_zmq.probe_wire import IDENTITY, PROBE, decode_identity
from zmq_fixtures import MakeTransport

T = 10.0


def _prober(
    ctx: zmq.Context[zmq.Socket[bytes]], tier: str
) -> tuple[zmq.Socket[bytes], zmq.Socket[bytes], bytes]:
    """(a PULL for the answer, a PUSH dialing ``tier``, the link id naming that PULL)."""
    answers = ctx.socket(zmq.PULL)
    answers.linger = 0
    port = answers.bind_to_random_port("tcp://127.0.0.1")
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.connect(f"tcp://{tier}")
    return answers, push, link_id(f"127.0.0.1:{port}", new_incarnation())


def test_a_probe_is_answered_at_the_probers_address_and_opens_nothing(
    make_transport: MakeTransport,
) -> None:
    t = make_transport(insecure=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        answers, push, link = _prober(ctx, t.local_address)
        push.send_multipart([link, b"", PROBE, b"n" * 16])
        accepted: list[Any] = []
        wait_until(
            lambda: answers.poll(0),
            timeout=T,
            what="the tier's identity",
            pumps=[lambda: accepted.extend(t.poll(0.001))],
        )
        parts = answers.recv_multipart()
        assert parts[0].startswith(f"{t.local_address}#".encode())
        assert parts[1:3] == [b"", IDENTITY]
        answer = decode_identity(parts[3])
        assert (answer.nonce, answer.control, answer.security) == (b"n" * 16, "zmq", "none")
        assert accepted == [] and t.take_active() == []
        assert t.stats()["dropped_messages"] == 0
    finally:
        ctx.destroy(linger=0)


def test_a_probe_with_a_bad_nonce_is_dropped(make_transport: MakeTransport) -> None:
    t = make_transport(insecure=True)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        answers, push, link = _prober(ctx, t.local_address)
        push.send_multipart([link, b"", PROBE, b"short"])
        wait_until(
            lambda: t.stats()["dropped_messages"] >= 1,
            timeout=T,
            what="the probe dropped",
            pumps=[lambda: t.poll(0.001)],
        )
        assert t.stats()["dropped_messages"] == 1
        assert not answers.poll(0)  # dropped before any answer could be dialed
    finally:
        ctx.destroy(linger=0)
