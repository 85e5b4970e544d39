"""The demo's request stream: prompt lengths, block keys and arrival orders.

Each request has a prompt length drawn from a distribution, ``prompt // tokens_per_block``
full blocks (a partial last block is recomputed by engines, never transferred), and one key
per block chained like a prefix-cache hash (``key[i] = H(key[i-1] || chunk i)``), so every key
is unique and depends on everything before it.

Arrival orders, mixed through the stream:

- ``consumer_first``: the decoder asks before the prefiller has offered (the load waits for
  the store);
- ``producer_first``: the prefiller's store is parked until the decoder asks;
- ``symmetric``: no router pairing; the consumer probes the producer with batched lookups and
  loads only the blocks the producer reports present (a prefix of the request: the producer
  holds ``symmetric_hit`` of them).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import numpy as np
from p2pkv.errors import ConfigError

__all__ = ["ORDERS", "DemoRequest", "PromptDistribution", "make_stream", "parse_orders"]

ORDERS = ("consumer_first", "producer_first", "symmetric")


@dataclass(frozen=True)
class PromptDistribution:
    """``lognormal:MEDIAN:SIGMA``, ``uniform:LOW:HIGH`` or ``fixed:N`` (tokens)."""

    kind: str
    a: float
    b: float = 0.0

    @classmethod
    def parse(cls, text: str) -> PromptDistribution:
        parts = text.split(":")
        try:
            if parts[0] == "fixed" and len(parts) == 2:
                dist = cls("fixed", float(parts[1]))
            elif parts[0] in ("lognormal", "uniform") and len(parts) == 3:
                dist = cls(parts[0], float(parts[1]), float(parts[2]))
            else:
                raise ValueError
        except ValueError:
            raise ConfigError(
                f"bad prompt distribution {text!r}: use lognormal:MEDIAN:SIGMA, "
                "uniform:LOW:HIGH or fixed:N (tokens)"
            ) from None
        if dist.a <= 0 or dist.b < 0 or (dist.kind == "uniform" and dist.b < dist.a):
            raise ConfigError(f"bad prompt distribution {text!r}: need positive, ordered values")
        return dist

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        if self.kind == "fixed":
            return np.full(n, self.a)
        if self.kind == "uniform":
            return rng.uniform(self.a, self.b, n)
        return rng.lognormal(math.log(self.a), self.b, n)

    def __str__(self) -> str:
        if self.kind == "fixed":
            return f"fixed:{self.a:g}"
        return f"{self.kind}:{self.a:g}:{self.b:g}"


@dataclass(frozen=True)
class DemoRequest:
    index: int
    kv_request_id: str
    order: str
    prompt_tokens: int
    keys: tuple[bytes, ...]
    hits: int
    """Blocks the consumer will load: all of them, or the producer's prefix (symmetric)."""

    @property
    def num_blocks(self) -> int:
        return len(self.keys)


def parse_orders(text: str) -> dict[str, float]:
    """``consumer_first=2,producer_first=2,symmetric=1`` (weights) or a plain list."""
    weights: dict[str, float] = {}
    for item in text.split(","):
        name, _, weight = item.strip().partition("=")
        if name not in ORDERS:
            raise ConfigError(f"unknown arrival order {name!r}; choose from {', '.join(ORDERS)}")
        try:
            weights[name] = float(weight) if weight else 1.0
        except ValueError:
            raise ConfigError(f"bad weight for {name!r}: {weight!r}") from None
    if not weights or sum(weights.values()) <= 0:
        raise ConfigError("at least one arrival order needs a positive weight")
    return weights


def _chain(seed: bytes, n: int) -> tuple[bytes, ...]:
    keys = []
    prev = seed
    for i in range(n):
        prev = hashlib.blake2b(prev + i.to_bytes(4, "little"), digest_size=16).digest()
        keys.append(prev)
    return tuple(keys)


def make_stream(
    count: int,
    dist: PromptDistribution,
    *,
    tokens_per_block: int,
    max_blocks: int,
    orders: dict[str, float],
    symmetric_hit: float = 0.75,
    seed: int = 0,
    run_id: str = "demo",
) -> list[DemoRequest]:
    """``count`` requests; block counts are clipped to ``1 .. max_blocks``.

    Orders are interleaved deterministically in proportion to their weights (so even a
    3-request run sees each order), then shuffled by ``seed``."""
    if count <= 0:
        raise ConfigError(f"--requests must be > 0, got {count}")
    rng = np.random.default_rng(seed)
    tokens = dist.sample(rng, count)
    names = list(orders)
    weights = np.array([orders[n] for n in names], dtype=float)
    quota = np.floor(weights / weights.sum() * count).astype(int)
    for i in np.argsort(-weights)[: count - int(quota.sum())]:
        quota[i] += 1
    plan = [n for n, q in zip(names, quota, strict=True) for _ in range(int(q))]
    rng.shuffle(plan)
    stream = []
    for i in range(count):
        blocks = int(min(max(tokens[i] // tokens_per_block, 1), max_blocks))
        keys = _chain(f"{run_id}/{seed}/{i}".encode(), blocks)
        order = plan[i]
        hits = blocks if order != "symmetric" else max(1, int(blocks * symmetric_hit))
        stream.append(
            DemoRequest(
                index=i,
                kv_request_id=f"{run_id}-{i}",
                order=order,
                prompt_tokens=int(tokens[i]),
                keys=keys,
                hits=hits,
            )
        )
    return stream
