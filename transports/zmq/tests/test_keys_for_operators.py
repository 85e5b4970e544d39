"""Keys an operator can live with: what a Secret mount gives is accepted, an empty or
unreadable key directory is refused naming the fix, ``p2pkv keys`` never replaces a fleet's
keys unasked, the rotation steps keep a usable directory at every moment, and a changed
directory is re-read (client pair and allowed keys; the server pair stays)."""

from __future__ import annotations

import base64
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import pytest
from p2pkv.cli import main as p2pkv_main
from p2pkv.errors import ConfigError
from p2pkv_zmq.fleet_dir import RELOAD_INTERVAL, LiveKeys, read_fleet_dir
from p2pkv_zmq.options import ZmqOptions
from p2pkv_zmq.rotation import rotate, rotate_secret
from p2pkv_zmq.security import curve_keys

ROOT_ONLY = os.geteuid() == 0


def fleet(directory: Path) -> Path:
    assert p2pkv_main(["keys", "--fleet", "--dir", str(directory)]) == 0
    return directory


def keys_of(environ: dict[str, str]) -> object:
    return curve_keys("10.0.0.1", ZmqOptions(), curve_supported=True, environ=environ)


@pytest.mark.parametrize("mode", [0o400, 0o440])
def test_a_secret_mounts_modes_are_accepted_quietly(
    tmp_path: Path, mode: int, caplog: pytest.LogCaptureFixture
) -> None:
    keys = fleet(tmp_path / "keys")
    for path in keys.iterdir():
        path.chmod(mode)
    with caplog.at_level(logging.WARNING):
        read_fleet_dir(keys)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_a_world_readable_secret_key_names_the_secrets_fix(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = fleet(tmp_path / "keys")
    (keys / "client.key_secret").chmod(0o644)
    with caplog.at_level(logging.WARNING):
        read_fleet_dir(keys)
    assert [r.getMessage() for r in caplog.records] == [
        f"CURVE secret key file {keys / 'client.key_secret'} is readable or writable by every "
        "user: set the Secret volume's defaultMode to 0400 (or 0440 with the pod's fsGroup); "
        "outside Kubernetes, chmod 600 it"
    ]


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_curve_dir_is_refused_not_insecure(value: str) -> None:
    with pytest.raises(ConfigError) as refused:
        keys_of({"P2PKV_CURVE_DIR": value})
    assert str(refused.value) == (
        "P2PKV_CURVE_DIR is set but empty: set it to the directory where the fleet's key "
        "Secret is mounted, or unset it (a tier without keys must say insecure: true)"
    )


@pytest.mark.skipif(not ROOT_ONLY, reason="drops privileges to a user the files deny")
def test_an_unreadable_key_file_names_the_fix() -> None:
    """As root, a forked child running as nobody reads a mount only root may read (mode 0400,
    owned by root: what kubelet makes of defaultMode 0400 without an fsGroup)."""
    base = Path(tempfile.mkdtemp(prefix="p2pkv-keys-"))
    try:
        base.chmod(0o755)
        keys = fleet(base / "keys")
        keys.chmod(0o755)
        for path in keys.iterdir():
            path.chmod(0o400)
        message = as_nobody(lambda: read_fleet_dir(keys))
    finally:
        shutil.rmtree(base)
    assert message == (
        f"P2PKV_CURVE_DIR: server.key_secret: cannot read key file {keys / 'server.key_secret'}: "
        "this process (uid 65534, gid 65534) may not read it: give it read access (a Secret "
        "volume: the pod's securityContext.fsGroup and the volume's defaultMode 0440)"
    )


def as_nobody(call: Callable[[], object]) -> str:
    """Run ``call`` in a forked child as uid/gid 65534; the ``ConfigError`` it raised."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        message = "no error"
        try:
            os.close(read)
            os.setgid(65534)
            os.setuid(65534)
            call()
        except BaseException as exc:
            message = str(exc)
        os.write(write, message.encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        message = pipe.read().decode()
    os.waitpid(pid, 0)
    return message


def test_an_unlistable_key_directory_names_the_fix(tmp_path: Path) -> None:
    keys = fleet(tmp_path / "keys")
    keys.chmod(0o000)
    try:
        if os.access(keys, os.R_OK):
            pytest.skip("this user reads any directory (root)")
        with pytest.raises(ConfigError, match="cannot be listed by this process"):
            read_fleet_dir(keys)
    finally:
        keys.chmod(0o755)


def test_keys_never_replace_a_fleets_keys_unasked(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    keys = fleet(tmp_path / "keys")
    before = {p.name: p.read_bytes() for p in keys.iterdir()}
    capsys.readouterr()
    assert p2pkv_main(["keys", "--fleet", "--dir", str(keys)]) == 2
    assert capsys.readouterr().err == (
        f"p2pkv keys: {keys / 'server.key'} exists: {keys} holds a fleet's keys. Rotate them "
        f"without an outage (`p2pkv keys --rotate begin --dir {keys}`, docs/security.md), or "
        "pass --force to replace them (every peer still on the old keys is then refused)\n"
    )
    assert {p.name: p.read_bytes() for p in keys.iterdir()} == before
    assert p2pkv_main(["keys", "--rotate", "begin", "--dir", str(keys), "--force"]) == 2
    assert capsys.readouterr().err == (
        "p2pkv keys: --rotate replaces only what its step changes: drop --force\n"
    )


def test_each_rotation_step_keeps_old_and_new_admitted_until_finish(tmp_path: Path) -> None:
    keys = fleet(tmp_path / "keys")
    first = read_fleet_dir(keys)
    for step, admitted_old in (("begin", True), ("switch", True), ("finish", False)):
        assert p2pkv_main(["keys", "--rotate", step, "--dir", str(keys)]) == 0
        now = read_fleet_dir(keys)
        if step == "begin":
            assert read_fleet_dir(keys, "client-next").client_public not in first.allowed
        assert now.server_secret == first.server_secret
        assert (next(iter(first.allowed)) in now.allowed) is admitted_old
        assert len(now.allowed) == (2 if admitted_old else 1)
    assert now.client_secret != first.client_secret
    assert sorted(p.name for p in keys.iterdir()) == [
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]


@pytest.mark.parametrize(
    "step, state, message",
    [
        ("switch", {}, "no client-next.key_secret: run `begin` first"),
        (
            "finish",
            {},
            "not switched yet (client-previous.key missing, or client-next present): "
            "run `switch` first",
        ),
        (
            "begin",
            {"client-next.key_secret": "x"},
            "a rotation is already under way (client-next "
            "or client-previous is present): run `switch` "
            "or `finish`",
        ),
    ],
)
def test_a_step_out_of_order_says_which_to_run(
    step: str, state: dict[str, str], message: str
) -> None:
    files = {"server.key_secret": "s", "client.key_secret": "c", "client.key": "p", **state}
    with pytest.raises(ConfigError) as refused:
        rotate(files, step)  # type: ignore[arg-type]
    assert str(refused.value) == message


def test_a_secret_is_rotated_as_json_without_its_server_fields(tmp_path: Path) -> None:
    keys = fleet(tmp_path / "keys")
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {
            "name": "p2pkv-curve",
            "namespace": "llm-d",
            "uid": "u",
            "resourceVersion": "7",
        },
        "data": {p.name: base64.b64encode(p.read_bytes()).decode() for p in keys.iterdir()},
    }
    text, hint = rotate_secret(json.dumps(secret), "begin")
    after = json.loads(text)
    assert hint.endswith(
        "check every pod with `p2pkv probe --client-key client-next`, then run switch"
    )
    assert after["metadata"] == {"name": "p2pkv-curve", "namespace": "llm-d"}
    assert sorted(after["data"]) == [
        "client-next.key",
        "client-next.key_secret",
        "client.key",
        "client.key_secret",
        "server.key",
        "server.key_secret",
    ]
    with pytest.raises(ConfigError, match=r"^not a Secret with data"):
        rotate_secret("{}", "begin")
    as_yaml = "apiVersion: v1\nkind: Secret\ndata:\n  server.key: eA==\n"
    with pytest.raises(ConfigError, match=r"^the Secret is YAML; --from takes JSON"):
        rotate_secret(as_yaml, "begin")


def test_a_changed_directory_is_reread_but_the_server_pair_stays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    keys = fleet(tmp_path / "keys")
    now = [0.0]
    live = LiveKeys(keys, clock=lambda: now[0])
    first = live.current()
    other = fleet(tmp_path / "other")
    for path in other.iterdir():
        shutil.copy(path, keys / path.name)
    assert live.current() is first  # not looked at again yet
    now[0] += RELOAD_INTERVAL
    with caplog.at_level(logging.WARNING):
        second = live.current()
    assert second.client_secret != first.client_secret
    assert second.server_secret == first.server_secret
    assert "server key pair" in caplog.text
    (keys / "client.key_secret").write_text("garbage")
    now[0] += RELOAD_INTERVAL
    assert live.current() is second  # unreadable: the last good keys stay
