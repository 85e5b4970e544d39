"""A fleet's CURVE keys from one directory (``$P2PKV_CURVE_DIR``, a mounted Kubernetes
Secret): what ``p2pkv keys --secret`` prints, mounted as Kubernetes mounts it, connects
identical replicas whose tier entries name no key; other fleets' keys are refused."""

from __future__ import annotations

import base64
import shutil
from pathlib import Path
from typing import Any

import pytest
from p2pkv.cli import main as p2pkv_main
from p2pkv.errors import ConfigError
from p2pkv.testing.waiting import wait_until
from p2pkv_zmq.options import CURVE_DIR_ENV
from zmq_fixtures import MakeTransport

T = 5.0


def pump(*transports: Any) -> Any:
    return lambda: [t.poll(0.001) for t in transports]


def mounted_secret(name: str, into: Path, capsys: pytest.CaptureFixture[str]) -> Path:
    """``p2pkv keys --secret name``, its data written into ``into`` as a Secret volume with
    ``defaultMode: 0400`` would be (one file per key)."""
    capsys.readouterr()
    assert p2pkv_main(["keys", "--secret", name, "--namespace", "llm-d"]) == 0
    manifest = capsys.readouterr().out.splitlines()
    assert manifest[:2] == ["apiVersion: v1", "kind: Secret"]
    assert f"  name: {name}" in manifest and "  namespace: llm-d" in manifest
    data = manifest[manifest.index("data:") + 1 :]
    into.mkdir()
    for line in data:
        file, _, encoded = line.strip().partition(": ")
        (into / file).write_bytes(base64.b64decode(encoded))
        (into / file).chmod(0o400)
    assert sorted(p.name for p in into.iterdir()) == [
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    return into


def delivered(sender: Any, receiver: Any, frame: bytes) -> list[Any]:
    """``sender`` dials ``receiver`` and sends ``frame``; the connections ``receiver``
    accepted (empty when it refused the dial)."""
    return dial(sender, receiver, frame)[1]


def dial(sender: Any, receiver: Any, frame: bytes) -> tuple[Any, list[Any]]:
    """As :func:`delivered`, with the sender's connection first."""
    conn = sender.connect(receiver.local_address)
    conn.send(frame)
    accepted: list[Any] = []
    wait_until(
        lambda: accepted.extend(receiver.poll(0.001)) or accepted or not conn.alive,
        timeout=T,
        what="the dial's outcome",
        pumps=[pump(sender)],
    )
    return conn, accepted


def test_replicas_sharing_the_secret_connect_with_curve(
    make_transport: MakeTransport,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CURVE_DIR_ENV, str(mounted_secret("p2pkv-curve", tmp_path / "s", capsys)))
    a, b = make_transport(), make_transport()  # no key option: the entry names no path
    out, accepted = dial(a, b, b"hello")
    assert len(accepted) == 1 and list(accepted[0].recv()) == [b"hello"]
    accepted[0].send(b"back")
    wait_until(lambda: b"back" in out.recv(), timeout=T, what="the reply", pumps=[pump(a, b)])
    assert b.stats()["refused_handshakes"] == 0


def test_another_fleets_keys_are_refused(
    make_transport: MakeTransport,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CURVE_DIR_ENV, str(mounted_secret("ours", tmp_path / "ours", capsys)))
    server = make_transport()
    monkeypatch.setenv(CURVE_DIR_ENV, str(mounted_secret("theirs", tmp_path / "theirs", capsys)))
    intruder = make_transport()
    assert delivered(intruder, server, b"let me in") == []


def test_per_instance_client_keys_sit_beside_the_fleet_pairs(
    make_transport: MakeTransport,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fleet = mounted_secret("fleet", tmp_path / "fleet", capsys)
    assert p2pkv_main(["keys", "--dir", str(tmp_path), "--name", "alice"]) == 0
    shutil.copy(tmp_path / "alice.key", fleet / "alice.key")  # alice's public key, allowed
    alice = tmp_path / "alice-dir"  # alice's own directory: the fleet's server pair, her client
    alice.mkdir()
    for file in ("server.key", "server.key_secret"):
        shutil.copy(fleet / file, alice / file)
    shutil.copy(tmp_path / "alice.key", alice / "client.key")
    shutil.copy(tmp_path / "alice.key_secret", alice / "client.key_secret")
    monkeypatch.setenv(CURVE_DIR_ENV, str(fleet))
    server = make_transport()
    monkeypatch.setenv(CURVE_DIR_ENV, str(alice))
    accepted = delivered(make_transport(), server, b"from alice")
    assert len(accepted) == 1 and list(accepted[0].recv()) == [b"from alice"]


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "is not a directory"),
        ("no client pair", "no client.key_secret"),
        ("no client key", "no client public key"),
    ],
)
def test_a_broken_key_directory_names_what_is_missing(
    make_transport: MakeTransport,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    setup: str,
    message: str,
) -> None:
    directory = tmp_path / "missing"
    if setup != "missing":
        directory = mounted_secret("s", tmp_path / "s", capsys)
        for file in ["client.key_secret"] if setup == "no client pair" else ["client.key"]:
            (directory / file).unlink()
    monkeypatch.setenv(CURVE_DIR_ENV, str(directory))
    with pytest.raises(ConfigError, match=message) as raised:
        make_transport()
    assert CURVE_DIR_ENV in str(raised.value)


def test_insecure_and_a_key_directory_contradict(
    make_transport: MakeTransport,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(CURVE_DIR_ENV, str(mounted_secret("s", tmp_path / "s", capsys)))
    with pytest.raises(ConfigError, match=f"unset {CURVE_DIR_ENV} or drop insecure"):
        make_transport(insecure=True)


def test_no_keys_on_a_routable_host_names_the_variable(
    make_transport: MakeTransport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(CURVE_DIR_ENV, raising=False)
    with pytest.raises(ConfigError, match=f"set {CURVE_DIR_ENV} to a directory"):
        make_transport(host="0.0.0.0", advertise="10.0.0.1")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--secret", "Not_A_Name"], "not a valid Kubernetes name"),
        (["--fleet", "--name", "x"], "drop --name"),
        (["--namespace", "ns"], "--namespace goes with --secret"),
    ],
)
def test_keys_misuse_is_one_line_naming_the_fix(
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    message: str,
) -> None:
    assert p2pkv_main(["keys", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_keys_fleet_writes_the_directory_and_refuses_to_overwrite(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    make_transport: MakeTransport,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert p2pkv_main(["keys", "--fleet", "--dir", str(tmp_path / "k")]) == 0
    assert f"{CURVE_DIR_ENV}=" in capsys.readouterr().out
    assert p2pkv_main(["keys", "--fleet", "--dir", str(tmp_path / "k")]) == 2
    assert "exists" in capsys.readouterr().err
    monkeypatch.setenv(CURVE_DIR_ENV, str(tmp_path / "k"))
    a, b = make_transport(), make_transport()
    assert len(delivered(a, b, b"hi")) == 1
