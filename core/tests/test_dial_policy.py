"""``peers``: which peers requests may make the tier dial (allow-list, cap, eviction, the
budget of new dials)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import given
from hypothesis import strategies as st
from p2pkv.config import Peers, TierConfig
from p2pkv.dial_policy import GRACE, DialPolicy
from p2pkv.errors import ConfigError
from p2pkv.peer_allow import service_allowed


def policy(*allow: str, max_dialed: int = 256) -> DialPolicy:
    return DialPolicy(Peers(allow=allow, max_dialed=max_dialed), 0.0)


@pytest.mark.parametrize(
    ("peer", "allowed"),
    [
        ("10.1.2.3:7777", True),
        ("11.0.0.1:7777", False),
        ("[fd00::5]:7777", True),
        ("[fe80::1]:7777", False),
        ("192.168.0.9:1", True),
        ("192.168.0.10:1", False),
        ("Prefill-0.P2PKV:7777", True),
        ("prefill-1.p2pkv:7777", False),
        ("not-an-address", False),
    ],
)
def test_the_allow_list_matches_networks_addresses_and_names(peer: str, allowed: bool) -> None:
    rules = policy("10.0.0.0/8", "fd00::/8", "192.168.0.9", "prefill-0.p2pkv")
    assert (rules.refusal(peer) is None) is allowed


def test_an_empty_allow_list_allows_every_peer() -> None:
    assert policy().refusal("203.0.113.7:7777") is None
    assert policy().refusal("mem://anything") is None


def test_a_short_service_name_is_refused_only_when_pre_connect_names_that_service() -> None:
    """``p2pkv-peers`` alone may be a host; beside ``peers.connect`` dialing the Service
    ``p2pkv-peers.ns.svc...`` it is that Service, which a request never names."""
    service = ["p2pkv-peers.ns.svc.cluster.local:7777"]
    assert service_allowed(["10.0.0.0/8", "P2PKV-Peers"], ["p2pkv-peers.ns.svc.cluster.local"])
    TierConfig.from_dict({"peers": {"allow": ["p2pkv-peers"], "connect": ["p2pkv-peers:7777"]}})
    TierConfig.from_dict({"peers": {"allow": ["other"], "connect": service}})
    with pytest.raises(ConfigError, match=r"peers.allow\[0\] = 'p2pkv-peers.ns' names the"):
        TierConfig.from_dict({"peers": {"allow": ["p2pkv-peers.ns"], "connect": service}})


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


@pytest.mark.parametrize(("value", "warm"), [("63", 63), ("0", 0)])
def test_the_environment_sizes_the_warm_set(value: str, warm: int) -> None:
    """``P2PKV_PEERS_WARM`` sets ``peers.warm`` (0: pre-connect nothing); the key wins."""
    assert TierConfig.from_dict({}, environ={"P2PKV_PEERS_WARM": value}).peers.warm == warm
    keyed = TierConfig.from_dict({"peers": {"warm": 5}}, environ={"P2PKV_PEERS_WARM": value})
    assert keyed.peers.warm == 5
    with pytest.raises(ConfigError, match=r"P2PKV_PEERS_WARM='-1' must be an integer in 0\.\."):
        TierConfig.from_dict({}, environ={"P2PKV_PEERS_WARM": "-1"})


def test_the_environment_sets_the_handshake_deadline_and_the_idle_time() -> None:
    ours = {
        "P2PKV_HANDSHAKE_TIMEOUT": "4.5",
        "P2PKV_PEERS_IDLE_TIMEOUT": "0",
        "VLLM_P2P_HANDSHAKE_TIMEOUT_S": "30",
        "VLLM_P2P_IDLE_TIMEOUT_S": "300",
    }
    config = TierConfig.from_dict({}, environ=ours)
    assert (config.timeouts.handshake, config.peers.idle_timeout) == (4.5, 0.0)  # ours first
    upstream = TierConfig.from_dict(
        {}, environ={"VLLM_P2P_HANDSHAKE_TIMEOUT_S": "30", "VLLM_P2P_IDLE_TIMEOUT_S": "120"}
    )
    assert (upstream.timeouts.handshake, upstream.peers.idle_timeout) == (30.0, 120.0)
    keyed = TierConfig.from_dict(
        {"timeouts": {"handshake": 2}, "peers": {"idle_timeout": 9}}, environ=ours
    )
    assert (keyed.timeouts.handshake, keyed.peers.idle_timeout) == (2, 9)  # keys win
    assert TierConfig.from_dict({}, environ={}).peers.idle_timeout == 300.0


@pytest.mark.parametrize(
    ("name", "value", "bound"),
    [
        ("P2PKV_HANDSHAKE_TIMEOUT", "0", "above 0, at most 86400"),
        ("VLLM_P2P_HANDSHAKE_TIMEOUT_S", "soon", "above 0, at most 86400"),
        ("P2PKV_PEERS_IDLE_TIMEOUT", "-1", "from 0, at most 86400"),
        ("VLLM_P2P_IDLE_TIMEOUT_S", "inf", "from 0, at most 86400"),
        ("P2PKV_HANDSHAKE_TIMEOUT", "1e300", "above 0, at most 86400"),
    ],
)
def test_a_bad_time_in_the_environment_names_the_variable(
    name: str, value: str, bound: str
) -> None:
    with pytest.raises(ConfigError, match=f"{name}={value!r} must be a number {bound}"):
        TierConfig.from_dict({}, environ={name: value})


@dataclass(eq=False)
class Dial:
    """What the policy reads of a dialed session."""

    peer: str
    at: float
    heard: bool = False
    connected: bool = False
    busy: bool = False


WAIT = "wait"


class Dialer:
    """The tier's side: its dialed sessions (dial order), how recently each was active, and
    the clock (``now``)."""

    def __init__(self, max_dialed: int) -> None:
        self.rules = policy(max_dialed=max_dialed)
        self.now = 0.0
        self.open: dict[str, Dial] = {}
        self.recent: list[str] = []
        """Least recently active first."""
        self.evicted: list[Dial] = []

    def count(self) -> int:
        return len(self.open)

    def unheard_count(self) -> int:
        return sum(1 for d in self.open.values() if not d.heard)

    def stalled(self, dialed_before: float) -> Iterator[Dial]:
        return (
            d for d in self.open.values() if not (d.heard or d.connected) and d.at <= dialed_before
        )

    def idle(self) -> Iterator[Dial]:
        return (self.open[p] for p in self.recent if self.open[p].heard and not self.open[p].busy)

    def dial(self, peer: str, *, pd: bool = False) -> str | None:
        """None: dialed; else why not (``WAIT``: put off)."""
        verdict = self.rules.admit(peer, self, self.now, pd=pd)
        if verdict.wait:
            assert verdict.evict is None and verdict.refused is None
            return WAIT
        if verdict.evict is not None:
            assert "peers.max_dialed" in verdict.reason
            self.end(verdict.evict.peer)
            self.evicted.append(verdict.evict)
        if verdict.refused is None:
            self.open[peer] = Dial(peer, self.now)
            self.recent.append(peer)
        return verdict.refused

    def hear(self, peer: str) -> None:
        self.open[peer].heard = True
        self.rules.answered()

    def end(self, peer: str) -> None:
        del self.open[peer]
        self.recent.remove(peer)

    def use(self, peer: str) -> None:
        self.recent.remove(peer)
        self.recent.append(peer)


def dial_heard(dialer: Dialer, *peers: str) -> None:
    for peer in peers:
        assert dialer.dial(peer) is None
        dialer.hear(peer)


def test_a_new_dial_spends_a_token_and_one_whose_peer_answers_gives_it_back() -> None:
    dialer = Dialer(max_dialed=8)  # 2 new dials a second, 2 saved up
    assert dialer.dial("a:1") is None and dialer.dial("b:1") is None
    assert dialer.dial("c:1") == WAIT  # the budget is spent
    assert dialer.rules.next_dial(dialer.now) == pytest.approx(0.5)
    dialer.hear("a:1")  # a healthy peer answers: its token is back at once
    assert dialer.dial("c:1") is None
    dialer.now = 0.4
    assert dialer.dial("d:1") == WAIT
    dialer.now = 0.5  # a token refilled
    dialer.hear("b:1")
    assert dialer.dial("d:1") is None


def test_a_dial_without_progress_makes_way_only_after_the_grace() -> None:
    dialer = Dialer(max_dialed=8)  # at most 2 dials that heard nothing
    assert dialer.dial("a:1") is None and dialer.dial("b:1") is None
    dialer.now = GRACE / 2  # a token is back, but both dials are young
    assert dialer.dial("c:1") == WAIT and not dialer.evicted
    dialer.now = GRACE
    assert dialer.dial("c:1") is None
    assert [d.peer for d in dialer.evicted] == ["a:1"] and dialer.rules.evicted == 1
    assert sorted(dialer.open) == ["b:1", "c:1"]


def test_a_connected_dial_is_never_evicted_for_one_without_progress() -> None:
    dialer = Dialer(max_dialed=8)
    assert dialer.dial("a:1") is None and dialer.dial("b:1") is None
    dialer.open["a:1"].connected = True  # its handshake is under way
    dialer.now = 10 * GRACE
    assert dialer.dial("c:1") is None
    assert [d.peer for d in dialer.evicted] == ["b:1"]
    dialer.open["c:1"].connected = True
    dialer.now = 20 * GRACE
    assert dialer.dial("d:1") == WAIT  # nothing stalled: wait, evict nobody
    assert len(dialer.evicted) == 1


def test_at_the_cap_a_dial_without_progress_makes_room_first() -> None:
    dialer = Dialer(max_dialed=8)
    for i in range(7):
        dialer.now = i
        dial_heard(dialer, f"h{i}:1")
    assert dialer.dial("quiet:1") is None
    dialer.now += GRACE
    assert dialer.dial("new:1") is None
    assert [d.peer for d in dialer.evicted] == ["quiet:1"] and dialer.rules.evicted == 1


def test_then_the_least_recently_active_idle_session_gives_way() -> None:
    dialer = Dialer(max_dialed=2)
    dial_heard(dialer, "a:1", "b:1")
    dialer.use("a:1")  # b is now the least recently active
    assert dialer.dial("c:1") is None
    assert [d.peer for d in dialer.evicted] == ["b:1"] and dialer.rules.gave_way == 1


def test_when_every_session_works_a_pd_request_still_dials_and_others_wait_or_are_refused() -> None:
    dialer = Dialer(max_dialed=2)
    dial_heard(dialer, "a:1", "b:1")
    for peer in ("a:1", "b:1"):
        dialer.open[peer].busy = True
    why = dialer.dial("pull:1")
    assert why is not None and "working or hearing their peers (peers.max_dialed)" in why
    assert dialer.rules.refused == 1
    assert dialer.dial("pd:1", pd=True) is None  # its producer holds blocks for it
    assert dialer.rules.over_cap == 1 and len(dialer.open) == 3
    assert dialer.dial("next:1") == WAIT  # the PD dial may still free a place
    dialer.now = 2 * GRACE
    assert dialer.dial("next:1") is None  # it made no progress: it makes room
    assert [d.peer for d in dialer.evicted] == ["pd:1"]


@given(
    st.lists(
        st.tuples(
            st.sampled_from(["pull", "pd", "end", "heard", "connected", "busy", "use", "later"]),
            st.integers(0, 12),
        ),
        max_size=80,
    ),
    st.integers(1, 12),
)
def test_dials_stay_within_the_cap_and_the_budget_and_progress_is_never_evicted(
    steps: list[tuple[str, int]],
    cap: int,
) -> None:
    """Only PD requests go beyond the cap, and only when every session is working; a dial
    that heard or connected its peer, or is younger than the grace, is never closed for a
    new one; dials that heard nothing stay within a quarter of the cap; new dials that were
    never answered stay within the budget."""
    dialer = Dialer(max_dialed=cap)
    spent = 0
    for action, n in steps:
        peer = f"p{n}:1"
        known = dialer.open.get(peer)
        if action in ("pull", "pd") and known is None:
            before, evictions = len(dialer.open), len(dialer.evicted)
            stalled = next(dialer.stalled(dialer.now - GRACE), None) is not None
            if dialer.dial(peer, pd=action == "pd") is None:
                spent += 1
            for victim in dialer.evicted[evictions:]:
                assert not victim.heard or not stalled, "a heard session left before a stall"
                assert victim.heard or not victim.connected, "a connected dial was evicted"
                assert victim.heard or dialer.now - victim.at >= GRACE, "a young dial evicted"
            over = len(dialer.open) > cap
            assert not over or (action == "pd" and before >= cap)
            assert dialer.unheard_count() <= dialer.rules.max_unheard
            budget = dialer.rules.max_unheard
            assert spent <= budget + budget * dialer.now
        elif action == "later":
            dialer.now += n / 8
        elif known is not None and action == "end":
            dialer.end(peer)
        elif known is not None and action == "heard" and not known.heard:
            dialer.hear(peer)
            spent -= 1
        elif known is not None and action == "connected":
            known.connected = True
        elif known is not None and action == "busy":
            known.busy = True
        elif known is not None and action == "use":
            dialer.use(peer)
