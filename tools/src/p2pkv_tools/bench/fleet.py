"""``p2pkv bench --fleet``: one tier under test against N peers in a few processes, and what
it costs at each N; then two floods of client-named peers.

With ``--fleet-tut-path`` the tier under test imports p2pkv from another checkout (an
older commit's ``core/src`` and ``transports/zmq/src``), against this branch's peers: the
"before" runs.

Processes (all on this host, zmq control over loopback, the simulator's shared-memory data,
:mod:`p2pkv_tools.bench.fleet_data`): the tier under test alone in one
(:mod:`~p2pkv_tools.bench.fleet_tut`); the N warm peers spread over helpers of at most
:data:`PEERS_PER_PROCESS` (:mod:`~p2pkv_tools.bench.fleet_peers`), the first
:data:`PRODUCERS` in a "fast" helper with the cold peers and the floods' newcomers.

Per N, in fresh processes:

1. **Storm.** Every peer is built, then all N dial the tier under test at once. ``warm_s``:
   from that moment until the tier has N ready sessions (polled every 50 ms), or the
   sessions it reached (``warm_sessions``) when it stalls or :data:`STORM_TIMEOUT` passes.
2. **Idle.** The tier ticks every 5 ms with N quiet sessions: CPU as a share of one core
   (every thread of its process, zmq's I/O thread too), threads, descriptors, resident
   memory, the TCP data segments its sockets carried per second (heartbeats, ``ss``), and
   the Python calls of a quiet tick (counted apart: the work, not the time);
   ``idle_sessions``: the ready sessions at its end (fewer than N: the figures are not N's).
   CPU per tick is the steadier figure on a loaded host: a starved process ticks less often
   than every 5 ms (``idle_ticks_per_s``), which lowers its CPU share, not its cost per tick.
3. **Fixed rate.** PD loads of 4 blocks at ``rate`` per second, spread over the producers:
   latency p50/p99, and the process CPU of the window per request, in all and above the
   idle CPU of the same time (noisy on a loaded host: idle and loaded are measured apart).
4. **Cold peers.** One load each to peers the tier never contacted, one after another: the
   p50/p99 of submit to result (dial, handshake, fetch, read).

Floods (in one fleet of :data:`FLOOD_PEERS` warm peers, ``flood_rounds`` of each kind, the
kinds in turn): established traffic (a closed loop of loads over the producers) alone, then
with 10,000 loads naming distinct peers that refuse (``127.x.y.z`` at a closed port) or
drop SYNs (a listener whose accept queue is full), at :data:`FLOOD_RATE` per second, then
alone again (which is the next flood's run before it); the established throughput as a
ratio of the mean of the runs alone on either side (a shared host drifts), the tier's CPU
within each window, and the outcomes of the first loads to a healthy newcomer (one per
flood) contacted during the flood.

Timings are wall clock on a shared host; every figure carries the load average around it.
With two cores or more, the tier under test has a core of its own and the peers share the
others (:func:`~p2pkv_tools.bench.fleet_cores.placement`).
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np

from p2pkv_tools.bench.fleet_boot import tut_entry
from p2pkv_tools.bench.fleet_cores import placement
from p2pkv_tools.bench.fleet_peers import peers_main
from p2pkv_tools.bench.fleet_tut import Plan
from p2pkv_tools.bench.harness import Helper

__all__ = ["FLOOD_PEERS", "FULL", "QUICK", "FleetConfig", "measure_fleet"]

PEERS_PER_PROCESS = 256
"""Peers per helper process (``--fleet-per-process``). Fewer processes load a shared host
less; each peer holds about 20 descriptors."""
PRODUCERS = 8
STORM_TIMEOUT = 120.0
_STALL = 30.0
"""Seconds without a new ready session after which a storm counts as stalled."""
FLOOD_PEERS = 64
FLOOD_RATE = 3400.0
"""Client-named peers per second in a flood (as measured in the field)."""
_HELPER_TIMEOUT = 300.0
_TUT_BLOCKS = 16384
_PRODUCER_BLOCKS = 512
_PEER_BLOCKS = 16
_BLOCKS = 4
_WINDOW = 32
"""Requests a producer keeps stored ahead."""


@dataclass(frozen=True)
class FleetConfig:
    """What a run measures."""

    sizes: tuple[int, ...] = (16, 64, 256, 1000)
    per_process: int = PEERS_PER_PROCESS
    tut_path: tuple[str, ...] = ()
    """Directories put first on the tier under test's ``sys.path`` (another commit's)."""
    idle_s: float = 5.0
    rate: float = 100.0
    rate_s: float = 5.0
    cold: int = 20
    flood_names: int = 10_000
    flood_s: float = 3.0
    floods: bool = True
    flood_rounds: int = 3
    """Floods of each kind (``--flood-rounds``): one flood's ratio swings with the host."""


FULL = FleetConfig()
QUICK = FleetConfig(
    sizes=(8, 12),
    idle_s=1.0,
    rate=50.0,
    rate_s=1.0,
    cold=3,
    flood_names=300,
    flood_s=0.5,
    flood_rounds=1,
)
"""``--quick``: seconds, for the README test command (figures mean nothing)."""


def _tier_config(quick: bool) -> dict[str, Any]:
    """Every tier's config: the defaults, with room for a thousand sockets (``--quick``: 2 s
    dial and handshake timeouts, so a flood's dials end within its run)."""
    options: dict[str, Any] = {"max_sockets": 8 * 1024}
    timeouts: dict[str, Any] = {}
    if quick:
        options["connect_timeout"] = 2.0
        timeouts = {"handshake": 2.0, "load": 5.0}
    return {
        "control": "zmq",
        "data": "fleet-shm",
        "host": "127.0.0.1",
        "port": 0,
        "control_options": options,
        "timeouts": timeouts,
    }


class _Fleet:
    """The processes of one measurement: the tier under test, the fast helper, the bulk."""

    def __init__(
        self, stack: ExitStack, peers: int, extra: int, config: FleetConfig, quick: bool
    ) -> None:
        per_process = config.per_process
        tier_config = _tier_config(quick)
        cores = placement()
        self.tut = _helper(
            stack,
            tut_entry,
            (cores, list(config.tut_path), tier_config, _TUT_BLOCKS),
            "p2pkv-fleet-tut",
        )
        self.fast = _helper(stack, peers_main, (cores, tier_config), "p2pkv-fleet-fast")
        bulk = peers - PRODUCERS
        self.bulk = [
            _helper(stack, peers_main, (cores, tier_config), f"p2pkv-fleet-bulk{i}")
            for i in range(-(-bulk // per_process))
        ]
        self.address = self.tut.call("describe")
        for i, helper in enumerate(self.bulk):
            count = min(per_process, bulk - i * per_process)
            helper.send("build", count, _PEER_BLOCKS)
        self.producers = self.fast.call("build", PRODUCERS, _PRODUCER_BLOCKS)
        self.others = self.fast.call("build", extra, _PEER_BLOCKS) if extra else []
        self.bulk_sizes = [len(helper.reply("build")) for helper in self.bulk]

    def storm(self, expected: int) -> dict[str, Any]:
        """Every warm peer dials the tier under test at once (see the module docstring)."""
        for helper, count in (
            (self.fast, PRODUCERS),
            *zip(self.bulk, self.bulk_sizes, strict=True),
        ):
            helper.send("storm", 0, count, self.address)
        started = min([self.fast.reply("storm"), *(h.reply("storm") for h in self.bulk)])
        warm_s, reached = self.tut.call("warm", expected, started, STORM_TIMEOUT, _STALL)
        return {"warm_s": None if warm_s is None else round(warm_s, 3), "warm_sessions": reached}

    def produce(self, requests: Sequence[int], peers: Sequence[int]) -> None:
        """Peer ``peers[i % len]`` (of the fast helper) stores request ``requests[i]``."""
        per_peer: dict[int, list[int]] = {}
        for i, request in enumerate(requests):
            per_peer.setdefault(peers[i % len(peers)], []).append(request)
        for peer, assigned in per_peer.items():
            self.fast.call("produce", peer, assigned, _BLOCKS, _WINDOW)


def _helper(stack: ExitStack, target: Any, args: tuple[Any, ...], name: str) -> Helper:
    helper = Helper(target, args, name=name, daemon=True, timeout=_HELPER_TIMEOUT)
    stack.callback(helper.stop)
    return helper


def measure_size(peers: int, config: FleetConfig, quick: bool) -> dict[str, Any]:
    """Storm, idle, fixed rate and cold peers with ``peers`` warm peers (module docstring)."""
    load = os.getloadavg()[0]
    with ExitStack() as stack:
        fleet = _Fleet(stack, peers, config.cold, config, quick)
        row: dict[str, Any] = {
            "peers": peers,
            "processes": 2 + len(fleet.bulk),
            "tut_packages": fleet.tut.call("origin"),
        }
        row.update(fleet.storm(peers))
        idle = fleet.tut.call("idle", config.idle_s)
        row.update(_idle_row(idle, peers))
        row.update(_rate_row(fleet, config, idle))
        row.update(_cold_row(fleet, config))
    row["load_avg"] = [round(load, 2), round(os.getloadavg()[0], 2)]
    return row


def _idle_row(idle: dict[str, Any], peers: int) -> dict[str, Any]:
    wall = idle["wall_s"]
    segments = idle["segments"]
    per_s = None if segments is None else segments / wall
    return {
        "idle_cpu_pct": round(100 * idle["cpu_s"] / wall, 2),
        "idle_cpu_per_tick_us": round(1e6 * idle["cpu_s"] / max(1, idle["ticks"]), 1),
        "idle_tick_thread_us": round(1e6 * idle["tick_thread_cpu_s"] / max(1, idle["ticks"]), 1),
        "idle_ticks_per_s": round(idle["ticks"] / wall, 1),
        "idle_calls_per_tick": round(idle["calls_per_tick"], 1),
        "idle_sessions": idle["sessions"],
        "fds": int(idle["fds"]),
        "threads": int(idle["threads"]),
        "rss_mib": round(idle["rss_mib"], 1),
        "heartbeat_segments_per_s": None if per_s is None else round(per_s, 1),
        "heartbeat_segments_per_s_per_session": (
            None if per_s is None else round(per_s / peers, 3)
        ),
    }


def _rate_row(fleet: _Fleet, config: FleetConfig, idle: dict[str, Any]) -> dict[str, Any]:
    count = max(1, int(config.rate * config.rate_s))
    requests = list(range(1_000_000, 1_000_000 + count))
    fleet.produce(requests, range(PRODUCERS))
    timed = [
        (i / config.rate, fleet.producers[i % PRODUCERS], r, "rate") for i, r in enumerate(requests)
    ]
    result = fleet.tut.call("run", Plan(config.rate_s, _BLOCKS, timed=timed))
    fleet.fast.call("drop")
    kind = result["kinds"].get("rate", {})
    idle_rate = idle["cpu_s"] / idle["wall_s"]
    spent = result["cpu_s"] - idle_rate * result["wall_s"]
    return {
        "rate_rps": config.rate,
        "rate_requests": count,
        "cpu_per_request_us": round(1e6 * result["cpu_s"] / count, 1),
        "cpu_above_idle_per_request_us": round(1e6 * spent / count, 1),
        **_latencies("rate", kind),
        "rate_outcomes": kind.get("outcomes", {}),
        "mismatched": result["mismatched"],
    }


def _cold_row(fleet: _Fleet, config: FleetConfig) -> dict[str, Any]:
    if not config.cold:
        return {}
    requests = list(range(2_000_000, 2_000_000 + config.cold))
    first = PRODUCERS
    fleet.produce(requests, range(first, first + config.cold))
    timed = [(0.25 * i, fleet.others[i], r, "cold") for i, r in enumerate(requests)]
    result = fleet.tut.call("run", Plan(0.25 * config.cold, _BLOCKS, timed=timed))
    kind = result["kinds"].get("cold", {})
    return {
        **_latencies("cold", kind),
        "cold_outcomes": kind.get("outcomes", {}),
        "cold_details": kind.get("details", []),
    }


def _latencies(prefix: str, kind: dict[str, Any]) -> dict[str, float | None]:
    samples = kind.get("latencies_s") or []
    if not samples:
        return {f"{prefix}_p50_ms": None, f"{prefix}_p99_ms": None}
    ms = np.asarray(samples) * 1000
    return {
        f"{prefix}_p50_ms": round(float(np.percentile(ms, 50)), 2),
        f"{prefix}_p99_ms": round(float(np.percentile(ms, 99)), 2),
    }


# -- floods ------------------------------------------------------------------------------------


@contextmanager
def flood_names(kind: str, count: int) -> Iterator[list[str]]:
    """``count`` distinct loopback addresses that refuse TCP (``refusing``: a bound port that
    does not listen) or drop SYNs (``black-holed``: a listener on every loopback address
    whose accept queue one connection fills)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("0.0.0.0", 0))  # every 127.x.y.z reaches it
        port = sock.getsockname()[1]
        names = [
            f"127.{1 + i // 65536}.{(i // 256) % 256}.{i % 256 or 1}:{port}"
            for i in range(1, count + 1)
        ]
        if kind == "refusing":
            yield names
            return
        sock.listen(0)
        with socket.create_connection(("127.0.0.1", port)):
            yield names


def measure_floods(config: FleetConfig, quick: bool) -> list[dict[str, Any]]:
    """The two floods against one fleet of :data:`FLOOD_PEERS` (``--quick``: the smallest
    size) warm peers, ``config.flood_rounds`` times each, the kinds in turn. Established
    traffic runs alone before the first flood and after each one: a flood's ratio is to
    the mean of the runs alone on either side of it. Each flood has a newcomer of its own."""
    peers = min(config.sizes) if quick else FLOOD_PEERS
    kinds = ("refusing", "black-holed")
    rows = []
    with ExitStack() as stack:
        fleet = _Fleet(stack, peers, len(kinds) * config.flood_rounds, config, quick)
        fleet.storm(peers)
        bases = itertools.count(3_000_000, 10**5)
        before = _established(fleet, config, next(bases), [])
        for flood in range(config.flood_rounds * len(kinds)):
            kind = kinds[flood % len(kinds)]
            with flood_names(kind, config.flood_names) as names:
                newcomer = (fleet.others[flood], PRODUCERS + flood)
                flooded = _established(fleet, config, next(bases), names, newcomer=newcomer)
            after = _established(fleet, config, next(bases), [])
            rows.append(_flood_row(kind, flood // len(kinds) + 1, (before, after), flooded))
            before = after
    return rows


def _established(
    fleet: _Fleet,
    config: FleetConfig,
    base: int,
    names: list[str],
    newcomer: tuple[str, int] | None = None,
) -> dict[str, Any]:
    """Closed-loop loads over the producers for the flood window (with ``names`` flooded
    and 4 loads to ``newcomer`` a third of the way in)."""
    count = 40_000 if not names else 40_000 + len(names)
    requests = list(range(base, base + count // 2))
    fleet.produce(requests, range(PRODUCERS))
    closed = [(fleet.producers[i % PRODUCERS], r) for i, r in enumerate(requests)]
    timed = []
    if newcomer is not None:
        first = base + count
        fleet.produce(range(first, first + 4), [newcomer[1]])
        timed = [(config.flood_s / 3, newcomer[0], first + j, "newcomer") for j in range(4)]
    window = config.flood_s if not names else len(names) / FLOOD_RATE
    result: dict[str, Any] = fleet.tut.call(
        "run", Plan(window, _BLOCKS, timed=timed, closed=closed, flood=names, flood_rate=FLOOD_RATE)
    )
    fleet.fast.call("drop")
    return result


def _rps(result: dict[str, Any]) -> float:
    """Established loads done per second of the run's window."""
    done = result["kinds"].get("established", {}).get("outcomes", {}).get("done", 0)
    return float(done) / float(result["window_s"])


def _window_cpu_pct(result: dict[str, Any]) -> float:
    """The tier's CPU within the run's window, as a share of one core."""
    return round(100 * float(result["window_cpu_s"]) / float(result["window_s"]), 1)


def _flood_row(
    kind: str, round_: int, alone: tuple[dict[str, Any], dict[str, Any]], flooded: dict[str, Any]
) -> dict[str, Any]:
    newcomer = flooded["kinds"].get("newcomer", {})
    flood = flooded["kinds"].get("flood", {})
    established = flooded["kinds"].get("established", {})
    unloaded = sum(_rps(run) for run in alone) / len(alone)
    loaded = _rps(flooded)
    return {
        "kind": kind,
        "round": round_,
        "names": flooded["flood_issued"],
        "flood_rate": FLOOD_RATE,
        "window_s": flooded["window_s"],
        "cpu_pct_alone": round(sum(_window_cpu_pct(run) for run in alone) / len(alone), 1),
        "cpu_pct_flooded": _window_cpu_pct(flooded),
        "established_rps_alone": round(unloaded, 1),
        "established_rps_alone_runs": [round(_rps(run), 1) for run in alone],
        "established_rps_flooded": round(loaded, 1),
        "ratio": round(loaded / unloaded, 3) if unloaded else None,
        "flood_outcomes": flood.get("outcomes", {}),
        "established_outcomes_flooded": established.get("outcomes", {}),
        "established_details_flooded": established.get("details", []),
        "newcomer_outcomes": newcomer.get("outcomes", {}),
        **_latencies("newcomer", newcomer),
        "newcomer_details": newcomer.get("details", []),
        "flood_us_per_name": _per(flooded["flood_thread_cpu_s"], flooded["flood_issued"]),
        "flood_zmq_dials": flooded["zmq_dials"],
        "flood_reach_checks": flooded["reach_checks"],
        "tick_us_alone": round(sum(_tick_us(run) for run in alone) / len(alone), 1),
        "tick_us_flooded": _tick_us(flooded),
        "mismatched": sum(run["mismatched"] for run in (*alone, flooded)),
    }


def _per(seconds: float, count: int) -> float | None:
    """``seconds`` per one of ``count``, in µs."""
    return round(1e6 * seconds / count, 1) if count else None


def _tick_us(result: dict[str, Any]) -> float:
    """The ticking thread's CPU per tick within the run's window, in µs."""
    return _per(result["tick_thread_cpu_s"], result["window_ticks"]) or 0.0


def measure_fleet(config: FleetConfig, quick: bool, progress: Any = None) -> dict[str, Any]:
    """Every size, then the floods; the JSON document's measured part."""
    sizes = []
    for peers in config.sizes:
        if progress is not None:
            progress(f"{peers} peers")
        sizes.append(measure_size(peers, config, quick))
    floods = []
    if config.floods:
        if progress is not None:
            progress("floods")
        floods = measure_floods(config, quick)
    return {"placement": placement(), "sizes": sizes, "floods": floods}
