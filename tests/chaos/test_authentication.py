"""Scenario 4: CURVE authentication on a non-loopback address (two namespaced hosts).

The producer listens on host A's interface address with CURVE keys made by ``p2pkv keys``;
without keys it refuses to start at all (fail closed). From host B, a consumer holding an
allowed client key loads normally. Intruders on host B get nothing through: raw ZeroMQ peers
with no keys, with an unknown client key, with an allowed key but the wrong server key, and a
p2pkv tier with a key that is not on the allow-list. The producer's counters prove no frame of
theirs reached its link layer or a session, and its recorded data plane registered no peer
but the allowed consumer (only a registered peer may read its region) and posted no transfer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import zmq
import zmq.auth
from chaos_cluster import Cluster, Req, measured, requests, tier_config
from chaos_hostile import draw, intruder_main
from chaos_netlab import NetLab
from chaos_node import NodeSpec
from p2pkv.cli import main as p2pkv_main
from p2pkv.testing import strategies as p2st
from p2pkv.testing.child import Child
from p2pkv_tools.demo.roles import RoleSetup
from zmq.utils import z85

BLOCK = 64 * 1024
MAX_BLOCKS = 8
T = 60.0


@pytest.fixture
def keydir(tmp_path: Path) -> Path:
    """``p2pkv keys`` pairs: the cluster's server pair, two allowed clients, one intruder."""
    for name in ("server", "producer", "alice", "mallory"):
        assert p2pkv_main(["keys", "--dir", str(tmp_path), "--name", name]) == 0
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    for name in ("producer", "alice"):
        (allowed / f"{name}.key").write_bytes((tmp_path / f"{name}.key").read_bytes())
    return tmp_path


def curve(keydir: Path, client: str) -> dict[str, Any]:
    return {
        "server_secret_key": str(keydir / "server.key_secret"),
        "client_secret_key": str(keydir / f"{client}.key_secret"),
        "allowed_client_keys": [str(keydir / "allowed")],
    }


def host(
    lab: NetLab, side: str, kind: str, control: dict[str, Any], *, record: bool = False
) -> NodeSpec:
    netns, dev, addr = lab.host(side)
    config = tier_config(addr, control=control)
    return NodeSpec(
        kind,
        RoleSetup(config, BLOCK, 40 * MAX_BLOCKS),
        netns=netns,
        env={"UCX_TLS": "tcp", "UCX_NET_DEVICES": dev},
        record=record,
    )


def public(keydir: Path, name: str) -> bytes:
    return zmq.auth.load_certificate(str(keydir / f"{name}.key"))[0]


def all_done(recs: list[Req]) -> bool:
    return all(r.load_outcome == "done" and r.store_outcome == "done" for r in recs)


def test_curve_admits_the_allowed_peer_and_no_frame_or_data_peer_from_anyone_else(
    netlab: NetLab,
    keydir: Path,
) -> None:
    with Cluster() as c:
        with pytest.raises(AssertionError, match="refusing to listen on non-loopback host"):
            c.start(("keyless", host(netlab, "a", "producer", {})))

        p, alice = c.start(
            ("P", host(netlab, "a", "producer", curve(keydir, "producer"), record=True)),
            ("alice", host(netlab, "b", "consumer", curve(keydir, "alice"))),
        )
        first = c.flow.admit(
            requests(
                20,
                max_blocks=MAX_BLOCKS,
                orders={"consumer_first": 1, "producer_first": 1},
                run_id="auth1",
            ),
            p,
            alice,
        )
        c.wait(
            lambda: all(r.finished for r in first),
            timeout=T,
            what="alice's first loads",
            recs=first,
        )
        assert all_done(first), [r.describe() for r in first if not all_done([r])]
        before = c.report(p)

        frames = draw(p2st.hostile_frames(), 50, seed=5) + draw(p2st.frames(), 50, seed=6)
        server_public = public(keydir, "server")
        stranger_public, stranger_secret = zmq.curve_keypair()
        alice_secret = zmq.auth.load_certificate(str(keydir / "alice.key_secret"))[1]
        assert alice_secret is not None
        intruders = {
            "no keys": None,
            "unknown client key": (server_public, stranger_public, stranger_secret),
            "mallory's key (not allowed)": (
                server_public,
                public(keydir, "mallory"),
                zmq.auth.load_certificate(str(keydir / "mallory.key_secret"))[1],
            ),
            "allowed key, wrong server key": (
                z85.encode(bytes(32)),
                public(keydir, "alice"),
                alice_secret,
            ),
        }
        outcomes = {}
        for name, keys in intruders.items():
            with Child(
                intruder_main,
                netlab.b,
                p.address,
                f"{netlab.addr_b}:40000",
                keys,
                frames,
                20.0,
                name="chaos-intruder",
            ) as child:
                outcomes[name] = child.recv(30.0, f"the {name} intruder's outcome")
        assert all(o[0] == "refused" for o in outcomes.values()), outcomes

        (mallory,) = c.start(("mallory", host(netlab, "b", "consumer", curve(keydir, "mallory"))))
        c.flow.hold_stores = True  # no router would pair an intruder's loads with stores
        theirs = c.flow.admit(
            requests(
                5,
                max_blocks=MAX_BLOCKS,
                orders={"consumer_first": 1},
                run_id="mallory",
                first_index=500,
            ),
            p,
            mallory,
        )
        c.wait(
            lambda: all(r.loaded for r in theirs),
            timeout=T,
            what="mallory's loads end",
            recs=theirs,
        )
        assert {r.load_outcome for r in theirs} == {"peer_dead"}, [r.describe() for r in theirs]
        c.flow.hold_stores = False

        second = c.flow.admit(
            requests(
                20,
                max_blocks=MAX_BLOCKS,
                orders={"consumer_first": 1, "producer_first": 1},
                run_id="auth2",
                first_index=100,
            ),
            p,
            alice,
        )
        c.wait(
            lambda: all(r.finished for r in second),
            timeout=T,
            what="alice's loads after the intrusions",
            recs=second,
        )
        assert all_done(second), [r.describe() for r in second if not all_done([r])]
        assert not c.flow.problems(first + second), c.flow.problems(first + second)

        after = c.report(p)
        hub0, hub1 = before["control"], after["control"]
        assert hub1["dropped_messages"] == hub0["dropped_messages"] == 0, hub1
        assert hub1["accepted"] == hub0["accepted"], (hub0, hub1)
        assert hub1["refused_handshakes"] > hub0["refused_handshakes"], (hub0, hub1)
        stats = after["stats"]
        assert stats["protocol_errors"] == 0 and stats["handshake_rejections"] == 0, stats
        assert stats["sessions"] == 1, stats
        peers = {e[2] for e in p.data_log if e[1] == "add_peer"}
        assert peers == {alice.address}, peers  # only a registered peer reads its region
        assert not [e for e in p.data_log if e[1] == "read"], "the producer posted reads"
        measured(
            f"CURVE on {netlab.addr_a}: alice's 40 requests done; intruders "
            f"{ {k: v[1] for k, v in outcomes.items()} } and a tier with mallory's key "
            f"(loads: peer_dead) got no frame through: {hub1['refused_handshakes']} "
            f"handshakes refused, 0 link messages, 0 protocol errors, no data peer but alice"
        )
