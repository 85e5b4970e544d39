"""Routing from kv_transfer_params: every accepted shape and every refusal."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from p2pkv.routing import NO_ROUTING, ConsumerRoute, ProducerRoute, Routing, parse_routing

SRC = {"kv_request_id": "r1", "remote_host": "10.0.0.2", "remote_port": 5710}


@pytest.mark.parametrize(
    "key, probe",
    [
        ("remote_prefiller", False),
        ("prefill", False),
        ("remote_kv_source", True),
        ("p2p", True),
    ],
)
def test_consumer_dicts(key: str, probe: bool) -> None:
    r = parse_routing({key: SRC})
    assert r == Routing(ConsumerRoute("r1", "10.0.0.2:5710", probe), None)
    assert not r.invalid


@pytest.mark.parametrize("key", ["remote_decoder", "decode"])
def test_producer_dicts_need_only_the_id(key: str) -> None:
    assert parse_routing({key: {"kv_request_id": "r9", "extra": 1}}) == Routing(
        None, ProducerRoute("r9")
    )


def test_producer_plus_symmetric_source_is_the_one_legal_combination() -> None:
    r = parse_routing({"remote_decoder": {"kv_request_id": "out"}, "remote_kv_source": SRC})
    assert r.producer == ProducerRoute("out")
    assert r.consumer == ConsumerRoute("r1", "10.0.0.2:5710", True)


def test_ipv6_hosts_are_bracketed_and_string_ports_accepted() -> None:
    r = parse_routing({"remote_prefiller": {**SRC, "remote_host": "::1", "remote_port": "7"}})
    assert r.consumer is not None and r.consumer.peer == "[::1]:7"


@pytest.mark.parametrize("params", [None, {}, {"unrelated": 1, "remote_host": "x"}])
def test_no_routing(params: Any) -> None:
    assert parse_routing(params) is NO_ROUTING


REFUSED: list[tuple[dict[str, Any], str]] = [
    ({"remote_prefiller": SRC, "remote_decoder": {"kv_request_id": "x"}}, "cannot be combined"),
    ({"remote_prefiller": SRC, "remote_kv_source": SRC}, "cannot be combined"),
    ({"prefill": SRC, "p2p": SRC, "decode": {"kv_request_id": "x"}}, "cannot be combined"),
    ({"remote_prefiller": SRC, "prefill": SRC}, "legacy name"),
    ({"remote_decoder": {"kv_request_id": "x"}, "decode": {"kv_request_id": "x"}}, "legacy name"),
    ({"remote_prefiller": "r1"}, "must be a mapping"),
    ({"remote_prefiller": {**SRC, "kv_request_id": ""}}, "kv_request_id must be a non-empty"),
    ({"remote_prefiller": {**SRC, "kv_request_id": 5}}, "kv_request_id must be a non-empty"),
    ({"remote_prefiller": {**SRC, "kv_request_id": "x" * 300}}, "longer than 256"),
    (
        {"remote_prefiller": {k: v for k, v in SRC.items() if k != "remote_host"}},
        "remote_host must be",
    ),
    ({"remote_prefiller": {**SRC, "remote_host": "[]"}}, "remote_host must be"),
    ({"remote_prefiller": {**SRC, "remote_port": 0}}, "remote_port must be"),
    ({"remote_prefiller": {**SRC, "remote_port": 70000}}, "remote_port must be"),
    ({"remote_prefiller": {**SRC, "remote_port": True}}, "remote_port must be"),
    ({"remote_prefiller": {**SRC, "remote_port": "x"}}, "remote_port must be"),
    ({"remote_decoder": {}}, "kv_request_id must be"),
    ({"remote_decoder": None}, "must be a mapping"),
]


@pytest.mark.parametrize("params, reason", REFUSED)
def test_refusals_give_no_route_and_log_the_reason(
    params: dict[str, Any], reason: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="p2pkv.routing"):
        r = parse_routing(params, req_id="req-7")
    assert r.invalid and r.consumer is None and r.producer is None
    assert reason in r.error
    assert "req-7" in caplog.text and reason in caplog.text


def test_non_mapping_params_are_refused() -> None:
    assert parse_routing(["x"]).invalid  # type: ignore[arg-type]


def test_a_misspelt_routing_key_is_logged_once_naming_the_key_it_resembles(
    caplog: pytest.LogCaptureFixture,
) -> None:
    params = {
        "remote_prefill": {"kv_request_id": "r", "remote_host": "h", "remote_port": 1},
        "do_remote_decode": True,
    }
    with caplog.at_level(logging.WARNING, logger="p2pkv.routing"):
        assert parse_routing(params, req_id="a") is NO_ROUTING
        assert parse_routing(params, req_id="b") is NO_ROUTING
    lines = [r.getMessage() for r in caplog.records]
    assert lines == [
        "request a: kv_transfer_params key 'remote_prefill' is not a p2pkv "
        "routing key (ignored); did you mean 'remote_prefiller'? (logged once "
        "per key)"
    ]
