"""TierConfig: precedence explicit > env > default, the DP port offset, every rejection."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.config import (
    DEFAULT_HOST,
    DEFAULT_PORT,
    Limits,
    TierConfig,
    Timeouts,
    config_fingerprint,
)
from p2pkv.errors import ConfigError

ENV = {"P2PKV_HOST": "envhost", "P2PKV_PORT": "6000"}


def test_defaults() -> None:
    cfg = TierConfig.from_dict({}, environ={})
    assert (cfg.control, cfg.data, cfg.host, cfg.port) == ("zmq", "nixl", DEFAULT_HOST, 5710)
    assert DEFAULT_PORT == 5710 and DEFAULT_HOST == "localhost"
    assert cfg.address == "localhost:5710"
    assert cfg.timeouts == Timeouts() and cfg.limits == Limits()
    assert TierConfig.from_dict(None, environ={}) == cfg


def test_env_beats_default() -> None:
    cfg = TierConfig.from_dict({}, environ=ENV)
    assert (cfg.host, cfg.port) == ("envhost", 6000)


def test_explicit_beats_env() -> None:
    cfg = TierConfig.from_dict({"host": "127.0.0.1", "port": 7000}, environ=ENV)
    assert (cfg.host, cfg.port) == ("127.0.0.1", 7000)


def test_empty_env_counts_as_unset() -> None:
    cfg = TierConfig.from_dict({}, environ={"P2PKV_HOST": "", "P2PKV_PORT": ""})
    assert (cfg.host, cfg.port) == (DEFAULT_HOST, DEFAULT_PORT)


def test_os_environ_is_the_default_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("P2PKV_PORT", "6100")
    monkeypatch.delenv("P2PKV_HOST", raising=False)
    assert TierConfig.from_dict({}).port == 6100


def test_adapter_env_names_come_first() -> None:
    env = {"ENGINE_HOST": "enginehost", "P2PKV_HOST": "envhost"}
    cfg = TierConfig.from_dict({}, environ=env, host_env=("ENGINE_HOST", "P2PKV_HOST"))
    assert cfg.host == "enginehost"


@given(st.integers(1, 65535), st.integers(0, 300))
def test_dp_rank_offsets_the_port(base: int, rank: int) -> None:
    if base + rank > 65535:
        with pytest.raises(ConfigError, match=r"outside 1\.\.65535"):
            TierConfig.from_dict({"port": base}, dp_rank=rank, environ={})
    else:
        cfg = TierConfig.from_dict({"port": base}, dp_rank=rank, environ={})
        assert (cfg.base_port, cfg.dp_rank, cfg.port) == (base, rank, base + rank)


def test_dp_offset_applies_to_env_port() -> None:
    assert TierConfig.from_dict({}, dp_rank=3, environ=ENV).port == 6003


def test_port_zero_stays_ephemeral_with_dp_rank() -> None:
    assert TierConfig.from_dict({"port": 0}, dp_rank=5, environ={}).port == 0


def test_ipv6_address() -> None:
    assert TierConfig.from_dict({"host": "::1", "port": 1}, environ={}).address == "[::1]:1"


def test_full_config() -> None:
    cfg = TierConfig.from_dict(
        {
            "type": "p2p",
            "control": "memory",
            "data": "memory",
            "control_options": {"max_queued_frames": 5},
            "data_options": {"completion_polls": 1},
            "timeouts": {"load": 2, "handshake": 0.5},
            "limits": {"max_keys_per_message": 10},
            "fingerprint": "abc",
            "hash_seed": "seed",
        },
        environ={},
    )
    assert (cfg.control, cfg.data) == ("memory", "memory")
    assert cfg.control_options == {"max_queued_frames": 5}
    assert cfg.data_options == {"completion_polls": 1}
    assert cfg.timeouts.load == 2.0 and isinstance(cfg.timeouts.load, float)
    assert cfg.timeouts.handshake == 0.5
    assert cfg.limits.max_keys_per_message == 10
    assert (cfg.fingerprint, cfg.hash_seed) == ("abc", "seed")
    assert cfg.tier_type == "p2p"


@pytest.mark.parametrize(
    ("d", "env", "dp_rank", "match"),
    [
        ({"bogus": 1}, {}, 0, r"unknown tier config key\(s\) \['bogus'\]; valid keys: type, "),
        ({"hots": "h"}, {}, 0, r"\['hots'\]; valid keys: .*; did you mean 'host'\?"),
        ({"dp_rank": 1}, {}, 0, r"unknown tier config key\(s\) \['dp_rank'\]"),
        ({"host_setting": "x"}, {}, 0, r"unknown tier config key\(s\) \['host_setting'\]"),
        ({"type": 1}, {}, 0, "'type' must be a string"),
        ({"control": 1}, {}, 0, "'control' must be a string"),
        ({"data": None}, {}, 0, "'data' must be a string"),
        ({"host": 5}, {}, 0, "'host' must be a string"),
        ({"host": ""}, {}, 0, "key 'host' must be a non-empty string, got ''"),
        ({"host": " "}, {}, 0, "key 'host' must be a non-empty string"),
        ({"port": "5710"}, {}, 0, "'port' must be an integer"),
        ({"port": True}, {}, 0, "'port' must be an integer"),
        ({"port": 5.0}, {}, 0, "'port' must be an integer"),
        ({}, {"P2PKV_PORT": "abc"}, 0, "environment variable P2PKV_PORT: port must be an integer"),
        ({}, {"P2PKV_PORT": "70000"}, 0, "environment variable P2PKV_PORT: port 70000"),
        ({"port": 65535}, {}, 1, "65535 \\+ data-parallel rank 1 = 65536 is outside 1..65535"),
        ({"port": -5}, {}, 0, "key 'port': port -5"),
        ({"port": -1}, {}, 2, "key 'port': port must be >= 0"),
        ({}, {}, -1, "dp_rank must be a non-negative integer"),
        ({}, {}, True, "dp_rank must be a non-negative integer"),
        ({"control_options": []}, {}, 0, "'control_options' must be a mapping, got \\[\\]"),
        ({"data_options": "x"}, {}, 0, "'data_options' must be a mapping, got 'x'"),
        ({"timeouts": 3}, {}, 0, "'timeouts' must be a mapping"),
        ({"limits": []}, {}, 0, "'limits' must be a mapping"),
        (
            {"timeouts": {"lod": 1}},
            {},
            0,
            r"unknown tier config key\(s\) \['timeouts.lod'\]; valid keys of 'timeouts': "
            r"handshake, load, .*; did you mean 'timeouts.load'\?",
        ),
        ({"timeouts": {"load": "1"}}, {}, 0, "'timeouts.load' must be a finite number, got '1'"),
        ({"timeouts": {"load": True}}, {}, 0, "'timeouts.load' must be a finite number"),
        ({"timeouts": {"load": float("nan")}}, {}, 0, "'timeouts.load' must be a finite number"),
        ({"timeouts": {"load": 0}}, {}, 0, "'timeouts.load' must be > 0 seconds, got 0"),
        ({"limits": {"max_key_bytes": -1}}, {}, 0, "'limits.max_key_bytes' must be > 0"),
        ({"limits": {"max_key_bytes": 1.5}}, {}, 0, "'limits.max_key_bytes' must be an integer"),
        ({"fingerprint": 1}, {}, 0, "'fingerprint' must be a string"),
        ({"hash_seed": b"x"}, {}, 0, "'hash_seed' must be a string"),
    ],
)
def test_rejections_name_the_key(
    d: dict[str, Any], env: dict[str, str], dp_rank: Any, match: str
) -> None:
    with pytest.raises(ConfigError, match=match):
        TierConfig.from_dict(d, dp_rank=dp_rank, environ=env)


def test_config_error_is_a_value_error() -> None:
    with pytest.raises(ValueError):
        TierConfig.from_dict({"bogus": 1}, environ={})


def test_fingerprint() -> None:
    assert config_fingerprint({}) == ""
    a = config_fingerprint({"model": "m", "block": 16})
    assert a == config_fingerprint({"block": 16, "model": "m"})
    assert len(a) == 16 and a != config_fingerprint({"model": "m", "block": 32})
