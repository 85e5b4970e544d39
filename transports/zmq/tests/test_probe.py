"""``p2pkv probe`` against what can answer at a tier's address, each in its own process over
real zmq on loopback: the command is run as an operator (or a kubelet) runs it, and its exact
line and exit status are checked.

A p2pkv tier with this fleet's keys passes (and its log gets nothing above DEBUG, no session
opens); a closed port, a tier with another fleet's keys, a tier without keys when keys are
expected (and the reverse), a bare zmq socket, vLLM's built-in tier's socket type, a TCP
server that says nothing and one that speaks another protocol all fail, naming what
answered. Misuse exits 2. The engine-level cases (vLLM 0.27.1's built-in tier, a p2pkv
engine) are in plugins/vllm/tests/test_engine_probe.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import probe_targets
import pytest
from p2pkv import __version__
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR
from p2pkv.testing.child import Child
from p2pkv_zmq.keys import key_fingerprint, public_of, read_key
from p2pkv_zmq.options import CURVE_DIR_ENV

pytestmark = pytest.mark.timeout(120)
T = 30.0
WHAT = f"p2pkv {__version__}, control zmq, wire {WIRE_MAJOR}.{WIRE_MINOR}"
BUILTIN_FIX = (
    "the image lacks p2pkv-vllm, vLLM did not load its plugin (VLLM_PLUGINS), or "
    "P2PKV_REPLACE_P2P is not 1 on the engine"
)


def run_probe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``p2pkv probe ARGS`` in a process of its own: (exit status, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("P2PKV_", "VLLM_P2P"))}
    done = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "probe", *args],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def fleet(directory: Path) -> Path:
    assert run_probe_keys("--fleet", "--dir", str(directory)) == 0
    return directory


def run_probe_keys(*args: str) -> int:
    return subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", "keys", *args],
        capture_output=True,
        timeout=T,
        check=False,
    ).returncode


def keyed(directory: Path) -> str:
    """What an ok line says of a tier with the keys of ``directory``."""
    client = read_key(str(directory / "client.key"), "client", "public")
    return f"keys {fingerprint(directory)}, its client key {key_fingerprint(client)}"


def fingerprint(directory: Path) -> str:
    secret = read_key(str(directory / "server.key_secret"), "server", "secret")
    return key_fingerprint(public_of(secret))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fleet(tmp_path_factory.mktemp("fleet") / "keys")


@pytest.fixture(scope="module")
def other_keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fleet(tmp_path_factory.mktemp("other") / "keys")


def started(child: Child) -> str:
    """The address of a started target."""
    kind, address = child.recv(T, "the target's address")
    assert kind == "address"
    return str(address)


@pytest.fixture(scope="module")
def curve_tier(keys: Path) -> Iterator[tuple[Child, str]]:
    """A p2pkv tier with the fleet's keys (``$P2PKV_CURVE_DIR``)."""
    with Child(probe_targets.tier, {CURVE_DIR_ENV: str(keys)}, {}) as child:
        yield child, started(child)


@pytest.fixture(scope="module")
def insecure_tier() -> Iterator[str]:
    """A p2pkv tier without keys (``insecure: true``)."""
    with Child(probe_targets.tier, {}, {"control_options": {"insecure": True}}) as child:
        yield started(child)


def test_a_tier_with_the_fleets_keys_passes_and_is_left_undisturbed(
    curve_tier: tuple[Child, str], keys: Path
) -> None:
    child, address = curve_tier
    before = child.request("log", T)[1]
    for _ in range(3):
        status, out, err = run_probe(address, "--curve-dir", str(keys))
        assert (status, err) == (0, ""), err
        assert out == f"p2pkv tier at {address}: {WHAT}, CURVE ({keyed(keys)})\n"
    assert child.request("log", T)[1] == before  # nothing above DEBUG
    assert child.request("sessions", T) == ("sessions", 0)


def test_the_default_address_and_keys_are_the_tiers_own(
    curve_tier: tuple[Child, str], keys: Path
) -> None:
    """No address: the variables the tier reads under vLLM; no flag: ``$P2PKV_CURVE_DIR``."""
    _, address = curve_tier
    host, port = address.rsplit(":", 1)
    env = {
        "VLLM_P2P_SIDE_CHANNEL_HOST": host,
        "P2PKV_PORT": str(int(port) + 7),
        "VLLM_P2P_SIDE_CHANNEL_PORT": port,
        CURVE_DIR_ENV: str(keys),
    }
    status, out, err = run_probe(env=env)
    assert (status, err) == (0, "")
    assert out == f"p2pkv tier at {address}: {WHAT}, CURVE ({keyed(keys)})\n"


@pytest.mark.parametrize("ranks", ["--ranks", "--data-parallel-size"])
def test_every_rank_must_pass(curve_tier: tuple[Child, str], keys: Path, ranks: str) -> None:
    """``--data-parallel-size`` is vLLM's name for the same number."""
    _, address = curve_tier
    host, port = address.rsplit(":", 1)
    next_rank = f"{host}:{int(port) + 1}"
    status, out, err = run_probe(address, ranks, "2", "--curve-dir", str(keys))
    assert status == 1
    assert out == f"p2pkv tier at {address}: {WHAT}, CURVE ({keyed(keys)})\n"
    assert err.startswith(f"p2pkv probe: {next_rank}: ")


def test_a_paused_tier_fails_and_passes_again_when_resumed(keys: Path) -> None:
    """SIGSTOP: the kernel still accepts TCP, nothing speaks zmq; the probe says so within
    its timeout. After SIGCONT the next probe passes, and the stale probes opened no session
    and logged no warning."""
    with Child(probe_targets.tier, {CURVE_DIR_ENV: str(keys)}, {}) as child:
        address = started(child)
        child.pause()
        try:
            status, out, err = run_probe(address, "--curve-dir", str(keys), "--timeout", "1")
        finally:
            child.resume()
        assert (status, out) == (1, "")
        assert err == (
            f"p2pkv probe: {address}: it accepts TCP connections but sends no zmq "
            "greeting: a process stopped (SIGSTOP) or starved of CPU, or not a "
            "p2pkv tier\n"
        )
        status, out, err = run_probe(address, "--curve-dir", str(keys))
        assert (status, err) == (0, ""), err
        assert out == f"p2pkv tier at {address}: {WHAT}, CURVE ({keyed(keys)})\n"
        assert child.request("sessions", T) == ("sessions", 0)
        logged = child.request("log", T)[1]
        assert not [line for line in logged if not line.startswith("INFO ")], logged


def test_a_tier_whose_driver_stalls_is_not_taken_for_other_keys(keys: Path) -> None:
    """libzmq greets with CURVE, but the handshake waits for the ZAP answer that the tier's
    driver gives: the line says the tier is stalled, not that its keys differ."""
    with Child(probe_targets.tier, {CURVE_DIR_ENV: str(keys)}, {}) as child:
        address = started(child)
        assert child.request("stall", T) == ("ok",)
        try:
            status, out, err = run_probe(address, "--curve-dir", str(keys), "--timeout", "1")
        finally:
            assert child.request("go on", T) == ("ok",)
        assert (status, out) == (1, "")
        assert err == (
            f"p2pkv probe: {address}: a CURVE listener that completed no handshake "
            "within 0.5 s: a p2pkv tier still starting, or stopped (SIGSTOP) or "
            "starved of CPU\n"
        )
        status, out, err = run_probe(address, "--curve-dir", str(keys))
        assert (status, err) == (0, ""), err


def test_a_closed_port(keys: Path, refused_address: str) -> None:
    status, out, err = run_probe(refused_address, "--curve-dir", str(keys))
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {refused_address}: nothing listens there (connection "
        "refused): the tier is not up yet, or listens on another port "
        "(VLLM_P2P_SIDE_CHANNEL_PORT, + the DP rank)\n"
    )


def test_a_tier_with_another_fleets_keys(curve_tier: tuple[Child, str], other_keys: Path) -> None:
    child, address = curve_tier
    status, out, err = run_probe(address, "--curve-dir", str(other_keys))
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: a CURVE listener whose server key is not this "
        f"fleet's (keys {fingerprint(other_keys)}): it mounts another fleet's "
        "Secret, or a rotation not finished there\n"
    )
    assert child.request("sessions", T) == ("sessions", 0)


def test_a_tier_that_refuses_the_fleets_client_key(
    curve_tier: tuple[Child, str], keys: Path, tmp_path: Path
) -> None:
    """Same server pair, another client pair: the tier's allow-list refuses the probe."""
    _, address = curve_tier
    mixed = fleet(tmp_path / "mixed")
    for name in ("server.key", "server.key_secret"):
        (mixed / name).write_bytes((keys / name).read_bytes())
    status, out, err = run_probe(address, "--curve-dir", str(mixed))
    assert (status, out) == (1, "")
    client = read_key(str(mixed / "client.key"), "client", "public")
    assert err == (
        f"p2pkv probe: {address}: a CURVE listener refused this fleet's client key "
        f"({key_fingerprint(client)}): its allowed client keys are another "
        "fleet's (another Secret, or a rotation not finished there)\n"
    )


def test_an_insecure_tier_when_keys_are_expected(insecure_tier: str, keys: Path) -> None:
    status, out, err = run_probe(insecure_tier, "--curve-dir", str(keys))
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {insecure_tier}: a tier without authentication (insecure), "
        "but this fleet's keys are set: the engine lacks P2PKV_CURVE_DIR (or its "
        "entry says insecure: true)\n"
    )


def test_an_insecure_tier_with_insecure(insecure_tier: str) -> None:
    status, out, err = run_probe(insecure_tier, "--insecure")
    assert (status, err) == (0, "")
    assert out == f"p2pkv tier at {insecure_tier}: {WHAT}, no authentication (--insecure)\n"


def test_a_curve_tier_with_insecure(curve_tier: tuple[Child, str]) -> None:
    _, address = curve_tier
    status, out, err = run_probe(address, "--insecure")
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: a CURVE listener (a p2pkv tier with keys?), but "
        "the probe runs --insecure: give it the fleet's keys (P2PKV_CURVE_DIR or "
        "--curve-dir)\n"
    )


@pytest.mark.parametrize(
    "kind, named",
    [
        (
            "ROUTER",
            f"vLLM's built-in P2P tier (a zmq ROUTER without authentication), not p2pkv: "
            f"{BUILTIN_FIX}",
        ),
        (
            "PULL",
            "a zmq PULL accepted the connection but did not identify itself within 2 s: a "
            "p2pkv tier still starting, stopped (SIGSTOP) or starved of CPU, a p2pkv older "
            "than this probe, or not a p2pkv tier",
        ),
        ("REP", "a zmq REP without authentication: not a p2pkv tier"),
    ],
)
def test_a_plain_zmq_socket(kind: str, named: str) -> None:
    with Child(probe_targets.zmq_socket, kind) as child:
        address = started(child)
        status, out, err = run_probe(address, "--insecure", "--timeout", "2")
    assert (status, out) == (1, "")
    assert err == f"p2pkv probe: {address}: {named}\n"


def test_a_tcp_server_that_says_nothing() -> None:
    with Child(probe_targets.silent_server) as child:
        address = started(child)
        status, out, err = run_probe(address, "--insecure", "--timeout", "1")
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: it accepts TCP connections but sends no zmq "
        "greeting: a process stopped (SIGSTOP) or starved of CPU, or not a p2pkv "
        "tier\n"
    )


def test_a_server_of_another_protocol(keys: Path) -> None:
    with Child(probe_targets.talking_server, b"SSH-2.0-OpenSSH_9.6\r\n") as child:
        address = started(child)
        status, out, err = run_probe(address, "--curve-dir", str(keys), "--timeout", "2")
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: it answers with bytes that are not zmq "
        "(b'SSH-2.0-Op'): not a p2pkv tier\n"
    )


@pytest.mark.parametrize(
    "args, env, message",
    [
        (
            ["127.0.0.1:5710"],
            {},
            "no keys: set P2PKV_CURVE_DIR (or --curve-dir DIR) to the fleet's "
            "key directory, or pass --insecure for a tier without authentication",
        ),
        (
            ["127.0.0.1:5710"],
            {CURVE_DIR_ENV: " "},
            "P2PKV_CURVE_DIR is set but empty: set it to "
            "the fleet's key directory, or pass --insecure for a tier without keys",
        ),
        (
            ["10.0.0.1", "--insecure"],
            {},
            "malformed address '10.0.0.1': expected host:port or "
            "[ipv6]:port: give the tier's control address as HOST:PORT",
        ),
        (
            ["127.0.0.1:5710", "--insecure", "--ranks", "0"],
            {},
            "--ranks must be 1..1024 (the engine's data-parallel size), got 0",
        ),
        (
            ["127.0.0.1:5710", "--insecure", "--timeout", "nan"],
            {},
            "--timeout must be a number of seconds in (0, 3600], got nan",
        ),
        (
            ["127.0.0.1:5710", "--curve-dir", "/nonexistent/keys"],
            {},
            "--curve-dir="
            "'/nonexistent/keys' is not a directory: mount the fleet's key Secret there "
            "(`p2pkv keys --secret NAME` writes one)",
        ),
    ],
)
def test_misuse(args: list[str], env: dict[str, str], message: str) -> None:
    status, out, err = run_probe(*args, env=env)
    assert (status, out, err) == (2, "", f"p2pkv probe: {message}\n")


def test_a_key_directory_given_on_the_command_line_is_blamed_by_its_option(
    keys: Path,
) -> None:
    """Not ``$P2PKV_CURVE_DIR``, which this probe never read."""
    status, out, err = run_probe(
        "127.0.0.1:5710", "--curve-dir", str(keys), "--client-key", "client-next"
    )
    assert (status, out) == (2, "")
    assert err.startswith(f"p2pkv probe: --curve-dir: no client-next.key_secret in {keys} ")


def test_a_garbled_key_is_blamed_on_the_option_that_named_its_directory(
    keys: Path, tmp_path: Path
) -> None:
    """A garbled secret key under ``--curve-dir`` names that flag, not a zmq option the
    operator never wrote."""
    garbled = tmp_path / "garbled"
    garbled.mkdir()
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret"):
        (garbled / name).write_bytes((keys / name).read_bytes())
    (garbled / "server.key_secret").write_text("garbage\n")
    for secret in garbled.glob("*.key_secret"):
        secret.chmod(0o600)
    status, out, err = run_probe("127.0.0.1:5710", "--curve-dir", str(garbled))
    assert (status, out) == (2, "")
    assert err.startswith(f"p2pkv probe: --curve-dir: server.key_secret: {garbled}/"), err
    assert "zmq option" not in err


def test_insecure_and_keys_together() -> None:
    status, out, err = run_probe("127.0.0.1:5710", "--insecure", "--curve-dir", "/x")
    assert (status, out) == (2, "")
    assert err == (
        "p2pkv probe: argument --curve-dir: not allowed with argument --insecure "
        "(see 'p2pkv probe --help')\n"
    )
