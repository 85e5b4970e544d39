"""``p2pkv bench --tier``: the first pull between two fresh peers, cold and pre-connected.

Per data transport, ``pairs`` times each, a fresh producer and consumer
(:class:`~p2pkv_tools.bench.tier_lane.TierLane`, new processes, tiers built and idle) run one PD
request of ``blocks`` blocks of the first block size, store then load, and the consumer's
``submit_load`` -> result is timed:

- **cold**: nothing before it, so it pays the dial, the hello exchange (each side's data
  transport adding the other as a peer) and the first read; ``handshake`` is its part up to
  the consumer's session turning ready (the tier's ``sessions_ready`` stat, sampled after
  every step), ``transfer`` the rest (fetch, ready, read, result);
- **after connect**: ``P2PTier.connect`` first, waited for until both sides' sessions are
  ready (``connect`` is the consumer's time for that), then the same request;
- **after discovery**: the consumer is configured with ``peers.connect`` naming the producer
  by host name (``localhost:<port>``, resolved on the tier's discovery thread as a headless
  Service would be; across a ``--netns`` link, by its address); the session it opens by
  itself is waited for (``discovery``: from the consumer's first step), then the same
  request.

Every pull's bytes are verified; a pair that fails records its error and the run goes on.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from p2pkv_tools.bench.matrix import MatrixConfig
from p2pkv_tools.bench.netns import Link
from p2pkv_tools.bench.tier_lane import TierLane

__all__ = ["KINDS", "FirstPull", "Pull", "measure_first_pulls"]

_SEED = 0x5EED


KINDS = ("cold", "connect", "discover")
"""How a fresh pair meets before its first request: not at all, ``P2PTier.connect``, or
``peers.connect`` by name."""


@dataclass(frozen=True)
class Pull:
    """One fresh pair's first request: ms from submit_load to its result, ms of it until the
    session was ready (None when it never was), ms the session took before (None: cold)."""

    kind: str
    total_ms: float
    handshake_ms: float | None
    setup_ms: float | None = None


@dataclass
class FirstPull:
    """The first pulls of one data transport (medians over the fresh pairs in ``cold_ms``
    and ``after_connect_ms``; None when no pair of that kind succeeded)."""

    transport: str
    block_size: int
    blocks: int
    cold_ms: list[float] = field(default_factory=list)
    handshake_ms: list[float] = field(default_factory=list)
    after_connect_ms: list[float] = field(default_factory=list)
    connect_ms: list[float] = field(default_factory=list)
    after_discovery_ms: list[float] = field(default_factory=list)
    discovery_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, pull: Pull) -> None:
        if pull.kind == "cold":
            self.cold_ms.append(pull.total_ms)
            if pull.handshake_ms is not None:
                self.handshake_ms.append(pull.handshake_ms)
            return
        after, setup = (
            (self.after_connect_ms, self.connect_ms)
            if pull.kind == "connect"
            else (self.after_discovery_ms, self.discovery_ms)
        )
        after.append(pull.total_ms)
        if pull.setup_ms is not None:
            setup.append(pull.setup_ms)

    def as_row(self) -> dict[str, Any]:
        """The JSON row: the medians (``first_pull_ms``, ``first_pull_handshake_ms``,
        ``first_pull_transfer_ms``, ``first_pull_after_connect_ms``, ``connect_ms``,
        ``first_pull_after_discovery_ms``, ``discovery_ms``), every sample, and the errors."""
        cold, hand = _median(self.cold_ms), _median(self.handshake_ms)
        return {
            "transport": self.transport,
            "block_size": self.block_size,
            "blocks": self.blocks,
            "first_pull_ms": cold,
            "first_pull_handshake_ms": hand,
            "first_pull_transfer_ms": None if cold is None or hand is None else cold - hand,
            "first_pull_after_connect_ms": _median(self.after_connect_ms),
            "connect_ms": _median(self.connect_ms),
            "first_pull_after_discovery_ms": _median(self.after_discovery_ms),
            "discovery_ms": _median(self.discovery_ms),
            "samples": {
                "cold_ms": self.cold_ms,
                "handshake_ms": self.handshake_ms,
                "after_connect_ms": self.after_connect_ms,
                "connect_ms": self.connect_ms,
                "after_discovery_ms": self.after_discovery_ms,
                "discovery_ms": self.discovery_ms,
            },
            "errors": self.errors,
        }


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def first_pull(lane: TierLane, block_len: int, blocks: int, *, kind: str) -> Pull:
    """One fresh pair on ``lane`` (opened here, closed after) meeting as ``kind`` says
    (:data:`KINDS`), then its first request. Raises ``HelperError`` when a side fails,
    ``RuntimeError`` when the pull does not succeed or its bytes do not verify."""
    lane.open(block_len, discover=kind == "discover")
    try:
        setup_s = {"cold": lambda: None, "connect": lane.connect, "discover": lane.discovered}[
            kind
        ]()
        slots = list(range(blocks))
        seeds = [_SEED + s for s in slots]
        lane.fill(slots, seeds)
        finished, ready_s = lane.first_load(slots, slots)
        if [outcome for _, outcome, _, _ in finished] != ["done"]:
            raise RuntimeError(f"first pull did not succeed: {finished}")
        wrong = lane.verify(slots, seeds)
        if wrong:
            raise RuntimeError(f"first pull landed wrong blocks {wrong}")
    finally:
        lane.close()
    return Pull(
        kind,
        finished[0][2] * 1e3,
        None if ready_s is None else ready_s * 1e3,
        None if setup_s is None else setup_s * 1e3,
    )


def measure_first_pulls(
    config: MatrixConfig, control: str, data: Sequence[str], pairs: int, link: Link | None = None
) -> list[FirstPull]:
    """Per data transport, ``pairs`` fresh pairs of each kind (cold, pre-connected,
    discovered), each one request of the first batch size of blocks of the first block
    size; across ``link`` when given."""
    block, blocks = config.block_sizes[0], config.batches[0]
    timeout = config.deadline * 4
    out = []
    for name in data:
        result = FirstPull(name, block, blocks)
        lane = TierLane(control, name, block * blocks, timeout, config.options_for(name), link)
        for kind in [kind for kind in KINDS for _ in range(pairs)]:
            try:
                result.add(first_pull(lane, block, blocks, kind=kind))
            except Exception as exc:  # a side died or the pull failed: the run goes on
                result.errors.append(f"{kind}: {type(exc).__name__}: {exc}")
        out.append(result)
    return out
