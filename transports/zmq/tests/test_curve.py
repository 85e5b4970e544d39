"""CURVE authentication and encryption, the ZAP allow-list, and the fail-closed bind policy."""

from __future__ import annotations

import gc
import logging
import os
import socket
import stat
import time
from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from p2pkv.cli import main as p2pkv_main
from p2pkv.errors import ConfigError
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq.dialing import DIAL_BACKOFF
from zmq_fixtures import MakeTransport, curve

T = 5.0


def pump(*transports: Any) -> Any:
    return lambda: [t.poll(0.001) for t in transports]


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name.startswith("p2pkv.zmq") and "refused" in r.getMessage()
    ]


def test_keys_command_writes_a_usable_pair(
    keydir: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    public, secret = zmq.auth.load_certificate(str(keydir / "alice.key_secret"))
    assert secret is not None and zmq.curve_public(secret) == public
    assert zmq.auth.load_certificate(str(keydir / "alice.key"))[0] == public
    assert stat.S_IMODE(os.stat(keydir / "alice.key_secret").st_mode) == 0o600
    capsys.readouterr()
    assert p2pkv_main(["keys", "--dir", str(keydir), "--name", "alice"]) == 2
    assert "exists" in capsys.readouterr().err
    assert p2pkv_main(["keys", "--dir", str(keydir), "--name", "alice", "--force"]) == 0
    assert zmq.auth.load_certificate(str(keydir / "alice.key"))[0] != public


def test_right_keys_connect_both_ways(make_transport: MakeTransport, keydir: Path) -> None:
    server = make_transport(options=curve(keydir, "alice"))
    public, secret = zmq.auth.load_certificate(str(keydir / "alice.key_secret"))
    assert secret is not None
    as_text = {  # the same keys given as Z85 strings instead of files
        "server_secret_key": zmq.auth.load_certificate(str(keydir / "server.key_secret"))[
            1
        ].decode(),  # type: ignore[union-attr]
        "server_public_key": zmq.auth.load_certificate(str(keydir / "server.key"))[0].decode(),
        "client_secret_key": secret.decode(),
        "allowed_client_keys": [public.decode()],
    }
    client = make_transport(options=as_text)
    out = client.connect(server.local_address)
    out.send(b"secret hello")
    got: list[Any] = []
    wait_until(
        lambda: got.extend(server.poll(0.001)) or got,
        timeout=T,
        what="the authenticated peer",
        pumps=[pump(client)],
    )
    assert list(got[0].recv()) == [b"secret hello"]
    got[0].send(b"secret reply")
    wait_until(
        lambda: b"secret reply" in out.recv(),
        timeout=T,
        what="the reply",
        pumps=[pump(client, server)],
    )
    assert server.stats()["refused_handshakes"] == 0


@pytest.mark.parametrize("who", ["wrong client key", "no keys", "wrong server key"])
def test_unauthenticated_peer_delivers_nothing(
    make_transport: MakeTransport,
    keydir: Path,
    caplog: pytest.LogCaptureFixture,
    who: str,
) -> None:
    server = make_transport(options=curve(keydir, "alice"))
    if who == "wrong client key":
        options = curve(keydir, "mallory")
    elif who == "no keys":
        options = {}
    else:
        options = {**curve(keydir, "alice"), "server_public_key": str(keydir / "mallory.key")}
    intruder = make_transport(options=options)
    conn = intruder.connect(server.local_address)
    for i in range(20):
        conn.send(b"let me in %d" % i)
    accepted: list[Any] = []
    wait_until(
        lambda: accepted.extend(server.poll(0.001)) or not conn.alive,
        timeout=T,
        what="the intruder's connection to be refused",
        pumps=[pump(intruder)],
    )
    for _ in range(20):
        accepted.extend(server.poll(0.005))
    assert accepted == [], "an unauthenticated peer delivered a frame"
    assert not conn.alive
    reason = conn.close_reason or ""
    assert any(
        why in reason
        for why in (
            "handshake failed",
            "hung up in the zmq handshake",
            "disconnected",
            "could not open the link",
        )
    ), reason


def test_refusal_is_logged_once_per_peer_not_per_attempt(
    make_transport: MakeTransport,
    keydir: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv.zmq")
    server = make_transport(options=curve(keydir, "alice"))
    public, secret = zmq.auth.load_certificate(str(keydir / "mallory.key_secret"))
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context.instance()
    attempts = []
    for _ in range(5):  # five connection attempts from the same host with the same key
        raw = ctx.socket(zmq.DEALER)
        raw.linger = 0
        raw.curve_publickey, raw.curve_secretkey = public, secret
        raw.curve_serverkey = zmq.auth.load_certificate(str(keydir / "server.key"))[0]
        raw.connect(f"tcp://{server.local_address}")
        raw.send(b"knock", zmq.NOBLOCK)
        attempts.append(raw)
    try:
        wait_until(
            lambda: server.stats()["refused_handshakes"] >= 5,
            timeout=T,
            what="five refused attempts",
            pumps=[pump(server)],
        )
        assert server.poll(0.01) == ()
    finally:
        for raw in attempts:
            raw.close()
    mine = [m for m in refusals(caplog) if public.decode() in m]
    assert len(mine) == 1, refusals(caplog)


def test_non_loopback_bind_without_keys_is_refused_before_binding(
    make_transport: MakeTransport,
) -> None:
    gc.collect()  # earlier tests' garbage closes its sockets now, not while we count
    fds = len(os.listdir("/proc/self/fd"))
    for host in ("0.0.0.0", "::", socket.gethostname(), "192.0.2.2"):
        with pytest.raises(ConfigError, match="insecure") as err:
            make_transport(host, advertise="127.0.0.1")
        assert "p2pkv keys" in str(err.value)
    gc.collect()
    assert len(os.listdir("/proc/self/fd")) <= fds  # nothing was bound or left open


def test_insecure_is_allowed_and_warned_at_every_start(
    make_transport: MakeTransport,
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv.zmq")
    for _ in range(2):
        make_transport("0.0.0.0", advertise="127.0.0.1", insecure=True)
    warnings = [r for r in caplog.records if "insecure: true" in r.getMessage()]
    assert len(warnings) == 2 and all(r.levelno == logging.WARNING for r in warnings)


def test_keys_allow_a_non_loopback_bind(make_transport: MakeTransport, keydir: Path) -> None:
    server = make_transport("0.0.0.0", advertise="127.0.0.1", options=curve(keydir, "alice"))
    client = make_transport(options=curve(keydir, "alice"))
    client.connect(server.local_address).send(b"over CURVE")
    got: list[Any] = []
    wait_until(
        lambda: got.extend(server.poll(0.001)) or got,
        timeout=T,
        what="the peer",
        pumps=[pump(client)],
    )
    assert list(got[0].recv()) == [b"over CURVE"]


def test_curve_option_errors_are_clear_and_never_echo_keys(
    make_transport: MakeTransport,
    keydir: Path,
) -> None:
    full = curve(keydir, "alice")
    with pytest.raises(ConfigError, match="allowed_client_keys"):
        make_transport(options={k: v for k, v in full.items() if k != "allowed_client_keys"})
    with pytest.raises(ConfigError, match="insecure"):
        make_transport(options={**full, "insecure": True})
    with pytest.raises(ConfigError, match="server_secret_key") as err:
        make_transport(options={**full, "server_secret_key": "s3cret-but-not-a-key"})
    assert "s3cret" not in str(err.value)
    with pytest.raises(ConfigError, match="no secret key"):
        make_transport(options={**full, "client_secret_key": str(keydir / "alice.key")})
    with pytest.raises(ConfigError, match="client_secret_key") as err:
        make_transport(options={**full, "client_secret_key": "~" * 40})  # not Z85
    assert "~" * 40 not in str(err.value)
    with pytest.raises(ConfigError, match="allowed_client_keys"):
        make_transport(options={**full, "allowed_client_keys": str(keydir / "alice.key")})
    empty = keydir / "empty"
    empty.mkdir()
    with pytest.raises(ConfigError, match=r"no \*\.key files"):
        make_transport(options={**full, "allowed_client_keys": [str(empty)]})


@pytest.mark.parametrize(
    "mismatch",
    [
        "different server key pair",
        "keys on the listener only",
        "keys on the dialer only",
        "client key not allowed",
    ],
)
def test_a_curve_mismatch_is_named_on_the_dialing_side(
    make_transport: MakeTransport,
    keydir: Path,
    mismatch: str,
) -> None:
    """The dialer's connection dies fast with a reason naming the security mismatch, not a
    bare disconnect (the listener alone used to say why)."""
    listener_options, dialer_options = curve(keydir, "alice"), curve(keydir, "alice")
    if mismatch == "different server key pair":
        dialer_options["server_public_key"] = str(keydir / "mallory.key")
    elif mismatch == "keys on the listener only":
        dialer_options = {}
    elif mismatch == "keys on the dialer only":
        listener_options = {}
    else:
        dialer_options = curve(keydir, "mallory")
    listener = make_transport(options=listener_options)
    dialer = make_transport(options=dialer_options)
    conn = dialer.connect(listener.local_address)
    wait_until(
        lambda: not conn.alive,
        timeout=T,
        what="the mismatched dial to die",
        pumps=[pump(dialer, listener)],
    )
    died = time.monotonic()
    reason = conn.close_reason or ""
    assert "security" in reason and listener.local_address in reason, reason
    again = dialer.connect(listener.local_address)
    if time.monotonic() - died < DIAL_BACKOFF / 2:  # else the backoff may be over: a new dial
        assert not again.alive and "security" in (again.close_reason or ""), "not remembered"
