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
    with pytest.raises(ConfigError, match="P2PKV_PEERS_MAX_DIALED='x' must be a positive"):
        TierConfig.from_dict({}, environ={"P2PKV_PEERS_MAX_DIALED": "x"})
    upstream = TierConfig.from_dict({}, environ={"VLLM_P2P_MAX_PEERS": "128"}).peers
    assert upstream.max_dialed == 128  # the built-in tier's variable, read when ours is unset


def test_at_the_cap_the_oldest_handshaking_session_makes_room() -> None:
    rules = policy(max_dialed=3)
    ready = {"a:1", "c:1"}
    evicted: list[str] = []

    def evict(peer: str, reason: str) -> None:
        assert "peers.max_dialed" in reason
        evicted.append(peer)
        rules.ended(peer)

    for peer in ("a:1", "b:1", "c:1"):
        assert rules.admit(peer, lambda p: p not in ready, evict) is None
    assert rules.admit("d:1", lambda p: p not in ready, evict) is None
    assert evicted == ["b:1"] and rules.evicted == 1
    ready.add("d:1")
    why = rules.admit("e:1", lambda p: p not in ready, evict)
    assert why is not None and "open and ready (peers.max_dialed)" in why
    assert rules.refused == 1
    rules.ended("a:1")
    assert rules.admit("e:1", lambda p: p not in ready, evict) is None


@given(st.lists(st.tuples(st.sampled_from(["admit", "end", "ready"]),
                          st.integers(0, 12)), max_size=80),
       st.integers(1, 5))
def test_dialed_sessions_never_exceed_the_cap(steps: list[tuple[str, int]], cap: int) -> None:
    rules = policy(max_dialed=cap)
    open_: set[str] = set()
    ready: set[str] = set()

    def evict(peer: str, reason: str) -> None:
        assert peer in open_ and peer not in ready
        open_.discard(peer)
        rules.ended(peer)

    for action, n in steps:
        peer = f"p{n}:1"
        if action == "admit" and peer not in open_:
            if rules.admit(peer, lambda p: p not in ready, evict) is None:
                open_.add(peer)
        elif action == "end":
            open_.discard(peer)
            ready.discard(peer)
            rules.ended(peer)
        elif action == "ready" and peer in open_:
            ready.add(peer)
        assert len(open_) <= cap
