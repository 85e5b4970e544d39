"""Dials that cannot work fail from the failure itself and say why (issue #18): a refused
port and an unresolvable host are dead with that reason, and repeated dials to a failing
address are answered from the negative cache instead of dialing again. Their transports'
``connect_timeout`` and ``handshake_timeout`` are ``FAR``, longer than any wait here, so a
dial that died only by a deadline would never die within the test: dying at all proves the
cause was seen. No elapsed time is asserted."""

from __future__ import annotations

import socket
from typing import Any

import pytest
from p2pkv.errors import ConnectionClosed
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq.dialing import DIAL_BACKOFF
from zmq_fixtures import MakeTransport

T = 5.0
FAR = 3600.0
"""``connect_timeout`` and ``handshake_timeout`` of the transports that must not wait."""
WAIT = 60.0
"""How long a test waits for a dial to die (far below ``FAR``)."""


def _dead(t: Any, address: str, within: float = WAIT) -> str:
    """Dial ``address``; the connection's close reason once it is dead (within ``within``)."""
    conn = t.connect(address)
    wait_until(
        lambda: not conn.alive,
        timeout=within,
        what=f"the dial to {address} to die",
        pumps=[lambda: t.poll(0.001)],
    )
    with pytest.raises(ConnectionClosed, match="gone"):
        conn.send(b"to nobody")
    return str(conn.close_reason)


def test_a_refused_dial_is_dead_at_once_and_says_refused(
    make_transport: MakeTransport,
    refused_address: str,
) -> None:
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    reason = _dead(t, refused_address)
    assert "refused" in reason and refused_address in reason, reason


def test_repeated_dials_to_a_refused_port_back_off_through_the_negative_cache(
    make_transport: MakeTransport,
    refused_address: str,
) -> None:
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    reasons = [_dead(t, refused_address) for _ in range(20)]
    assert all("refused" in r for r in reasons), reasons
    cached = [r for r in reasons if "remembered from the dial" in r]
    assert cached, f"no dial was answered from the negative cache: {reasons}"
    # Once the backoff has passed, the address is dialed again for real (a live dial first).
    wait_until(
        lambda: t.connect(refused_address).alive,
        timeout=DIAL_BACKOFF + T,
        what="a real dial once the backoff passed",
        pumps=[lambda: t.poll(0.001)],
    )
    assert "remembered" not in _dead(t, refused_address)


def test_an_unresolvable_host_is_dead_at_once_and_says_no_such_host(
    make_transport: MakeTransport,
) -> None:
    t = make_transport(connect_timeout=FAR, handshake_timeout=FAR)
    reason = _dead(t, "no-such-host.invalid:5710")
    assert "no such host" in reason and "no-such-host.invalid" in reason, reason
    again = _dead(t, "no-such-host.invalid:5710")  # cached: no second lookup
    assert "no such host" in again and "remembered from the dial" in again, again
    assert t.stats()["connections"] == 0


def test_a_listener_that_never_speaks_zmtp_times_out_the_handshake(
    make_transport: MakeTransport,
) -> None:
    """Something accepts TCP but never answers the greeting (not a p2pkv port): dead after
    handshake_timeout, named as such, not after connect_timeout."""
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(4)
        t = make_transport(handshake_timeout=0.3)
        reason = _dead(t, f"127.0.0.1:{silent.getsockname()[1]}", within=T)
    assert "handshake timed out" in reason and "handshake_timeout" in reason, reason
