"""Proxy building blocks without I/O: config parsing, selection policies, leg contents, CLI."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.cli import build_parser
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry
from p2pkv_vllm import cli_plugin
from p2pkv_vllm.proxy.config import (
    INSTANCE_OPTIONS,
    Decoder,
    Mode,
    Prefiller,
    PrefillFailure,
    ProxyConfig,
    load_config_file,
    parse_decoder,
    parse_prefiller,
)
from p2pkv_vllm.proxy.legs import (
    consumer_params,
    decode_body,
    leg_headers,
    new_kv_request_id,
    prefill_body,
    producer_params,
    source_params,
)
from p2pkv_vllm.proxy.selection import (
    LeastInFlight,
    RoundRobin,
    Slot,
    make_policy,
    slots_of,
)

# -- config ---------------------------------------------------------------------------------


def test_prefiller_spec_defaults_to_url_host_and_tier_port() -> None:
    p = parse_prefiller("http://10.0.0.7:8100/", environ={})
    assert p == Prefiller("http://10.0.0.7:8100", "10.0.0.7", 5710, 1)


def test_prefiller_spec_options_and_env_port() -> None:
    p = parse_prefiller(
        "http://h:8100,p2p_host=10.1.1.1,dp_size=4", environ={"VLLM_P2P_SIDE_CHANNEL_PORT": "6000"}
    )
    assert p == Prefiller("http://h:8100", "10.1.1.1", 6000, 4)
    assert parse_prefiller("http://h:1,p2p_port=7000", environ={}).p2p_port == 7000


def test_decoder_spec() -> None:
    assert parse_decoder("https://d:8200,dp_size=2") == Decoder("https://d:8200", 2)


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ("h:8100", "must look like http://host:port"),
        ("http://h:8100,dp=2", "bad option 'dp=2'"),
        ("http://h:8100,dp_size=0", "dp_size must be an integer >= 1"),
        ("http://h:8100,p2p_port=x", "p2p_port must be an integer"),
        ("http://h:8100,p2p_port=65535,dp_size=2", "exceeds 65535"),
        ("http://h:99999", "invalid port"),
    ],
)
def test_bad_prefiller_specs_name_the_problem(spec: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle) as info:
        parse_prefiller(spec, environ={})
    assert "--prefiller" in str(info.value)


def test_config_needs_both_pools() -> None:
    with pytest.raises(ConfigError, match="no prefiller"):
        ProxyConfig(prefillers=(), decoders=(Decoder("http://d:1"),))
    with pytest.raises(ConfigError, match="no decoder"):
        ProxyConfig(prefillers=(Prefiller("http://p:1", "p"),), decoders=())


def test_config_file_json_and_toml(tmp_path: Path) -> None:
    doc = {
        "mode": "decoder-first",
        "on_prefill_failure": "fail",
        "policy": "least-inflight",
        "prefillers": [
            {"url": "http://p:8100", "p2p_host": "10.0.0.1", "p2p_port": 6000, "dp_size": 2}
        ],
        "decoders": [{"url": "http://d:8200", "dp_size": 3}],
        "timeouts": {"prefill": 5, "idle": 7.5},
    }
    j = tmp_path / "proxy.json"
    j.write_text(json.dumps(doc))
    t = tmp_path / "proxy.toml"
    t.write_text(
        'mode = "decoder-first"\non_prefill_failure = "fail"\npolicy = "least-inflight"\n'
        "[timeouts]\nprefill = 5\nidle = 7.5\n"
        '[[prefillers]]\nurl = "http://p:8100"\np2p_host = "10.0.0.1"\np2p_port = 6000\n'
        "dp_size = 2\n"
        '[[decoders]]\nurl = "http://d:8200"\ndp_size = 3\n'
    )
    for path in (j, t):
        cfg = ProxyConfig.from_mapping(load_config_file(str(path)), source=str(path))
        assert cfg.mode is Mode.DECODER_FIRST
        assert cfg.on_prefill_failure is PrefillFailure.FAIL
        assert cfg.prefillers == (Prefiller("http://p:8100", "10.0.0.1", 6000, 2),)
        assert cfg.decoders == (Decoder("http://d:8200", 3),)
        assert (cfg.timeouts.prefill, cfg.timeouts.idle, cfg.timeouts.connect) == (5.0, 7.5, 5.0)


@pytest.mark.parametrize(
    ("doc", "needle"),
    [
        ({"bogus": 1}, "unknown key"),
        ({"mode": "sideways"}, "'sideways' is not one of"),
        ({"timeouts": {"prefill": 0}}, "timeouts.prefill must be a number"),
        ({"timeouts": {"slow": 1}}, "unknown key"),
        ({"prefillers": [{"url": "http://p:1", "port": 2}]}, r"prefillers\[0\]: unknown key"),
        ({"prefillers": "http://p:1"}, "prefillers must be a list"),
    ],
)
def test_config_file_errors_name_the_key(tmp_path: Path, doc: dict[str, Any], needle: str) -> None:
    base = {"prefillers": [{"url": "http://p:1"}], "decoders": [{"url": "http://d:1"}]}
    path = tmp_path / "c.json"
    path.write_text(json.dumps({**base, **doc}))
    with pytest.raises(ConfigError, match=needle):
        ProxyConfig.from_mapping(load_config_file(str(path)), source=str(path))


def test_unreadable_or_malformed_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_config_file(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config_file(str(bad))


# -- selection ------------------------------------------------------------------------------

A = Prefiller("http://a:1", "a", 6000, 2)
B = Prefiller("http://b:1", "b", 7000, 1)


def test_slots_are_rank_major_so_round_robin_spreads_over_instances() -> None:
    rr = RoundRobin(slots_of([A, B]))
    picks = [(s.upstream.url, s.dp_rank) for s in (rr.choose() for _ in range(6))]
    assert picks == [("http://a:1", 0), ("http://b:1", 0), ("http://a:1", 1)] * 2


@given(st.lists(st.integers(1, 4), min_size=1, max_size=5), st.integers(1, 3))
def test_round_robin_is_fair_over_every_slot(dp_sizes: list[int], cycles: int) -> None:
    ups = [Decoder(f"http://d{i}:1", n) for i, n in enumerate(dp_sizes)]
    slots = slots_of(ups)
    assert len(slots) == sum(dp_sizes)
    rr = RoundRobin(slots)
    counts = Counter(rr.choose() for _ in range(cycles * len(slots)))
    assert set(counts) == set(slots)
    assert set(counts.values()) == {cycles}


def test_least_inflight_prefers_idle_slots_and_counts_releases() -> None:
    slots = slots_of([A, B])
    policy = LeastInFlight(slots)
    first = [policy.choose() for _ in range(3)]
    assert sorted(first, key=slots.index) == slots
    policy.release(first[1])
    assert policy.choose() == first[1]
    assert policy.in_flight(first[0]) == 1


def test_custom_policy_by_module_path() -> None:
    policy = make_policy("p2pkv_vllm.proxy.selection:RoundRobin", slots_of([B]))
    assert isinstance(policy, RoundRobin)
    with pytest.raises(ConfigError, match="unknown selection policy 'random'"):
        make_policy("random", slots_of([B]))
    with pytest.raises(ConfigError, match="cannot be loaded"):
        make_policy("no_such_module:thing", slots_of([B]))


# -- legs -----------------------------------------------------------------------------------


def test_prefill_leg_is_one_token_unstreamed_and_carries_the_producer_dict() -> None:
    body = {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 50,
        "stream": True,
        "stream_options": {"include_usage": True},
        "max_completion_tokens": 9,
        "min_tokens": 2,
        "min_completion_tokens": 3,
        "n": 2,
        "best_of": 3,
        "temperature": 0.5,
        "kv_transfer_params": {"client": "junk"},
    }
    out = prefill_body(body, producer_params("kv1"))
    assert out == {
        "model": "m",
        "prompt": "hi",
        "max_tokens": 1,
        "stream": False,
        "temperature": 0.5,
        "kv_transfer_params": {"remote_decoder": {"kv_request_id": "kv1"}},
    }
    assert body["max_tokens"] == 50  # the client body is not mutated


def test_decode_leg_keeps_the_body_and_names_the_prefiller_replica() -> None:
    body = {"model": "m", "messages": [], "stream": True, "kv_transfer_params": {"x": 1}}
    out = decode_body(body, consumer_params("kv1", Slot(A, 1)))
    assert out == {
        "model": "m",
        "messages": [],
        "stream": True,
        "kv_transfer_params": {
            "remote_prefiller": {"kv_request_id": "kv1", "remote_host": "a", "remote_port": 6001}
        },
    }
    assert source_params("kv2", Slot(B, 0)) == {
        "remote_kv_source": {"kv_request_id": "kv2", "remote_host": "b", "remote_port": 7000}
    }
    assert decode_body(body, None) == {"model": "m", "messages": [], "stream": True}


def test_leg_headers_forward_auth_only_and_pin_the_rank() -> None:
    client = [
        (b"Authorization", b"Bearer sk-1"),
        (b"Cookie", b"c=1"),
        (b"X-Api-Key", b"k"),
        (b"Content-Length", b"12"),
        (b"accept", b"text/event-stream"),
    ]
    assert leg_headers(client, "kv1", 3) == {
        "authorization": "Bearer sk-1",
        "x-api-key": "k",
        "accept": "text/event-stream",
        "content-type": "application/json",
        "x-request-id": "kv1",
        "x-data-parallel-rank": "3",
    }
    assert leg_headers([], "kv1", 0, api_key="sk-env")["authorization"] == "Bearer sk-env"
    assert (
        leg_headers([(b"authorization", b"Bearer mine")], "kv1", 0, api_key="sk-env")[
            "authorization"
        ]
        == "Bearer mine"
    )


def test_kv_request_ids_are_fresh() -> None:
    ids = {new_kv_request_id() for _ in range(1000)}
    assert len(ids) == 1000


# -- CLI ------------------------------------------------------------------------------------


def _parse(argv: list[str]) -> argparse.Namespace:
    return build_parser(Registry.from_plugins([("vllm", cli_plugin)])).parse_args(argv)


def test_proxy_subcommand_comes_from_the_plugin_hook() -> None:
    args = _parse(
        [
            "proxy",
            "--prefiller",
            "http://p:8100,dp_size=2",
            "--decoder",
            "http://d:8200",
            "--mode",
            "symmetric",
            "--prefill-timeout",
            "3",
        ]
    )
    cfg = cli_plugin.config_from_args(args)
    assert cfg.mode is Mode.SYMMETRIC
    assert cfg.prefillers[0].dp_size == 2
    assert cfg.timeouts.prefill == 3.0


def test_proxy_help_lists_every_per_instance_option(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        _parse(["proxy", "--help"])
    lines = capsys.readouterr().out.splitlines()
    for option in INSTANCE_OPTIONS:
        listed = [line for line in lines if line.split()[:1] == [option]]
        assert len(listed) == 1, f"{option}: one line of help each, got {listed}"
    examples = {
        "p2p_host": "h",
        "p2p_port": "7",
        "dp_size": "2",
        "kv_events": "tcp://e:1",
        "kv_replay": "tcp://e:2",
    }
    assert examples.keys() == INSTANCE_OPTIONS.keys()
    for option, value in examples.items():  # every listed option works on both kinds
        args = _parse(
            [
                "proxy",
                "--prefiller",
                f"http://p:1,{option}={value}",
                "--decoder",
                f"http://d:1,{option}={value}",
            ]
        )
        cli_plugin.config_from_args(args)


def test_flags_override_the_config_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "c.json"
    path.write_text(
        json.dumps(
            {
                "prefillers": [{"url": "http://p:1"}],
                "decoders": [{"url": "http://d:1"}],
                "timeouts": {"decode": 9},
                "on_prefill_failure": "fail",
            }
        )
    )
    monkeypatch.setenv("UPSTREAM_KEY", "sk-x")
    args = _parse(
        [
            "proxy",
            "--config",
            str(path),
            "--decoder",
            "http://d2:1,dp_size=2",
            "--idle-timeout",
            "4",
            "--api-key-env",
            "UPSTREAM_KEY",
        ]
    )
    cfg = cli_plugin.config_from_args(args)
    assert cfg.prefillers == (Prefiller("http://p:1", "p", 5710, 1),)
    assert cfg.decoders == (Decoder("http://d2:1", 2),)
    assert (cfg.timeouts.decode, cfg.timeouts.idle) == (9.0, 4.0)
    assert cfg.on_prefill_failure is PrefillFailure.FAIL
    assert cfg.api_key == "sk-x"


def test_cli_config_errors_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    args = _parse(["proxy", "--prefiller", "http://p:1"])
    assert args.func(args) == 2
    assert "no decoder configured" in capsys.readouterr().err
    args = _parse(
        [
            "proxy",
            "--prefiller",
            "http://p:1",
            "--decoder",
            "http://d:1",
            "--api-key-env",
            "P2PKV_TEST_SURELY_UNSET",
        ]
    )
    assert args.func(args) == 2
    assert "P2PKV_TEST_SURELY_UNSET is not set" in capsys.readouterr().err
