"""Two real vLLM TieringOffloadingManagers in two processes, P2PKVTier over zmq + nixl.

The prefiller process stores a prompt's chunks (they cascade from vLLM's CPU primary tier
into P2PKVTier); the decoder process looks them up (the tier answers HIT) and vLLM promotes
them; the promotion loads must land byte for byte in the decoder's primary region. Both
arrival orders, then a prefiller killed mid-load: the decoder's load fails (vLLM recomputes)
instead of hanging. Once with data-parallel rank 0 on both sides, once with rank 1.

Each child imports vLLM and torch (seconds on an idle machine, much longer on a busy one),
so one pair of processes runs every scenario, each process hosting one manager per DP rank
(in a real deployment each DP rank is its own engine process; the managers share nothing).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]
pytest.importorskip("vllm.v1.kv_offload.tiering.base", reason="needs vLLM (nox -s vllm)")
pytest.importorskip("nixl._api", reason="needs NIXL (installed lean by nox -s vllm)")

from p2pkv.testing.child import Child  # noqa: E402
from p2pkv.testing.waiting import wait_until  # noqa: E402
from vllm_engine_host import engine_host  # noqa: E402

BOOT = 600.0
"""Seconds a child may take to import vLLM and build its manager (a loaded 2-core box)."""
WAIT = 60.0
DP_RANKS = (0, 1)
JOBS = "vllm:kv_offload_p2pkv_jobs"

TIER = {
    "control": "zmq",
    "data": "nixl",
    "host": "127.0.0.1",
    "port": 0,
    "control_options": {
        "heartbeat_interval": 0.5,
        "heartbeat_timeout": 3.0,
        "heartbeat_ttl": 3.0,
        "connect_timeout": 5.0,
    },
    "timeouts": {"handshake": 10, "load": 30},
}


def keys_for(prompt: str, n: int) -> list[bytes]:
    """n chained block keys (32-byte hash + 4-byte group index, as vLLM's OffloadKey)."""
    out, h = [], prompt.encode()
    for _ in range(n):
        h = hashlib.sha256(h).digest()
        out.append(h + b"\0\0\0\0")
    return out


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Child, Child, dict[int, tuple[str, int]]]]:
    """A prefiller and a decoder process, each hosting one manager per DP rank (0 and 1).

    Returns the children and, per DP rank, the prefiller manager's P2P address.
    """
    with Child(engine_host, name="prefiller") as pre, Child(engine_host, name="decoder") as dec:
        addresses = {}
        for dp_rank in DP_RANKS:
            pre.send(("build", f"p{dp_rank}", dp_rank, TIER))
            dec.send(("build", f"d{dp_rank}", dp_rank, TIER))
        for dp_rank in DP_RANKS:
            kind, address = pre.recv(BOOT, f"the prefiller's dp{dp_rank} manager")
            assert kind == "built"
            host, _, port = address.rpartition(":")
            addresses[dp_rank] = (host, int(port))
            assert dec.recv(BOOT, f"the decoder's dp{dp_rank} manager")[0] == "built"
        yield pre, dec, addresses
        for child in (pre, dec):
            if child.process.is_alive():
                kind, leftovers = child.request(("shutdown",), WAIT, "shutdown")
                assert (kind, leftovers) == ("down", [])  # no shm left mapped
            else:  # killed: its offload regions stay in /dev/shm unless removed
                for path in Path("/dev/shm").glob(f"vllm_offload_p2pkv-test-{child.pid}-*"):
                    path.unlink(missing_ok=True)


def stats(child: Child, name: str) -> dict[str, Any]:
    kind, totals = child.request(("stats", name), WAIT, "stats")
    assert kind == "stats"
    by_name: dict[str, Any] = totals
    return by_name


@pytest.mark.parametrize("dp_rank", DP_RANKS, ids=["dp0", "dp1"])
def test_pd_transfer_in_both_orders(pair: Any, dp_rank: int) -> None:
    pre, dec, addresses = pair
    host, port = addresses[dp_rank]
    p, d = f"p{dp_rank}", f"d{dp_rank}"

    # Prefiller first: the stores park until the decoder's fetch names their kv_request_id.
    keys = keys_for(f"prefiller-first-{dp_rank}", 5)
    kind, written = pre.request(
        ("store", p, f"pre-1-{dp_rank}", f"kv-1-{dp_rank}", keys), WAIT, "the store"
    )
    assert kind == "stored" and len(set(written.values())) == 5
    dec.send(("load", d, "dec-1", f"kv-1-{dp_rank}", host, port, keys))
    assert dec.recv(WAIT, "the loads")[:3] == ("loaded", "dec-1", written)

    # Decoder first: its fetch waits on the producer until the prefill's stores arrive.
    keys = keys_for(f"decoder-first-{dp_rank}", 3)
    dec.send(("load", d, "dec-2", f"kv-2-{dp_rank}", host, port, keys))
    kind, written = pre.request(
        ("store", p, f"pre-2-{dp_rank}", f"kv-2-{dp_rank}", keys), WAIT, "the store"
    )
    assert dec.recv(WAIT, "the loads")[:3] == ("loaded", "dec-2", written)

    # one cascade job per stored prompt, done once the decoder released what it read
    wait_until(
        lambda: stats(pre, p).get(f"{JOBS}{{done}}") == 2,
        timeout=WAIT,
        what="the prefiller's store jobs to be released",
    )
    totals = stats(dec, d)
    assert totals[f"{JOBS}{{done}}"] == 2
    assert totals["vllm:kv_offload_p2pkv_sessions_ready"] == 1


def test_killed_prefiller_fails_the_loads_instead_of_hanging(pair: Any) -> None:
    """Runs last (it kills the prefiller): one load in flight per DP rank when it dies."""
    pre, dec, addresses = pair
    for dp_rank, (host, port) in addresses.items():
        dec.send(
            (
                "load",
                f"d{dp_rank}",
                f"doomed-{dp_rank}",
                f"kv-3-{dp_rank}",
                host,
                port,
                keys_for(f"never-stored-{dp_rank}", 4),
            )
        )
    for dp_rank in addresses:  # each promotion load is submitted (a job is open) first
        for _ in range(2000):
            if stats(dec, f"d{dp_rank}").get("vllm:kv_offload_p2pkv_jobs_pending", 0) >= 1:
                break
        else:
            raise AssertionError(f"the dp{dp_rank} decoder never submitted its load")
    pre.kill()
    replies = {}
    for _ in addresses:
        kind, req, detail = dec.recv(WAIT, "a failed load")
        assert kind == "load_failed", (req, detail)
        assert "MISS" in detail  # vLLM sees the chunks as absent: it recomputes them
        replies[req] = detail
    assert set(replies) == {f"doomed-{r}" for r in addresses}
    for dp_rank in addresses:
        totals = stats(dec, f"d{dp_rank}")
        assert (
            totals.get(f"{JOBS}{{peer_dead}}", 0) + totals.get(f"{JOBS}{{load_timeout}}", 0) >= 1
        ), totals

    # Later requests naming the dead prefiller fail at once instead of waiting.
    host, port = addresses[0]
    dec.send(("load", "d0", "late", "kv-4", host, port, keys_for("after-death", 2)))
    assert dec.recv(WAIT, "the load to a dead peer")[:2] == ("load_failed", "late")
