"""``p2pkv check-config`` on vLLM's ``--kv-transfer-config``, as an operator runs it.

Each row is the real ``p2pkv`` console script in a subprocess (the environment of a vLLM
instance, no vLLM needed): its exit status (0 would start, 1 a valid config that runs no
p2pkv tier, 2 a config the tier would refuse or a usage error) and, on failure, one stderr
line naming the input and the fix. Among the rows:
the two mistakes the docs/vllm.md recipe used to make (``allowed_client_keys`` as a string, a
public key file as a secret key).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("zmq", reason="needs pyzmq (p2pkv-zmq)")
pytest.importorskip("nixl._api", reason="needs NIXL (scripts/install.sh installs it lean)")

SCRIPT = Path(sys.executable).parent / "p2pkv"


def p2pkv(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    base = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("P2PKV_", "VLLM_P2P_")) and k != "PYTHONHASHSEED"
    }
    base.update({"UCX_NET_DEVICES": "lo", "COLUMNS": "60"}, **env)
    command = [str(SCRIPT)] if SCRIPT.exists() else [sys.executable, "-m", "p2pkv.cli"]
    return subprocess.run(
        [*command, *args], env=base, capture_output=True, text=True, timeout=60, check=False
    )


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The recipe's keys: a server pair, a client pair per instance, clients/ of public keys."""
    d = tmp_path_factory.mktemp("keys")
    for name in ("server", "prefill-0", "decode-0"):
        assert p2pkv("keys", "--dir", str(d), "--name", name).returncode == 0
    (d / "clients").mkdir()
    for name in ("prefill-0", "decode-0"):
        (d / "clients" / f"{name}.key").write_text((d / f"{name}.key").read_text())
    return d


def kv_config(keys: Path, *, extra: dict[str, Any] | None = None, **tier: Any) -> str:
    """A --kv-transfer-config like the recipe's (prefill-0), ``tier`` keys overriding."""
    options = {
        "server_secret_key": str(keys / "server.key_secret"),
        "client_secret_key": str(keys / "prefill-0.key_secret"),
        "allowed_client_keys": [str(keys / "clients")],
    }
    entry = {
        "type": "P2PKVTier",
        "module_path": "p2pkv_vllm",
        "control": "zmq",
        "data": "nixl",
        "host": "127.0.0.1",
        "control_options": options,
        **tier,
    }
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 24,
                "secondary_tiers": [entry],
                **(extra or {}),
            },
        }
    )


def refused(proc: subprocess.CompletedProcess[str], status: int, *names: str) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr
    assert proc.returncode == status, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("p2pkv check-config: "), proc.stderr
    for name in names:
        assert name in lines[0], (name, lines[0])


def test_the_recipe_config_would_start_on_every_dp_rank(keys: Path) -> None:
    proc = p2pkv(
        "check-config",
        "--kv-transfer-config",
        kv_config(keys),
        "--data-parallel-size",
        "2",
        VLLM_P2P_SIDE_CHANNEL_PORT="6710",
        PYTHONHASHSEED="0",
    )
    assert proc.returncode == 0, proc.stderr
    assert (
        "secondary_tiers[0]: ok: p2pkv's P2PKVTier (module_path 'p2pkv_vllm'): control "
        "zmq, data nixl"
    ) in proc.stdout
    assert "ports 6710..6711" in proc.stdout
    assert proc.stderr == ""


def test_an_unset_seed_is_a_hint_not_a_refusal(keys: Path) -> None:
    proc = p2pkv("check-config", "--kv-transfer-config", kv_config(keys))
    assert proc.returncode == 0, proc.stderr
    assert "hint: PYTHONHASHSEED is unset or random" in proc.stderr


def test_old_recipe_mistake_allowed_client_keys_as_a_string(keys: Path) -> None:
    options = {
        "server_secret_key": str(keys / "server.key_secret"),
        "client_secret_key": str(keys / "prefill-0.key_secret"),
        "allowed_client_keys": str(keys / "clients"),
    }
    proc = p2pkv("check-config", "--kv-transfer-config", kv_config(keys, control_options=options))
    refused(proc, 2, "secondary_tiers[0]", "'allowed_client_keys'", "list")


def test_old_recipe_mistake_a_public_key_file_as_the_secret_key(keys: Path) -> None:
    options = {
        "server_secret_key": str(keys / "server.key"),
        "client_secret_key": str(keys / "prefill-0.key"),
        "allowed_client_keys": [str(keys / "clients")],
    }
    proc = p2pkv("check-config", "--kv-transfer-config", kv_config(keys, control_options=options))
    refused(proc, 2, "'server_secret_key'", "server.key holds no secret key", ".key_secret")


def test_another_connector_would_start_without_the_tier(keys: Path) -> None:
    config = {**json.loads(kv_config(keys)), "kv_connector": "NixlConnector"}
    refused(
        p2pkv("check-config", "--kv-transfer-config", json.dumps(config)),
        1,
        "'NixlConnector'",
        '"OffloadingConnector"',
    )


def test_the_default_spec_would_start_without_the_tier(keys: Path) -> None:
    config = json.loads(kv_config(keys))
    del config["kv_connector_extra_config"]["spec_name"]  # vLLM's default: CPUOffloadingSpec
    refused(
        p2pkv("check-config", "--kv-transfer-config", json.dumps(config)),
        1,
        "'CPUOffloadingSpec'",
        '"TieringOffloadingSpec"',
    )


@pytest.mark.parametrize(
    ("tier", "extra", "env", "names"),
    [
        ({"prot": 5711}, None, {}, ("unknown tier config key(s) ['prot']", "valid keys")),
        ({"locality": "MARS"}, None, {}, ("'MARS'", "LOCAL, REMOTE")),
        ({"type": "P2PTier"}, None, {}, ("'P2PTier'", "'P2PKVTier'")),
        ({"control": "zmqq"}, None, {}, ("'zmqq'",)),
        ({"data_options": {"backend": ["UCX"]}}, None, {}, ("'backend'", "backends")),
        (
            {},
            None,
            {"VLLM_P2P_SIDE_CHANNEL_PORT": "65535"},
            ("VLLM_P2P_SIDE_CHANNEL_PORT", "rank 1", "65536"),
        ),
    ],
    ids=["key typo", "locality", "type", "transport name", "data option", "last DP rank's port"],
)
def test_a_config_the_tier_would_refuse_exits_2(
    keys: Path,
    tier: dict[str, Any],
    extra: dict[str, Any] | None,
    env: dict[str, str],
    names: tuple[str, ...],
) -> None:
    proc = p2pkv(
        "check-config",
        "--kv-transfer-config",
        kv_config(keys, extra=extra, **tier),
        "--data-parallel-size",
        "2",
        **env,
    )
    refused(proc, 2, "secondary_tiers[0]", *names)


@pytest.mark.parametrize(
    ("config", "names"),
    [
        ("[1]", ("--kv-transfer-config", "JSON object")),
        ("{", ("--kv-transfer-config", "not valid JSON")),
        ('{"kv_connector": "OffloadingConnector"}', ("secondary_tiers", "docs/vllm.md")),
        (
            json.dumps({"kv_connector_extra_config": {"secondary_tiers": [{"type": "fs"}]}}),
            ("'p2pkv_vllm'", "'p2pkv'", "nothing for p2pkv to check"),
        ),
    ],
    ids=["not an object", "not JSON", "no secondary tiers", "no p2pkv entry"],
)
def test_a_malformed_command_line_exits_2(config: str, names: tuple[str, ...]) -> None:
    refused(p2pkv("check-config", "--kv-transfer-config", config), 2, *names)


def _guide(port: int, **more: Any) -> str:
    """The llm-d guide's --kv-transfer-config, its tier entry as the guide writes it."""
    entry = {"type": "p2p", "host": "127.0.0.1", "port": port, **more}
    return json.dumps(
        {
            "kv_connector": "OffloadingConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {
                "spec_name": "TieringOffloadingSpec",
                "cpu_bytes_to_use": 1 << 24,
                "secondary_tiers": [entry],
            },
        }
    )


def test_the_guide_s_entry_says_which_tier_vllm_would_build() -> None:
    """Without the opt-in vLLM builds its own tier: p2pkv says so and how to switch."""
    refused(
        p2pkv("check-config", "--kv-transfer-config", _guide(7777)),
        1,
        "secondary_tiers[0]",
        "vLLM's built-in",
        "P2PKV_REPLACE_P2P=1",
    )


def test_the_guide_s_entry_unedited_checks_in_zero_edit_mode() -> None:
    proc = p2pkv(
        "check-config",
        "--kv-transfer-config",
        _guide(7777, backends=["UCX"], unbound_store_timeout_s=90),
        P2PKV_REPLACE_P2P="1",
        PYTHONHASHSEED="0",
    )
    assert proc.returncode == 0, proc.stderr
    assert "p2pkv's P2PKVTier (type 'p2p' with P2PKV_REPLACE_P2P=1: zero-edit mode)" in proc.stdout
    assert "ports 7777..7777" in proc.stdout


def test_an_explicit_p2pkv_type_needs_no_module_path() -> None:
    proc = p2pkv(
        "check-config",
        "--kv-transfer-config",
        _guide(7777).replace('"type": "p2p"', '"type": "p2pkv"'),
        PYTHONHASHSEED="0",
    )
    assert proc.returncode == 0, proc.stderr
    assert "registered by p2pkv-vllm's vLLM plugin" in proc.stdout


def test_a_garbled_opt_in_is_refused_as_the_engine_refuses_it() -> None:
    refused(
        p2pkv("check-config", "--kv-transfer-config", _guide(7777), P2PKV_REPLACE_P2P="maybe"),
        2,
        "P2PKV_REPLACE_P2P='maybe'",
        "set it to 1",
    )
