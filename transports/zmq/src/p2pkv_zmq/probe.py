"""Which tier answers at an address: a p2pkv tier with the expected security, or what else.

:func:`probe` dials the address like a p2pkv peer (a ``PUSH``, CURVE client with the fleet's
keys, or plain with none) and, once the zmq handshake succeeds, sends the link message
``probe`` (:mod:`p2pkv_zmq.probe_wire`). A p2pkv tier answers with ``identity`` over a
notice dialed to a ``PULL`` the probe listens on (CURVE server with the fleet's server key,
admitting only the fleet's client keys), so the answer proves both key pairs. The tier opens
no session and logs nothing above DEBUG for a probe that passes.

When the dial does not get that far, the probe reads what answers by hand
(:func:`p2pkv_zmq.zmtp.greet`): nothing, something that is not zmq, vLLM's built-in tier (a
``ROUTER`` without security), a listener of another security mode, or other keys. Every
outcome is one :class:`ProbeResult` line naming it.

Threading: any thread; own zmq context, closed before returning. Bounded: the whole probe
ends within ``timeout``. The zmq handshake gets the first half; a dial that has not shaken
hands by then is *stalled* (a tier still starting, stopped or starved of CPU answers no
handshake: its ZAP handler runs on its driver thread). The hand reading gets what is left,
at least that second half; the tier's answer after a handshake, up to the whole ``timeout``.
"""

from __future__ import annotations

import math
import secrets
import socket
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import zmq
from p2pkv.addressing import format_address
from p2pkv.protocol import WIRE_MAJOR
from zmq.utils.monitor import parse_monitor_message

from p2pkv_zmq.dialing import DialFailed, resolve
from p2pkv_zmq.identity import canonical_address, link_id, new_incarnation, tcp_url
from p2pkv_zmq.keys import key_fingerprint
from p2pkv_zmq.probe_wire import IDENTITY, PROBE, Identity, ProbeWireError, decode_identity
from p2pkv_zmq.security import CurveKeys
from p2pkv_zmq.zap import ZapHandler
from p2pkv_zmq.zmtp import Greeting, greet

__all__ = ["ProbeResult", "probe"]

_EVENTS = (
    zmq.EVENT_CONNECTED
    | zmq.EVENT_CONNECT_RETRIED
    | zmq.EVENT_DISCONNECTED
    | zmq.EVENT_HANDSHAKE_SUCCEEDED
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)
_STALLED = "stopped (SIGSTOP) or starved of CPU"
"""Why a listener may accept TCP and then say nothing in time, as failure lines say it."""
_MIN_GREET = 0.05
"""Seconds the hand reading gets at least (it always has about half the timeout)."""
_BUILTIN_FIX = (
    "the image lacks p2pkv-vllm, vLLM did not load its plugin (VLLM_PLUGINS), or "
    "P2PKV_REPLACE_P2P is not 1 on the engine"
)


@dataclass(frozen=True)
class ProbeResult:
    """One probe's verdict: ``ok`` only for a p2pkv tier with the expected security."""

    ok: bool
    line: str
    """One line naming what answered (the tier's version and security when ``ok``)."""


@dataclass
class _Seen:
    """What the dial learnt so far."""

    connected: bool = False
    handshake: bool = False
    failure: str = ""
    """A decided failure line (ends the wait)."""
    diagnose: bool = False
    """The dial failed in a way only :func:`greet` can name (ends the wait)."""
    identity: Identity | None = None
    refused_tier_key: str = ""
    """The client key the tier's answer presented, refused by our ZAP check."""
    tier_client_key: bytes = b""
    """The client key the tier's answer presented, admitted (the tier's current pair)."""
    stalled: float = 0.0
    """Seconds the dial waited for a zmq handshake in vain: half the timeout (0: it did not
    stall)."""


def probe(
    address: str, host: str, port: int, keys: CurveKeys | None, timeout: float
) -> ProbeResult:
    """Probe the tier at ``host:port`` (``address`` as the operator wrote it, for the line):
    CURVE with ``keys``, or plain (``--insecure``) without."""
    deadline = time.monotonic() + timeout
    try:
        ip = resolve(host)
    except DialFailed as exc:
        return ProbeResult(False, f"{address}: {exc}")
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        seen = _exchange(ctx, ip, port, keys, deadline, timeout)
    finally:
        ctx.destroy(linger=0)
    if seen.identity is not None:
        return _verdict(address, seen.identity, keys, seen.tier_client_key)
    if seen.failure:
        return ProbeResult(False, f"{address}: {seen.failure}")
    if seen.refused_tier_key:
        return ProbeResult(
            False,
            f"{address}: a tier answered with client key "
            f"{seen.refused_tier_key}, which is not among this fleet's "
            "allowed client keys: it mounts another fleet's Secret",
        )
    if seen.handshake:
        return ProbeResult(
            False,
            f"{address}: a zmq PULL accepted the connection but did not "
            f"identify itself within {timeout:g} s: a p2pkv tier still "
            f"starting, {_STALLED}, a p2pkv older than this probe, or not a "
            "p2pkv tier",
        )
    found = greet(ip, port, max(deadline - time.monotonic(), _MIN_GREET))
    return ProbeResult(False, f"{address}: {_named(found, keys, seen.stalled)}")


def _exchange(
    ctx: zmq.Context[zmq.Socket[bytes]],
    ip: str,
    port: int,
    keys: CurveKeys | None,
    deadline: float,
    timeout: float,
) -> _Seen:
    """Dial, send ``probe`` once the handshake succeeds, wait for ``identity``: the
    handshake until ``timeout / 2`` before ``deadline`` (else ``stalled``), the answer
    until ``deadline``."""
    seen = _Seen()
    shake_by = deadline - timeout / 2
    answers, zap = _answer_socket(ctx, keys, seen)
    local = _local_ip(ip, port)
    answer_port = answers.bind_to_random_port(tcp_url(local, "*").rsplit(":", 1)[0])
    our_link = link_id(canonical_address(format_address(local, answer_port)), new_incarnation())
    nonce = secrets.token_bytes(16)
    push = _dialer(ctx, ip, keys, timeout)
    monitor = push.get_monitor_socket(_EVENTS)
    push.connect(tcp_url(ip, port))
    poller = zmq.Poller()
    for sock in (monitor, answers, *([zap.socket] if zap else [])):
        poller.register(sock, zmq.POLLIN)
    while seen.identity is None and not seen.failure and not seen.diagnose:
        now = time.monotonic()
        left = (deadline if seen.handshake else shake_by) - now
        if left <= 0:
            if not seen.handshake:
                seen.diagnose, seen.stalled = True, timeout / 2
            break
        for sock, _ in poller.poll(max(1, math.ceil(left * 1000))):
            if sock is monitor:
                _on_event(
                    parse_monitor_message(monitor.recv_multipart()),
                    seen,
                    keys,
                    push,
                    [our_link, b"", PROBE, nonce],
                )
            elif sock is answers:
                _on_answer(answers.recv_multipart(), nonce, seen)
            elif zap is not None:
                zap.serve()
    return seen


def _dialer(
    ctx: zmq.Context[zmq.Socket[bytes]], ip: str, keys: CurveKeys | None, timeout: float
) -> zmq.Socket[bytes]:
    """The PUSH that dials the tier: a CURVE client with the fleet's keys, or plain."""
    push = ctx.socket(zmq.PUSH)
    push.linger = 0
    push.ipv6 = ":" in ip
    push.handshake_ivl = max(1, int(timeout * 1000))
    if keys is not None:
        push.curve_serverkey = keys.server_public
        push.curve_publickey = keys.client_public
        push.curve_secretkey = keys.client_secret
    return push


def _answer_socket(
    ctx: zmq.Context[zmq.Socket[bytes]], keys: CurveKeys | None, seen: _Seen
) -> tuple[zmq.Socket[bytes], ZapHandler | None]:
    """The PULL the tier's answer comes to: with keys, a CURVE server holding the fleet's
    server key whose ZAP handler admits only the fleet's client keys (so the answer proves
    them; a refused one is recorded in ``seen``)."""
    answers = ctx.socket(zmq.PULL)
    answers.linger = 0
    answers.ipv6 = True  # the route to an IPv6 tier starts at an IPv6 address of ours
    if keys is None:
        return answers, None

    def refused(_host: str, client: str) -> None:
        seen.refused_tier_key = client

    def admitted(client: bytes) -> None:
        seen.tier_client_key = client

    zap = ZapHandler(ctx, keys.allowed, refused, admitted)
    answers.zap_domain = b"p2pkv"
    answers.curve_server = True
    answers.curve_secretkey = keys.server_secret
    return answers, zap


def _on_event(
    event: Mapping[str, Any],
    seen: _Seen,
    keys: CurveKeys | None,
    push: zmq.Socket[bytes],
    message: list[bytes],
) -> None:
    kind, value = event["event"], event["value"]
    assert isinstance(value, int)
    if kind == zmq.EVENT_CONNECTED:
        seen.connected = True
    elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
        seen.handshake = True
        try:
            push.send_multipart(message, zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            seen.failure = f"the probe could not be sent ({exc})"
    elif kind == zmq.EVENT_CONNECT_RETRIED and not seen.connected:
        seen.diagnose = True  # refused: greet names it
    elif kind == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        fingerprint = key_fingerprint(keys.client_public) if keys else ""
        seen.failure = (
            f"a CURVE listener refused this fleet's client key ({fingerprint}): "
            "its allowed client keys are another fleet's (another Secret, or a "
            "rotation not finished there)"
        )
    elif (
        kind == zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
        and value == zmq.PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC
        and keys is not None
    ):
        seen.failure = _other_server_key(keys)
    elif kind != zmq.EVENT_CONNECT_RETRIED and not seen.handshake:
        seen.diagnose = True  # a hang-up or another protocol error: greet names the peer


def _on_answer(parts: list[bytes], nonce: bytes, seen: _Seen) -> None:
    """A message on the answer PULL: the tier's ``identity`` if it echoes our nonce."""
    if len(parts) != 4 or parts[1] != b"" or parts[2] != IDENTITY:
        return
    try:
        identity = decode_identity(parts[3])
    except ProbeWireError as exc:
        seen.failure = f"the answer to the probe is malformed ({exc})"
        return
    if identity.nonce == nonce:
        seen.identity = identity


def _verdict(
    address: str, identity: Identity, keys: CurveKeys | None, tier_client: bytes
) -> ProbeResult:
    what = (
        f"p2pkv {identity.version}, control {identity.control}, wire "
        f"{identity.wire[0]}.{identity.wire[1]}"
    )
    if identity.wire[0] != WIRE_MAJOR:
        return ProbeResult(
            False,
            f"{address}: a p2pkv tier ({what}) whose wire major version "
            f"is not this p2pkv's ({WIRE_MAJOR}): the two cannot share blocks",
        )
    if keys is None:
        return ProbeResult(True, f"p2pkv tier at {address}: {what}, no authentication (--insecure)")
    client = f", its client key {key_fingerprint(tier_client)}" if tier_client else ""
    return ProbeResult(
        True,
        f"p2pkv tier at {address}: {what}, CURVE (keys "
        f"{key_fingerprint(keys.server_public)}{client})",
    )


def _named(found: Greeting, keys: CurveKeys | None, stalled: float) -> str:
    """What :func:`greet` found, as the end of a failure line (``stalled``: seconds our dial
    waited for a handshake in vain, 0 if it failed at once)."""
    if found.mechanism == "CURVE" and keys is not None and stalled:
        return (
            f"a CURVE listener that completed no handshake within {stalled:g} s: a "
            f"p2pkv tier still starting, or {_STALLED}"
        )
    if found.mechanism:
        return _zmq_listener(found, keys)
    if found.refused:
        return (
            "nothing listens there (connection refused): the tier is not up yet, or "
            "listens on another port (VLLM_P2P_SIDE_CHANNEL_PORT, + the DP rank)"
        )
    if found.unreachable:
        return f"no answer ({found.unreachable})"
    if found.not_zmq is not None:
        shown = f" ({found.not_zmq!r})" if found.not_zmq else ""
        return f"it answers with bytes that are not zmq{shown}: not a p2pkv tier"
    return (
        f"it accepts TCP connections but sends no zmq greeting: a process {_STALLED}, "
        "or not a p2pkv tier"
    )


def _zmq_listener(found: Greeting, keys: CurveKeys | None) -> str:
    """A zmq listener that is not the expected tier, named by its mechanism (and type)."""
    if found.mechanism == "CURVE":
        return (
            _other_server_key(keys)
            if keys is not None
            else (
                "a CURVE listener (a p2pkv tier with keys?), but the probe runs --insecure: "
                "give it the fleet's keys (P2PKV_CURVE_DIR or --curve-dir)"
            )
        )
    if found.mechanism != "NULL":
        return f"a zmq listener with {found.mechanism} security: not a p2pkv tier"
    if found.socket_type == "ROUTER":
        return (
            f"vLLM's built-in P2P tier (a zmq ROUTER without authentication), not p2pkv: "
            f"{_BUILTIN_FIX}"
        )
    if found.socket_type == "PULL" and keys is not None:
        return (
            "a tier without authentication (insecure), but this fleet's keys are set: "
            "the engine lacks P2PKV_CURVE_DIR (or its entry says insecure: true)"
        )
    return f"a zmq {found.socket_type or 'socket'} without authentication: not a p2pkv tier"


def _other_server_key(keys: CurveKeys) -> str:
    return (
        f"a CURVE listener whose server key is not this fleet's (keys "
        f"{key_fingerprint(keys.server_public)}): it mounts another fleet's Secret, or "
        "a rotation not finished there"
    )


def _local_ip(ip: str, port: int) -> str:
    """Our address on the route to ``ip`` (no packet is sent): where the tier can dial us."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((ip, port))
        return str(s.getsockname()[0])
