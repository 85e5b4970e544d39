"""The tier's start line (``p2pkv_vllm.start_line``): what it says of each security mode and
peer policy, and that vLLM's own default logging prints it.

The first tests need no vLLM. The last one (``-m vllm``: ``nox -s vllm``, ``vllm_release``
and ``engine``) configures logging in a fresh process as an engine process of that release
does at default settings, logs the line, and finds it in the process's output. Real engines
printing it at default settings: ``test_engine_start_line.py``.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from typing import Any

import p2pkv
import pytest
from p2pkv_vllm.bridge import tier_config_from_keys, zero_edit_keys
from p2pkv_vllm.start_line import START_LOGGER, START_PREFIX, security_mode, start_line

RUN = {"model_name": "m", "dtype": "bfloat16", "tokens_per_hash": 16}


def config(keys: dict[str, Any], env: dict[str, str] | None = None) -> Any:
    return tier_config_from_keys(keys, dp_rank=1, run_config=RUN, hash_seed="s", environ=env or {})


def test_the_line_names_version_address_transports_security_and_peers() -> None:
    env = {"P2PKV_PEERS_ALLOW": "10.0.0.0/8", "P2PKV_PEERS_CONNECT": "peers.ns.svc:7777"}
    line = start_line(
        "P2PKVTier",
        "10.1.2.3:7778",
        config({"port": 7777}, env),
        {"P2PKV_CURVE_DIR": "/etc/p2pkv/curve"},
    )
    assert line == (
        f"{START_PREFIX} version {p2pkv.__version__}, address 10.1.2.3:7778 (dp rank 1), "
        "control zmq, data nixl, security CURVE (fleet keys from "
        "P2PKV_CURVE_DIR=/etc/p2pkv/curve), peers allow=10.0.0.0/8 "
        "connect=peers.ns.svc:7777 max_dialed=256 warm=32, entry type 'P2PKVTier'"
    )


def test_zero_edit_mode_says_it_replaced_the_builtin_tier_and_runs_insecure() -> None:
    keys = zero_edit_keys({"host": "10.1.2.3", "port": 7777})  # no P2PKV_CURVE_DIR here
    line = start_line("p2p", "10.1.2.3:7777", config(keys), {})
    assert "security none (insecure: anyone who reaches the port may open sessions)" in line
    assert line.endswith(
        "entry type 'p2p' (P2PKV_REPLACE_P2P=1: p2pkv in place of vLLM's built-in P2P tier)"
    )
    assert "peers allow=any connect=none max_dialed=256 warm=32" in line


@pytest.mark.parametrize(
    ("options", "env", "mode"),
    [
        (
            {
                "server_secret_key": "/k/s",
                "client_secret_key": "/k/c",
                "allowed_client_keys": ["/k"],
            },
            {"P2PKV_CURVE_DIR": "/etc/x"},
            "CURVE (keys from control_options)",
        ),
        ({}, {"P2PKV_CURVE_DIR": "/etc/x"}, "CURVE (fleet keys from P2PKV_CURVE_DIR=/etc/x)"),
        ({}, {"P2PKV_CURVE_DIR": ""}, "none (loopback bind)"),
        ({"insecure": True}, {}, "none (insecure: anyone who reaches the port may open sessions)"),
    ],
)
def test_security_mode_follows_the_zmq_policy(
    options: dict[str, Any], env: dict[str, str], mode: str
) -> None:
    assert security_mode(config({"control_options": options}), env) == mode


def test_another_control_transport_is_named() -> None:
    assert (
        security_mode(config({"control": "memory", "data": "memory"}), {})
        == "set by the 'memory' control transport"
    )


def test_the_line_goes_to_a_logger_under_vllm_s_tree() -> None:
    logger = logging.getLogger(START_LOGGER)
    assert logger.parent is not None and START_LOGGER.split(".")[0] == "vllm"


_CONFIGURE_AS_AN_ENGINE = """
import logging, sys
try:  # vLLM 0.32 and later: every engine process applies its LoggingConfig (defaults here)
    from vllm.config.logging import LoggingConfig
    from vllm.logger import configure_logging
    configure_logging(LoggingConfig())
except ImportError:  # vLLM 0.27.1: importing vllm.logger configures the vllm tree
    import vllm.logger
from p2pkv_vllm.bridge import tier_config_from_keys
from p2pkv_vllm.start_line import log_start
config = tier_config_from_keys({}, dp_rank=0, run_config={}, hash_seed="s", environ={})
log_start("p2p", "127.0.0.1:7777", config)
logging.getLogger("p2pkv.vllm.adapter").info("p2pkv INFO stays quiet by default")
"""


@pytest.mark.vllm
@pytest.mark.timeout(600)  # importing vLLM takes minutes on a busy 2-core machine
def test_vllm_s_default_logging_prints_the_line(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm.logger", reason="needs vLLM (nox -s vllm)")
    for name in ("VLLM_LOGGING_LEVEL", "VLLM_LOGGING_CONFIG_PATH", "VLLM_CONFIGURE_LOGGING"):
        monkeypatch.delenv(name, raising=False)
    out = subprocess.run(
        [sys.executable, "-c", _CONFIGURE_AS_AN_ENGINE],
        capture_output=True,
        text=True,
        timeout=540,
        check=True,
    )
    printed = out.stdout + out.stderr
    (line,) = [text for text in printed.splitlines() if START_PREFIX in text]
    assert "INFO" in line.split(START_PREFIX)[0] and "address 127.0.0.1:7777" in line, printed
    assert "stays quiet" not in printed
