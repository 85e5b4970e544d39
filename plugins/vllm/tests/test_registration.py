"""Zero-edit mode's switch and the built-in tier's keys, without vLLM."""

from __future__ import annotations

import pytest
from p2pkv.errors import ConfigError
from p2pkv_vllm.bridge import (
    entry_tier_config,
    replace_requested,
    upstream_keys_mapped,
    zero_edit_keys,
)


@pytest.mark.parametrize("value", ["1", "true", "YES", " on "])
def test_the_opt_in_is_explicit(value: str) -> None:
    assert replace_requested({"P2PKV_REPLACE_P2P": value})


@pytest.mark.parametrize("value", [None, "", "0", "false", "off"])
def test_without_the_opt_in_nothing_is_replaced(value: str | None) -> None:
    env = {} if value is None else {"P2PKV_REPLACE_P2P": value}
    assert not replace_requested(env)


def test_a_garbled_opt_in_names_the_variable_and_the_fix() -> None:
    with pytest.raises(ConfigError, match=r"P2PKV_REPLACE_P2P='maybe': set it to 1"):
        replace_requested({"P2PKV_REPLACE_P2P": "maybe"})


def test_the_guide_s_entry_and_upstream_s_keys_keep_their_meaning() -> None:
    guide = {
        "type": "p2p",
        "host": "10.0.0.7",
        "port": 7777,
        "backends": ["UCX"],
        "num_threads": 8,
        "unbound_store_timeout_s": 90,
    }
    cfg = entry_tier_config(guide, extra_config={}, dp_rank=1, environ={"PYTHONHASHSEED": "0"})
    assert (cfg.host, cfg.port, cfg.hash_seed) == ("10.0.0.7", 7778, "0")
    assert cfg.data == "nixl"
    assert cfg.data_options == {"backends": ["UCX"], "num_threads": 8}
    assert cfg.timeouts.unbound_store == 90


def test_an_alias_that_disagrees_with_the_p2pkv_key_is_refused() -> None:
    with pytest.raises(
        ConfigError,
        match=r"'unbound_store_timeout_s' \(5\) and "
        r"timeouts.unbound_store \(9\) disagree",
    ):
        upstream_keys_mapped({"unbound_store_timeout_s": 5, "timeouts": {"unbound_store": 9}})
    with pytest.raises(ConfigError, match=r"'backends' is a NIXL setting.*data is 'ucx'"):
        upstream_keys_mapped({"backends": ["UCX"], "data": "ucx"})
    assert upstream_keys_mapped({"num_threads": 2, "data_options": {"num_threads": 2}}) == {
        "data_options": {"num_threads": 2}
    }


def test_idle_wait_is_checked_like_every_key() -> None:
    with pytest.raises(ConfigError, match=r"idle_wait must be seconds from 0 to 1.*got 'x'"):
        entry_tier_config(
            {"type": "p2pkv", "idle_wait": "x"}, extra_config={}, dp_rank=0, environ={}
        )
    cfg = entry_tier_config(
        {"type": "p2pkv", "idle_wait": 0}, extra_config={}, dp_rank=0, environ={}
    )
    assert cfg.port == 5710


def test_zero_edit_runs_insecure_only_without_the_fleet_s_keys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    guide = {"host": "10.0.0.7", "port": 7777}
    monkeypatch.delenv("P2PKV_CURVE_DIR", raising=False)
    assert zero_edit_keys(guide)["control_options"] == {"insecure": True}
    monkeypatch.setenv("P2PKV_CURVE_DIR", "/etc/p2pkv/curve")
    assert "control_options" not in zero_edit_keys(guide)  # zmq takes CURVE from there
    keyed = {**guide, "control_options": {"server_secret_key": "/k"}}
    assert zero_edit_keys(keyed) == keyed
