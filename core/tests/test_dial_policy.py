"""``peers``: which peers requests may make the tier dial (allow-list, cap, eviction)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.config import Peers, TierConfig
from p2pkv.dial_policy import DialPolicy
from p2pkv.errors import ConfigError


def policy(*allow: str, max_dialed: int = 256) -> DialPolicy:
    return DialPolicy(Peers(allow=allow, max_dialed=max_dialed))


@pytest.mark.parametrize(("peer", "allowed"), [
    ("10.1.2.3:7777", True),
    ("11.0.0.1:7777", False),
    ("[fd00::5]:7777", True),
    ("[fe80::1]:7777", False),
    ("192.168.0.9:1", True),
    ("192.168.0.10:1", False),
    ("Prefill-0.P2PKV:7777", True),
    ("prefill-1.p2pkv:7777", False),
    ("not-an-address", False),
])
def test_the_allow_list_matches_networks_addresses_and_names(peer: str, allowed: bool) -> None:
    rules = policy("10.0.0.0/8", "fd00::/8", "192.168.0.9", "prefill-0.p2pkv")
    assert (rules.refusal(peer) is None) is allowed


def test_an_empty_allow_list_allows_every_peer() -> None:
    assert policy().refusal("203.0.113.7:7777") is None
    assert policy().refusal("mem://anything") is None


@pytest.mark.parametrize("entry", ["10.0.0.0/33", "", "a b", "host:7777", "-x"])
def test_a_malformed_entry_is_refused_naming_it(entry: str) -> None:
    with pytest.raises(ConfigError, match=r"peers.allow\[1\]"):
        TierConfig.from_dict({"peers": {"allow": ["10.0.0.0/8", entry]}})


def test_the_environment_fills_what_the_entry_lacks() -> None:
    env = {"P2PKV_PEERS_ALLOW": " 10.0.0.0/8 , pod.ns ", "P2PKV_PEERS_MAX_DIALED": "9"}
    assert TierConfig.from_dict({}, environ=env).peers == Peers(("10.0.0.0/8", "pod.ns"), 9)
    keyed = TierConfig.from_dict({"peers": {"allow": ["::1"]}}, environ=env).peers
    assert keyed == Peers(("::1",), 9)  # the entry's key wins, the other comes from env
    with pytest.raises(ConfigError, match=r"P2PKV_PEERS_MAX_DIALED='x' must be an integer in "):
        TierConfig.from_dict({}, environ={"P2PKV_PEERS_MAX_DIALED": "x"})
    upstream = TierConfig.from_dict({}, environ={"VLLM_P2P_MAX_PEERS": "128"}).peers
    assert upstream.max_dialed == 128  # the built-in tier's variable, read when ours is unset


def test_the_environment_sets_the_handshake_deadline_and_the_idle_time() -> None:
    ours = {"P2PKV_HANDSHAKE_TIMEOUT": "4.5", "P2PKV_PEERS_IDLE_TIMEOUT": "0",
            "VLLM_P2P_HANDSHAKE_TIMEOUT_S": "30", "VLLM_P2P_IDLE_TIMEOUT_S": "300"}
    config = TierConfig.from_dict({}, environ=ours)
    assert (config.timeouts.handshake, config.peers.idle_timeout) == (4.5, 0.0)  # ours first
    upstream = TierConfig.from_dict({}, environ={"VLLM_P2P_HANDSHAKE_TIMEOUT_S": "30",
                                                 "VLLM_P2P_IDLE_TIMEOUT_S": "120"})
    assert (upstream.timeouts.handshake, upstream.peers.idle_timeout) == (30.0, 120.0)
    keyed = TierConfig.from_dict({"timeouts": {"handshake": 2}, "peers": {"idle_timeout": 9}},
                                 environ=ours)
    assert (keyed.timeouts.handshake, keyed.peers.idle_timeout) == (2, 9)  # keys win
    assert TierConfig.from_dict({}, environ={}).peers.idle_timeout == 300.0


@pytest.mark.parametrize(("name", "value", "bound"), [
    ("P2PKV_HANDSHAKE_TIMEOUT", "0", "above 0, at most 86400"),
    ("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "soon", "above 0, at most 86400"),
    ("P2PKV_PEERS_IDLE_TIMEOUT", "-1", "from 0, at most 86400"),
    ("VLLM_P2P_IDLE_TIMEOUT_S", "inf", "from 0, at most 86400"),
    ("P2PKV_HANDSHAKE_TIMEOUT", "1e300", "above 0, at most 86400"),
])
def test_a_bad_time_in_the_environment_names_the_variable(name: str, value: str,
                                                          bound: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}={value!r} must be a number {bound}"):
        TierConfig.from_dict({}, environ={name: value})


class Dialer:
    """What the tier tells the policy: its dialed sessions, oldest first, ready or not."""

    def __init__(self, max_dialed: int) -> None:
        self.rules = policy(max_dialed=max_dialed)
        self.open: dict[str, bool] = {}
        self.evicted: list[str] = []

    def dial(self, peer: str) -> str | None:
        why = self.rules.admit(peer, len(self.open), lambda: list(self.open.items()),
                               self.evict)
        if why is None:
            self.open[peer] = False
        return why

    def evict(self, peer: str, reason: str) -> None:
        assert "peers.max_dialed" in reason
        assert self.open.pop(peer) is False, "only a session not ready yet is evicted"
        self.evicted.append(peer)


def test_at_the_cap_the_oldest_handshaking_session_makes_room() -> None:
    dialer = Dialer(max_dialed=3)
    for peer in ("a:1", "b:1", "c:1"):
        assert dialer.dial(peer) is None
    dialer.open.update({"a:1": True, "c:1": True})
    assert dialer.dial("d:1") is None
    assert dialer.evicted == ["b:1"] and dialer.rules.evicted == 1
    dialer.open["d:1"] = True
    why = dialer.dial("e:1")
    assert why is not None and "open and ready (peers.max_dialed)" in why
    assert dialer.rules.refused == 1
    del dialer.open["a:1"]
    assert dialer.dial("e:1") is None


@given(st.lists(st.tuples(st.sampled_from(["admit", "end", "ready"]),
                          st.integers(0, 12)), max_size=80),
       st.integers(1, 5))
def test_dialed_sessions_never_exceed_the_cap(steps: list[tuple[str, int]], cap: int) -> None:
    dialer = Dialer(max_dialed=cap)
    for action, n in steps:
        peer = f"p{n}:1"
        if action == "admit" and peer not in dialer.open:
            dialer.dial(peer)
        elif action == "end":
            dialer.open.pop(peer, None)
        elif action == "ready" and peer in dialer.open:
            dialer.open[peer] = True
        assert len(dialer.open) <= cap
