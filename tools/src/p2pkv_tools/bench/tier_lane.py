"""``p2pkv bench --tier``: two real tiers as one :class:`~p2pkv_tools.bench.lanes.Lane`.

A :class:`TierLane` is a producer and a consumer :mod:`tier side <p2pkv_tools.bench.tier_side>`,
each in a spawned process, for one block size. It is timed by
:func:`p2pkv_tools.bench.runner.measure_cell` exactly like a data-plane lane — the same slot
layout, warm-up sizing, repetitions and byte check after every repetition — with one request
being one PD request through both tiers, its halves sent in the lane's arrival ``order``:

- ``producer_first``: ``store`` to the producer, then ``load`` to the consumer (the KV is
  already there: its store is parked until the decoder asks);
- ``consumer_first``: ``load`` first, then ``store`` (the load waits for the store).

``fill`` writes the source slots on the producer, ``verify`` checks the destination slots on
the consumer (both untimed). The runner's own latency (this process, pipe hops included) is
replaced by the consumer's ``submit_load`` -> result latency (:meth:`TierLane.latencies`);
each repetition also records both sides' CPU time and the consumer tier's descriptor count
(:meth:`TierLane.usage`). ``poll`` blocks up to ``_POLL_WAIT`` in the consumer for a result
(the parent does not spin); ``end_rep`` waits for every store on the producer to finish and
returns the stores that failed.

For the first pull on a fresh lane (:mod:`p2pkv_tools.bench.tier_first_pull`),
:meth:`TierLane.connect` pre-connects the consumer to the producer (or
:meth:`TierLane.discovered` waits for the session the consumer's ``peers.connect`` opened) and
:meth:`TierLane.first_load` runs one request with the consumer stepping until its result.

With a ``link`` (:mod:`p2pkv_tools.bench.netns`, ``--netns``) the producer lives at its source end
and the consumer at its reader end, each tier listening on its veth address (control and data
cross the veth); discovery then names the producer by that address (a namespace has no name
for its peer).
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from p2pkv.addressing import parse_address

from p2pkv_tools.bench.endpoints import SeriesSpec
from p2pkv_tools.bench.harness import Helper
from p2pkv_tools.bench.lanes import Lane
from p2pkv_tools.bench.netns import Link
from p2pkv_tools.bench.tier_side import Finished, FirstLoad, side_main

__all__ = ["ORDERS", "RepUsage", "TierLane", "link_control_options"]

ORDERS = ("producer_first", "consumer_first")
_POLL_WAIT = 0.005


@dataclass(frozen=True)
class RepUsage:
    """One repetition: requests, CPU seconds per side, descriptors the consumer posted."""

    requests: int
    producer_cpu_s: float
    consumer_cpu_s: float
    descriptors: int | None


def link_control_options(control: str, link: Link | None) -> dict[str, Any]:
    """The tiers' ``control_options``: none on one host; across a link, ``zmq`` with
    ``insecure: true`` (the link is private to the run, and on one host the control plane runs
    without CURVE too, so the two compare) unless ``P2PKV_CURVE_DIR`` gives it keys."""
    if link is None or control != "zmq" or "P2PKV_CURVE_DIR" in os.environ:
        return {}
    return {"insecure": True}


class TierLane(Lane):
    """A producer and a consumer tier over ``control`` + ``data`` (both cross-process), the
    data transport built with ``data_options`` (its regions allocated with them too), on one
    host or across ``link``."""

    def __init__(
        self,
        control: str,
        data: str,
        region_bytes: int,
        timeout: float,
        data_options: Mapping[str, Any] | None = None,
        link: Link | None = None,
    ) -> None:
        self.spec = SeriesSpec("tier", data, cross_process=True)
        self._link = link
        self.order = ORDERS[0]
        self._config = {
            "control": control,
            "data": data,
            "host": "127.0.0.1",
            "port": 0,
            "data_options": dict(data_options or {}),
            "control_options": link_control_options(control, link),
        }
        self._region_bytes = region_bytes
        self._timeout = timeout
        self._sides: list[Helper] = []
        self._ids = itertools.count(1)
        self._slots: dict[int, int] = {}
        self._rep_latencies: list[list[float]] = []
        self._usage: list[RepUsage] = []
        self._start: list[tuple[float, int | None]] = []
        self._submitted = 0
        self._num_blocks = 0

    def open(self, block_len: int, *, discover: bool = False) -> None:
        """Start both sides. ``discover``: the consumer learns the producer only from its
        ``peers.connect``, naming it ``localhost`` (resolved like a headless Service; across a
        link: its address)."""
        self.close()
        self._sides.append(self._side("producer", self._config, block_len))
        consumer_config = self._config
        described = self._producer.call("describe") if discover else None
        if described is not None:  # the producer's port first: it is in the consumer's config
            port = parse_address(described[0])[1]
            name = self._link.source.address if self._link else "localhost"
            consumer_config = {**self._config, "peers": {"connect": [f"{name}:{port}"]}}
        self._sides.append(self._side("consumer", consumer_config, block_len))
        address, blocks = described or self._producer.call("describe")
        _, consumer_blocks = self._consumer.call("describe")
        self._route = parse_address(address)
        self._num_blocks = min(blocks, consumer_blocks)

    def _side(self, kind: str, config: dict[str, Any], block_len: int) -> Helper:
        """A side's process, started (not waited for); across the link, at its end and
        listening on its address."""
        end = None
        if self._link is not None:
            end = self._link.source if kind == "producer" else self._link.reader
            config = {**config, "host": end.address}
        return Helper(
            side_main,
            (config, block_len, self._region_bytes),
            name=f"p2pkv-bench-tier-{kind}",
            daemon=True,
            timeout=self._timeout,
            placement=end,
        )

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def _producer(self) -> Helper:
        return self._sides[0]

    @property
    def _consumer(self) -> Helper:
        return self._sides[1]

    def fill(self, slots: Sequence[int], seeds: Sequence[int]) -> None:
        self._producer.call("fill", list(slots), list(seeds))

    def verify(self, slots: Sequence[int], seeds: Sequence[int]) -> list[int]:
        return list(self._consumer.call("verify", list(slots), list(seeds)))

    def submit(self, local: list[int], remote: list[int]) -> int:
        r = next(self._ids)
        host, port = self._route
        store = (self._producer, "store", (r, remote))
        load = (self._consumer, "load", (r, host, port, local))
        for side, op, args in (store, load) if self.order == "producer_first" else (load, store):
            side.call(op, *args)
        self._submitted += 1
        return r

    def connect(self) -> float:
        """``P2PTier.connect`` from the consumer to the producer, both stepping until their
        session is ready: the consumer's seconds from the call (``HelperError`` if it fails)."""
        host, port = self._route
        return self._until_session("connect", host, port, self._timeout / 2)

    def discovered(self) -> float:
        """Both sides stepping until the session the consumer's ``peers.connect`` opened is
        ready: the consumer's seconds from the call (``HelperError`` if none is in time)."""
        return self._until_session("accept", self._timeout / 2)

    def _until_session(self, op: str, *args: Any) -> float:
        self._producer.send("accept", self._timeout / 2)
        seconds = self._consumer.call(op, *args)
        self._producer.reply("reply to accept")
        return float(seconds)

    def first_load(self, local: list[int], remote: list[int]) -> FirstLoad:
        """One request, store then load, the consumer stepping until its result (see
        :data:`~p2pkv_tools.bench.tier_side.FirstLoad`); then its store is waited for."""
        r = next(self._ids)
        host, port = self._route
        self._producer.call("store", r, remote)
        finished, ready_s = self._consumer.call(
            "first_load", r, host, port, local, self._timeout / 2
        )
        self._producer.call("wait", self._timeout / 2, True)
        return finished, ready_s

    def poll(self) -> tuple[Sequence[int], Sequence[int]]:
        finished: list[Finished] = self._consumer.call("wait", _POLL_WAIT)
        done = [r for r, outcome, _, _ in finished if outcome == "done"]
        failed = [r for r, outcome, _, _ in finished if outcome != "done"]
        self._rep_latencies[-1].extend(s for _, outcome, s, _ in finished if outcome == "done")
        return done, failed

    def _sample(self) -> list[tuple[float, int | None]]:
        return [(float(cpu), stat) for cpu, stat in (side.call("usage") for side in self._sides)]

    def begin_rep(self) -> None:
        self._rep_latencies.append([])
        self._submitted = 0
        self._start = self._sample()

    def end_rep(self) -> int:
        stores: list[Finished] = self._producer.call("wait", self._timeout / 2, True)
        (p0, _), (c0, d0) = self._start
        (p1, _), (c1, d1) = self._sample()
        descriptors = d1 - d0 if d0 is not None and d1 is not None else None
        self._usage.append(RepUsage(self._submitted, p1 - p0, c1 - c0, descriptors))
        return sum(1 for _, outcome, _, _ in stores if outcome != "done")

    def latencies(self, reps: int) -> np.ndarray:
        """The consumer-side latencies (s) of the last ``reps`` repetitions."""
        return np.array([s for rep in self._rep_latencies[-reps:] for s in rep])

    def usage(self, reps: int) -> list[RepUsage]:
        """What the last ``reps`` repetitions cost."""
        return self._usage[-reps:]

    def reset(self, order: str) -> None:
        """Start a cell in arrival ``order`` (forgets earlier repetitions)."""
        self.order = order
        self._rep_latencies.clear()
        self._usage.clear()

    def close(self) -> None:
        sides, self._sides = self._sides, []
        for side in reversed(sides):  # the consumer (which dialed) first
            side.stop()
