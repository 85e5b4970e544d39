"""``peers.connect``: names resolved off the engine thread, answers handed to the driver."""

from __future__ import annotations

import logging
import threading

import pytest
from p2pkv.config import TierConfig
from p2pkv.discovery import Discovery
from p2pkv.errors import ConfigError
from p2pkv.testing.waiting import wait_until

T = 10.0


class FakeDns:
    """Answers per name, changeable by the test; counts lookups; a name mapped to None
    fails like an unknown host."""

    def __init__(self, answers: dict[str, list[str] | None]) -> None:
        self.answers = answers
        self.lookups = 0
        self.threads: set[str] = set()

    def __call__(self, host: str) -> list[str]:
        self.lookups += 1
        self.threads.add(threading.current_thread().name)
        found = self.answers[host]
        if found is None:
            raise OSError(f"no such host {host}")
        return list(found)


def first_answer(discovery: Discovery, now: float = 0.0) -> list[str]:
    got: list[str] = []
    wait_until(
        lambda: got.extend(discovery.due(now)) or got, timeout=T, what="the first resolution"
    )
    return got


def test_every_address_a_name_resolves_to_is_due_but_our_own() -> None:
    dns = FakeDns({"prefill.svc": ["10.0.0.1", "10.0.0.2", "fd00::3"]})
    discovery = Discovery(["prefill.svc:7777"], 30.0, "10.0.0.2:7777", resolver=dns)
    try:
        assert first_answer(discovery) == ["10.0.0.1:7777", "[fd00::3]:7777"]
        assert discovery.due(1.0) == []  # nothing changed, within the interval
        assert discovery.due(31.0) == ["10.0.0.1:7777", "[fd00::3]:7777"]  # re-dial time
        assert dns.threads == {"p2pkv-discovery"}  # never the driver's thread
    finally:
        discovery.close(T)


def test_a_changed_answer_is_due_at_once() -> None:
    dns = FakeDns({"prefill.svc": ["10.0.0.1"]})
    discovery = Discovery(["prefill.svc:7777"], 0.05, "me:1", resolver=dns)
    try:
        assert first_answer(discovery) == ["10.0.0.1:7777"]
        dns.answers["prefill.svc"] = ["10.0.0.1", "10.0.0.9"]  # a pod came up
        got: list[str] = []
        wait_until(lambda: got.extend(discovery.due(0.0)) or got, timeout=T, what="the new pod")
        assert got == ["10.0.0.1:7777", "10.0.0.9:7777"]
    finally:
        discovery.close(T)


def test_a_name_that_stops_resolving_keeps_its_last_answer_and_logs_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="p2pkv.discovery")
    dns = FakeDns({"prefill.svc": ["10.0.0.1"]})
    discovery = Discovery(["prefill.svc:7777"], 0.02, "me:1", resolver=dns)
    try:
        assert first_answer(discovery) == ["10.0.0.1:7777"]
        dns.answers["prefill.svc"] = None
        seen = dns.lookups
        wait_until(lambda: dns.lookups >= seen + 5, timeout=T, what="five failed lookups")
        assert discovery.due(100.0) == ["10.0.0.1:7777"]
        failures = [r for r in caplog.records if "does not resolve" in r.getMessage()]
        assert len(failures) == 1
    finally:
        discovery.close(T)


def test_addresses_are_dialed_as_they_are() -> None:
    dns = FakeDns({"10.0.0.7": ["10.0.0.7"]})
    discovery = Discovery(["10.0.0.7:7777"], 30.0, "me:1", resolver=dns)
    try:
        assert first_answer(discovery) == ["10.0.0.7:7777"]
    finally:
        discovery.close(T)


def test_connect_entries_and_their_variable_are_checked() -> None:
    with pytest.raises(ConfigError, match=r"^tier config key peers.connect\[0\]: malformed"):
        TierConfig.from_dict({"peers": {"connect": ["no-port"]}})
    with pytest.raises(ConfigError, match=r"^P2PKV_PEERS_CONNECT entry 'no-port': malformed"):
        TierConfig.from_dict({}, environ={"P2PKV_PEERS_CONNECT": "a:1,no-port"})
    peers = TierConfig.from_dict({}, environ={"P2PKV_PEERS_CONNECT": "a.svc:7777, 10.0.0.1:7"})
    assert peers.peers.connect == ("a.svc:7777", "10.0.0.1:7")
