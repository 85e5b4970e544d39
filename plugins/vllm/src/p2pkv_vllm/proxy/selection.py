"""Which instance and data-parallel rank serves a leg: pluggable selection policies.

A *slot* is one (instance, DP rank) pair. A policy is built once per pool (prefillers,
decoders) from the pool's slots and is asked for a slot per leg; ``release`` is called exactly
once per ``choose`` when the leg is over, so load-aware policies can count in-flight legs.

Policies run on the proxy's event loop thread only (no locking needed). Third-party policies
are named ``module:factory``; the factory takes the slot list and returns the policy.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from p2pkv.errors import ConfigError

__all__ = [
    "LeastInFlight",
    "RoundRobin",
    "SelectionPolicy",
    "Slot",
    "make_policy",
    "slot_name",
    "slots_of",
]

U = TypeVar("U")


@dataclass(frozen=True)
class Slot(Generic[U]):
    upstream: U
    dp_rank: int


def slot_name(slot: Slot[Any]) -> str:
    """``URL#dp<rank>``: how logs, the access log and the prefix index name a slot."""
    return f"{slot.upstream.url}#dp{slot.dp_rank}"


class SelectionPolicy(Protocol[U]):
    def choose(self) -> Slot[U]: ...

    def release(self, slot: Slot[U]) -> None: ...


class _HasDpSize(Protocol):
    @property
    def dp_size(self) -> int: ...


T = TypeVar("T", bound=_HasDpSize)


def slots_of(upstreams: Sequence[T]) -> list[Slot[T]]:
    """Every (instance, rank), rank-major: instance A rank 0, B rank 0, A rank 1, ...

    Consecutive picks of a round-robin over this list spread over instances first.
    """
    depth = max((u.dp_size for u in upstreams), default=0)
    return [Slot(u, rank) for rank in range(depth) for u in upstreams if rank < u.dp_size]


class RoundRobin(Generic[U]):
    """Each slot in turn."""

    def __init__(self, slots: Sequence[Slot[U]]) -> None:
        if not slots:
            raise ConfigError("a selection policy needs at least one slot")
        self._slots = list(slots)
        self._next = 0

    def choose(self) -> Slot[U]:
        slot = self._slots[self._next]
        self._next = (self._next + 1) % len(self._slots)
        return slot

    def release(self, slot: Slot[U]) -> None:
        return None


class LeastInFlight(Generic[U]):
    """The slot with the fewest legs in flight; ties go round-robin."""

    def __init__(self, slots: Sequence[Slot[U]]) -> None:
        if not slots:
            raise ConfigError("a selection policy needs at least one slot")
        self._slots = list(slots)
        self._in_flight = [0] * len(self._slots)
        self._index = {slot: i for i, slot in enumerate(self._slots)}
        self._start = 0

    def choose(self) -> Slot[U]:
        n = len(self._slots)
        best = min(((self._start + k) % n for k in range(n)), key=self._in_flight.__getitem__)
        self._start = (best + 1) % n
        self._in_flight[best] += 1
        return self._slots[best]

    def release(self, slot: Slot[U]) -> None:
        i = self._index[slot]
        if self._in_flight[i] > 0:
            self._in_flight[i] -= 1

    def in_flight(self, slot: Slot[U]) -> int:
        return self._in_flight[self._index[slot]]


PolicyFactory = Callable[[Sequence[Slot[U]]], SelectionPolicy[U]]

BUILTIN_POLICIES: dict[str, PolicyFactory] = {  # type: ignore[type-arg]
    "round-robin": RoundRobin,
    "least-inflight": LeastInFlight,
}


def make_policy(name: str, slots: Sequence[Slot[U]]) -> SelectionPolicy[U]:
    """Build the policy ``name`` (built-in name or ``module:factory``) over ``slots``."""
    factory = BUILTIN_POLICIES.get(name)
    if factory is None:
        module, sep, attr = name.partition(":")
        if not sep:
            raise ConfigError(
                f"unknown selection policy {name!r}; built-in: {', '.join(BUILTIN_POLICIES)}, "
                f"or 'module:factory'"
            )
        try:
            factory = getattr(importlib.import_module(module), attr)
        except (ImportError, AttributeError) as exc:
            raise ConfigError(f"selection policy {name!r} cannot be loaded: {exc}") from None
    return factory(slots)
