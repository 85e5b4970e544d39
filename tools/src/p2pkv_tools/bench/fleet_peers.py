"""The peers of ``p2pkv bench --fleet``: many real ``P2PTier``s in one helper process, each
driven by a thread of its own, as an engine's tier-poll thread drives its tier.

A peer's thread ticks its tier with a wait (:data:`IDLE_WAIT`): an idle peer sleeps until
control I/O comes, so a thousand quiet peers cost this host little. Commands from the parent
(over a harness pipe, :func:`p2pkv_tools.bench.harness.serve`) reach a peer through its
queue, and :meth:`P2PTier.interrupt` ends its wait: only a peer's own thread ever calls into
its tier (the single-driver rule).

- ``build(count, blocks)``: build ``count`` tiers (zmq control on loopback, the simulator's
  shared-memory data, :mod:`p2pkv_tools.bench.fleet_data`) and their threads, not dialing.
- ``storm(first, count, address)``: peers ``first .. first + count - 1`` dial ``address``
  at once (a storm of starts: every thread wakes on one event).
- ``produce(peer, requests, blocks, window)``: the peer stores those requests in order
  (PD producer: ``submit_store`` of the keys :func:`fleet_keys` names), at most ``window``
  at a time, each next one once an earlier store job finished.
- ``drop()``: every peer finishes the requests it still stores (``on_request_finished``).
- ``ready()``: how many peers have a ready session; ``usage()``: this process's CPU,
  threads, descriptors and resident memory.
"""

from __future__ import annotations

import logging
import os
import queue
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from p2pkv.config import TierConfig
from p2pkv.tier import P2PTier
from p2pkv.types import Job, RequestContext

from p2pkv_tools.bench.fleet_cores import pin
from p2pkv_tools.bench.fleet_data import ShmDataTransport, fleet_registry
from p2pkv_tools.bench.harness import serve_built
from p2pkv_tools.bench.tier_side import request_keys
from p2pkv_tools.demo.content import BlockRegion

__all__ = [
    "BLOCK",
    "IDLE_WAIT",
    "FleetPeers",
    "fleet_kv_id",
    "peers_main",
    "process_usage",
    "quiet_logs",
]

BLOCK = 4096
"""Block size of every simulated region (bytes)."""
IDLE_WAIT = 2.0
"""Seconds a peer's thread waits for control I/O in one tick. The tier cuts the wait at its
next deadline, and I/O ends it, so a quiet peer wakes only for work: a thousand of them
cost this host little."""
_ASK_TIMEOUT = 30.0
"""Seconds a command waits for the peers' threads."""


def fleet_kv_id(request: int) -> str:
    return f"fleet-{request}"


def process_usage() -> dict[str, float]:
    """This process's CPU seconds (every thread), threads, open descriptors and resident
    MiB (Linux ``/proc``)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    status = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, value = line.partition(":")
            status[key] = value.split()
    return {
        "cpu_s": usage.ru_utime + usage.ru_stime,
        "threads": float(status["Threads"][0]),
        "fds": float(len(os.listdir("/proc/self/fd"))),
        "rss_mib": int(status["VmRSS"][0]) / 1024,
    }


class _Peer:
    """One tier, its region, its thread and its producer bookkeeping."""

    def __init__(self, config: TierConfig, blocks: int) -> None:
        registry = fleet_registry()
        region = ShmDataTransport.allocate_region(blocks, BLOCK, {})
        self.region = BlockRegion(region, BLOCK)
        self.tier = P2PTier(config, region, BLOCK, registry=registry)
        self.commands: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self.free = deque(range(blocks))
        self.backlog: deque[int] = deque()
        """Requests to store once a store slot frees."""
        self.stored: dict[int, tuple[RequestContext, list[int]]] = {}
        self.window = 0
        self.blocks = 0
        self.thread = threading.Thread(target=self._run, name="p2pkv-fleet-peer", daemon=True)
        self.stop = False

    def call(self, command: Callable[[], None]) -> None:
        """Run ``command`` on this peer's thread."""
        self.commands.put(command)
        self.tier.interrupt()

    def _run(self) -> None:
        tier = self.tier
        while not self.stop:
            while not self.commands.empty():
                self.commands.get()()
            if self.stored:
                for result in tier.get_finished_jobs():
                    self._finished(result.job_id)
            self._store_more()
            tier.tick(IDLE_WAIT)
        tier.shutdown()

    def _store_more(self) -> None:
        while self.backlog and len(self.stored) < self.window and len(self.free) >= self.blocks:
            request = self.backlog.popleft()
            slots = [self.free.popleft() for _ in range(self.blocks)]
            keys = request_keys(request, self.blocks)
            self.region.fill(slots, keys)
            ctx = RequestContext(
                f"p{request}", {"remote_decoder": {"kv_request_id": fleet_kv_id(request)}}
            )
            self.tier.on_new_request(ctx)
            self.tier.submit_store(Job(request, keys, slots, is_load=False, ctx=ctx))
            self.stored[request] = (ctx, slots)

    def _finished(self, request: int) -> None:
        entry = self.stored.pop(request, None)
        if entry is not None:
            ctx, slots = entry
            self.tier.on_request_finished(ctx)
            self.free.extend(slots)

    def produce(self, requests: list[int], blocks: int, window: int) -> None:
        self.blocks, self.window = blocks, window
        self.backlog.extend(requests)

    def drop(self) -> None:
        self.backlog.clear()
        for request in list(self.stored):
            self._finished(request)


class FleetPeers:
    """The peers of one helper process (see the module docstring)."""

    def __init__(self, tier_config: dict[str, Any]) -> None:
        self._config = TierConfig.from_dict(tier_config)
        self._peers: list[_Peer] = []

    def build(self, count: int, blocks: int) -> list[str]:
        """Build ``count`` more peers; their addresses."""
        made = [_Peer(self._config, blocks) for _ in range(count)]
        for peer in made:
            peer.thread.start()
        self._peers.extend(made)
        return [peer.tier.local_address for peer in made]

    def storm(self, first: int, count: int, address: str) -> float:
        """Peers ``first ..`` dial ``address`` at once; when they were told (wall clock)."""
        go = threading.Event()

        def dial(tier: P2PTier) -> Callable[[], None]:
            def run() -> None:
                if go.wait(_ASK_TIMEOUT):
                    tier.connect(address)

            return run

        for peer in self._peers[first : first + count]:
            peer.call(dial(peer.tier))
        started = time.time()
        go.set()
        return started

    def produce(self, peer: int, requests: list[int], blocks: int, window: int) -> None:
        target = self._peers[peer]
        target.call(lambda: target.produce(requests, blocks, window))

    def drop(self) -> None:
        for peer in self._peers:
            peer.call(peer.drop)

    def ready(self) -> int:
        """Peers with at least one ready session (each asked on its own thread)."""
        answers: queue.SimpleQueue[int] = queue.SimpleQueue()

        def ask(tier: P2PTier) -> Callable[[], None]:
            return lambda: answers.put(tier.stats().get("sessions_ready", 0))

        for peer in self._peers:
            peer.call(ask(peer.tier))
        ready = 0
        deadline = time.monotonic() + _ASK_TIMEOUT
        for _ in self._peers:
            ready += answers.get(timeout=max(0.0, deadline - time.monotonic())) > 0
        return ready

    def usage(self) -> dict[str, float]:
        return process_usage()

    def shutdown(self) -> None:
        for peer in self._peers:
            peer.stop = True
            peer.tier.interrupt()
        for peer in self._peers:
            peer.thread.join(5.0)


def quiet_logs() -> None:
    """Only errors from p2pkv in a helper: a flood's refused dials would fill the terminal
    (the bench reports their outcomes)."""
    logging.getLogger("p2pkv").setLevel(logging.ERROR)


def peers_main(
    conn: Connection, cores: dict[str, list[int]] | None, tier_config: dict[str, Any]
) -> None:
    """Helper entry: pin this process to the peers' cores (:func:`pin`), then serve a
    :class:`FleetPeers`."""
    pin("peers", cores)
    quiet_logs()
    serve_built(
        conn,
        lambda: FleetPeers(tier_config),
        ("build", "storm", "produce", "drop", "ready", "usage"),
    )
