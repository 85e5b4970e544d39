"""The receiving side of a bench series: a region, its endpoint, and the byte check.

:class:`TargetState` does the work and is used two ways: in a spawned child (cross-process
series: :class:`RemoteTarget` drives it over a harness pipe) or in the bench process itself
(in-process series such as ``memory``: :class:`LocalTarget`). During a repetition the
target spins on its endpoint's ``progress()``/``poll()`` so one-sided writes into it complete
(NIXL without a progress thread needs the target to call in), as a serving process's tier
tick does; between repetitions it sleeps on the pipe.

The harness pipe carries only the parent's own commands (never anything from a p2pkv wire).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

from p2pkv.bench.endpoints import SeriesSpec, make_endpoint
from p2pkv.bench.harness import Helper, serve
from p2pkv.demo.content import BlockRegion
from p2pkv.registry import default_registry

__all__ = ["INITIATOR", "TARGET", "LocalTarget", "RemoteTarget", "TargetState", "page_in"]

INITIATOR = "bench-initiator"
TARGET = "bench-target"
_DRAIN_SECONDS = 30.0


def page_in(nbytes: int) -> np.ndarray:
    """A zeroed, pre-faulted buffer (first-touch page faults stay out of timed windows)."""
    buf = np.empty(nbytes, dtype=np.uint8)
    buf.fill(0)
    return buf


class _Receiver:
    """One endpoint over the target region, with its posted receives (two-sided only)."""

    def __init__(self, endpoint: Any, block_len: int) -> None:
        self.endpoint = endpoint
        self.block_len = block_len
        self.groups: list[list[int]] = []
        self.remaining: list[int] = []
        self.posted: dict[int, int] = {}  # expect id -> group
        self.failures = 0
        self.broken = ""
        """Why this endpoint raised while being pumped (then it is pumped no more)."""

    def expect(self, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        self.groups = [list(g) for g in groups]
        self.remaining = list(counts)
        self.posted.clear()
        for g in range(len(self.groups)):
            self._post(g)

    def _post(self, g: int) -> None:
        if self.remaining[g] <= 0:
            return
        tid = self.endpoint.expect_blocks(INITIATOR, self.groups[g])
        if tid is None:  # one-sided: nothing to post, ever
            self.remaining = [0] * len(self.remaining)
            return
        self.remaining[g] -= 1
        self.posted[tid] = g

    @property
    def waiting(self) -> bool:
        return bool(self.posted) or any(self.remaining)

    def pump(self) -> None:
        self.endpoint.progress()
        done, failed = self.endpoint.poll(INITIATOR)
        for tid in failed:
            self.failures += 1
            self.posted.pop(tid, None)
        for tid in done:
            g = self.posted.pop(tid, None)
            if g is not None:
                self._post(g)


class TargetState:
    """A region plus the endpoints registered over it, one per series label.

    Only the endpoint of the repetition being measured (from its ``expect`` to its
    ``verify``) is pumped: a serving process runs one data transport, and spinning idle ones
    (or spinning between repetitions) would bill that CPU to whatever is measured meanwhile.

    Two-sided endpoints (``expect_blocks`` returns an id) get one receive posted per group at a
    time, re-posted as each completes until the repetition's count for that group is reached.
    """

    def __init__(self, region_bytes: int) -> None:
        self.buf = page_in(region_bytes)
        self._receivers: dict[str, _Receiver] = {}
        self._active: _Receiver | None = None

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        self.close(spec.label)
        num_blocks = self.buf.nbytes // block_len
        region = self.buf.data[: num_blocks * block_len]
        endpoint = make_endpoint(spec, default_registry(), region, block_len)
        self._receivers[spec.label] = _Receiver(endpoint, block_len)
        return bytes(endpoint.descriptor())

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self._receivers[label].endpoint.add_peer(INITIATOR, descriptor)

    def expect(self, label: str, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        """A repetition of series ``label`` starts: it becomes the pumped one."""
        self._active = self._receivers[label]
        self._active.expect(groups, counts)

    @property
    def active(self) -> bool:
        return self._active is not None

    def pump(self) -> None:
        """Progress the active endpoint's inbound work and re-post receives (never blocks).

        An endpoint that raises is set aside with the reason (its series fails at its next
        check); the other series go on."""
        receiver = self._active
        if receiver is None or receiver.broken:
            return
        try:
            receiver.pump()
        except Exception as exc:
            receiver.broken = f"target endpoint failed: {type(exc).__name__}: {exc}"

    def verify(
        self, label: str, slots: Sequence[int], seeds: Sequence[int]
    ) -> tuple[list[int], int]:
        """Wait (bounded) for the posted receives, then check and consume the slots.

        Returns the mismatching slots and the failed receives since the last call."""
        receiver = self._receivers[label]
        deadline = time.monotonic() + _DRAIN_SECONDS
        while receiver.waiting and not receiver.broken:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(receiver.posted)} posted receives never completed")
            self.pump()
        self._active = None  # the repetition is over: stop spinning until the next one
        if receiver.broken:
            raise RuntimeError(receiver.broken)
        bad = BlockRegion(self.buf, receiver.block_len).verify_seeds(slots, seeds)
        failures, receiver.failures = receiver.failures, 0
        return bad, failures

    def close(self, label: str | None = None) -> list[int]:
        """Close one endpoint (or all); returns transfer ids that never drained."""
        labels = list(self._receivers) if label is None else [label]
        undrained: list[int] = []
        for name in labels:
            receiver = self._receivers.pop(name, None)
            if receiver is self._active:
                self._active = None
            if receiver is not None:
                try:
                    undrained.extend(receiver.endpoint.close() or [])
                except Exception:
                    if not receiver.broken:  # a broken endpoint's close may fail too
                        raise
        return undrained


def _serve(conn: Connection, region_bytes: int) -> None:
    """Child entry: execute commands, pump the active endpoint between them."""
    state = TargetState(region_bytes)

    def idle() -> bool:
        state.pump()
        return state.active

    try:
        serve(conn, {"open": state.open, "add_peer": state.add_peer, "expect": state.expect,
                     "verify": state.verify, "close": state.close}, idle)
    finally:
        state.close()


class RemoteTarget:
    """A :class:`TargetState` in a spawned child, called synchronously with deadlines."""

    def __init__(self, region_bytes: int, timeout: float = 60.0) -> None:
        self._helper = Helper(_serve, (region_bytes,), name="p2pkv-bench-target", daemon=True,
                              timeout=timeout)

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        return bytes(self._helper.call("open", spec, block_len))

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self._helper.call("add_peer", label, descriptor)

    def expect(self, label: str, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        self._helper.call("expect", label, [list(g) for g in groups], list(counts))

    def verify(
        self, label: str, slots: Sequence[int], seeds: Sequence[int]
    ) -> tuple[list[int], int]:
        bad, failures = self._helper.call("verify", label, list(slots), list(seeds))
        return list(bad), int(failures)

    def close_endpoint(self, label: str) -> list[int]:
        return list(self._helper.call("close", label))

    def pump(self) -> None:
        """The child pumps itself."""

    def shutdown(self) -> None:
        self._helper.stop()


class LocalTarget:
    """A :class:`TargetState` in this process (for in-process transports)."""

    def __init__(self, region_bytes: int) -> None:
        self.state = TargetState(region_bytes)

    def open(self, spec: SeriesSpec, block_len: int) -> bytes:
        return self.state.open(spec, block_len)

    def add_peer(self, label: str, descriptor: bytes) -> None:
        self.state.add_peer(label, descriptor)

    def expect(self, label: str, groups: Sequence[Sequence[int]], counts: Sequence[int]) -> None:
        self.state.expect(label, groups, counts)

    def verify(
        self, label: str, slots: Sequence[int], seeds: Sequence[int]
    ) -> tuple[list[int], int]:
        return self.state.verify(label, slots, seeds)

    def close_endpoint(self, label: str) -> list[int]:
        return self.state.close(label)

    def pump(self) -> None:
        self.state.pump()

    def shutdown(self) -> None:
        self.state.close()
