"""The parent side of the fleet-scale chaos tests: fleet hosts (:mod:`fleet_host`) in spawned
processes, each running several tiers, and the results their jobs report.

:class:`Fleet` starts the hosts, learns every tier's address (``Fleet.addresses``, by
``(host, tier)``), relays PD halves and collects results. Every wait is bounded and names
what it waited for.
"""

from __future__ import annotations

import glob
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from fleet_host import SHM_PREFIX, Flood, HostSpec, host_main
from p2pkv.testing.child import Child, stop_all

__all__ = ["Fleet", "Result", "TierRef", "remove_leftover_regions"]

START_TIMEOUT = 120.0  # dozens of processes importing zmq on a busy 2-core machine

TierRef = tuple[int, int]
"""``(host index, tier index)``."""


@dataclass(frozen=True)
class Result:
    job: int
    outcome: str
    detail: str
    bad_blocks: int
    at: float
    """The parent's clock when it received the result."""


def remove_leftover_regions() -> None:
    """Unlink ``/dev/shm`` regions of hosts that were killed (they cannot unlink theirs)."""
    for path in glob.glob(f"/dev/shm/{SHM_PREFIX}*"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


class Fleet:
    """Fleet hosts in child processes (use as a context manager)."""

    def __init__(self, specs: Iterable[HostSpec], name: str = "fleet") -> None:
        self.specs = list(specs)
        self.hosts = [
            Child(host_main, spec, name=f"{name}-{i}") for i, spec in enumerate(self.specs)
        ]
        self.addresses: dict[TierRef, str] = {}
        self.results: dict[TierRef, dict[int, Result]] = {}
        self.floods: dict[TierRef, dict[str, int]] = {}
        self.gone: set[int] = set()

    def __enter__(self) -> Fleet:
        for host in self.hosts:
            host.start()
        deadline = time.monotonic() + START_TIMEOUT
        for h, host in enumerate(self.hosts):
            kind, addresses = host.recv(
                max(1.0, deadline - time.monotonic()), f"host {h}'s addresses"
            )
            assert kind == "bound", kind
            for t, address in enumerate(addresses):
                self.addresses[(h, t)] = address
                self.results[(h, t)] = {}
        return self

    def __exit__(self, *exc: object) -> None:
        for host in self.hosts:
            host.resume()
        stop_all(self.hosts, 60)
        remove_leftover_regions()

    def refs(self) -> list[TierRef]:
        return list(self.addresses)

    def send(self, h: int, cmd: tuple[Any, ...]) -> None:
        if h not in self.gone:
            self.hosts[h].send(cmd)

    def start(self, overrides: Callable[[TierRef], dict[str, Any]] | None = None) -> float:
        """Build every host's tiers (one ``start`` per host, at once); returns when sent.
        ``overrides(ref)`` gives the config keys of the first tier of each host (every tier
        of a host gets the same)."""
        at = time.monotonic()
        for h in range(len(self.hosts)):
            self.send(h, ("start", overrides((h, 0)) if overrides else {}))
        return at

    def load(
        self, ref: TierRef, job: int, kv: str, peer: str, keys: list[bytes], slots: list[int]
    ) -> None:
        self.send(ref[0], ("load", ref[1], job, kv, peer, keys, slots))

    def store(self, ref: TierRef, job: int, kv: str, keys: list[bytes], slots: list[int]) -> None:
        self.send(ref[0], ("store", ref[1], job, kv, keys, slots))

    def finish(self, ref: TierRef, kv: str, peer: str | None) -> None:
        self.send(ref[0], ("finish", ref[1], kv, peer))

    def flood(self, ref: TierRef, spec: Flood) -> None:
        self.send(ref[0], ("flood", ref[1], spec))

    def pump(self, timeout: float = 0.0) -> list[tuple[Any, ...]]:
        """Route every message waiting (at most ``timeout`` for the first); the stats
        replies are returned."""
        conns: dict[Connection, int] = {
            self.hosts[h]._conn: h  # the parent's end
            for h in range(len(self.hosts))
            if h not in self.gone
        }
        replies = []
        for ready in wait(list(conns), timeout):
            assert isinstance(ready, Connection)
            h = conns[ready]
            try:
                while ready.poll(0):
                    replies.extend(self._route(h, ready.recv()))
            except (EOFError, OSError):
                self.gone.add(h)
        return replies

    def _route(self, h: int, msg: tuple[Any, ...]) -> list[tuple[Any, ...]]:
        if msg[0] == "results":
            now = time.monotonic()
            got = self.results[(h, msg[1])]
            for job, outcome, detail, bad in msg[2]:
                assert job not in got, f"job {job} of {(h, msg[1])} reported twice"
                got[job] = Result(job, outcome, detail, bad, now)
        elif msg[0] == "flood":
            self.floods[(h, msg[2])] = msg[3]
        elif msg[0] == "stats":
            return [(h, msg[1], msg[2])]
        return []

    def stats(self, timeout: float = 30.0) -> dict[TierRef, dict[str, int]]:
        """Every live tier's ``stats()``."""
        live = [h for h in range(len(self.hosts)) if h not in self.gone]
        for h in live:
            self.send(h, ("stats",))
        out: dict[TierRef, dict[str, int]] = {}
        deadline = time.monotonic() + timeout
        waiting = set(live)
        while waiting:
            left = deadline - time.monotonic()
            assert left > 0, f"no stats from hosts {sorted(waiting)} in {timeout}s"
            for h, _, stats in self.pump(left):
                waiting.discard(h)
                for t, s in enumerate(stats):
                    out[(h, t)] = s
            waiting -= self.gone
        return out

    def wait(self, cond: Callable[[], bool], timeout: float, what: str) -> None:
        """Pump until ``cond()``; an ``AssertionError`` naming ``what`` after ``timeout``."""
        deadline = time.monotonic() + timeout
        while not cond():
            left = deadline - time.monotonic()
            assert left > 0, f"timed out after {timeout}s waiting for {what}"
            self.pump(min(left, 0.05))

    def kill(self, h: int) -> None:
        self.hosts[h].kill()
        self.gone.add(h)

    def pause(self, h: int) -> None:
        self.hosts[h].pause()

    def resume(self, h: int) -> None:
        self.hosts[h].resume()
