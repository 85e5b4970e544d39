"""What a ``p2pkv bench --tier --phases`` side records: when each read of a load began and
ended (from the tier's own observer hooks), and where its driver thread spends its CPU.

- :class:`PhaseClock` is an observer plugin (``p2pkv_transfer_finished``) registered in a
  registry of the side's own (:func:`clocked_registry`): the tier reports when a read ended.
  It also times every ``read_blocks`` call of the data transport class in this process
  (:meth:`PhaseClock.watch`): on UCX's ``cma`` lane the READ copies inside that call. The
  tier's code is not changed.
- :class:`CpuProfile` runs :mod:`cProfile` on the driver thread's CPU clock
  (``time.thread_time``) and sums the time by component (:data:`COMPONENTS`): time in C
  functions (a socket send, a NIXL call) counts for the component that called them.

Driver thread only (observers run on the tier's driver thread).
"""

from __future__ import annotations

import cProfile
import pstats
import time
from collections import defaultdict
from typing import Any

from p2pkv.hookspecs import hookimpl
from p2pkv.observers import Observers
from p2pkv.registry import Registry

__all__ = ["COMPONENTS", "CpuProfile", "PhaseClock", "clocked_registry", "component"]

COMPONENTS = (
    ("p2pkv/session/", "session protocol"),
    ("p2pkv/protocol", "codec"),
    ("p2pkv/tier", "tier"),
    ("p2pkv_zmq/", "zmq transport"),
    ("/zmq/", "pyzmq"),
    ("p2pkv_nixl/", "nixl transport"),
    ("/nixl/", "NIXL"),
    ("/nixl_cu", "NIXL"),
    ("p2pkv_ucx/", "ucx transport"),
    ("/ucxx/", "ucxx"),
    ("/ucxx_cu", "ucxx"),
    ("/threading.py", "threads (stdlib)"),
    ("/selectors.py", "threads (stdlib)"),
    ("p2pkv_tools/", "bench harness"),
    ("/multiprocessing/", "bench harness"),
    ("/numpy/", "numpy"),
    ("/p2pkv/", "p2pkv core (other)"),
)
"""Path fragment -> component, first match wins; anything else is ``other``."""
STAGED_COPIES = {("p2pkv_nixl/staging.py", "copy_out"), ("p2pkv_ucx/receiving.py", "_copy")}
"""(path suffix, function) of the copies out of a staging buffer into the slots: a component
of their own, ``staged copy``."""


def component(filename: str, function: str = "") -> str:
    """The component of a profiled function (see :data:`COMPONENTS`, :data:`STAGED_COPIES`)."""
    if any(filename.endswith(path) and function == name for path, name in STAGED_COPIES):
        return "staged copy"
    for fragment, name in COMPONENTS:
        if fragment in filename:
            return name
    return "other"


Event = tuple[str, float]
"""(``call``, ``posted`` or ``ended``; ``time.perf_counter()`` seconds)."""


class PhaseClock:
    """Records when a ``read_blocks`` call began (``call``) and returned (``posted``), and
    when the tier saw a read end (``ended``)."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    @hookimpl
    def p2pkv_transfer_finished(
        self, peer: str, transfer_id: int, success: bool, nbytes: int, seconds: float
    ) -> None:
        self.events.append(("ended", time.perf_counter()))

    def watch(self, cls: type[Any]) -> None:
        """Time every ``read_blocks`` of data transport class ``cls`` in this process (a
        bench side's own process: nothing else runs there)."""
        original = cls.read_blocks

        def read_blocks(transport: Any, *args: Any, **kwargs: Any) -> Any:
            self.events.append(("call", time.perf_counter()))
            try:
                return original(transport, *args, **kwargs)
            finally:
                self.events.append(("posted", time.perf_counter()))

        cls.read_blocks = read_blocks

    def take(self) -> list[Event]:
        """The events since the last call."""
        events, self.events = self.events, []
        return events


def clocked_registry(clock: PhaseClock, data: str) -> Registry:
    """The installed plugins (as the tier would load them) plus ``clock`` as an observer,
    watching data transport ``data``'s reads."""
    registry = Registry.load()
    registry.pm.register(clock, name="p2pkv-bench-phase-clock")
    registry.observers = Observers(registry.pm)
    clock.watch(registry.transport("data", data))
    return registry


class CpuProfile:
    """cProfile of this thread's CPU time, summed by component."""

    def __init__(self) -> None:
        self._profile: cProfile.Profile | None = None
        self._began = 0.0

    def start(self) -> None:
        self._profile = cProfile.Profile(time.thread_time)
        self._began = time.thread_time()
        self._profile.enable()

    def stop(self) -> dict[str, float]:
        """Seconds of this thread's CPU per component since :meth:`start` (``{}`` if not
        started); ``thread total`` is all of it, profiler included."""
        if self._profile is None:
            return {}
        self._profile.disable()
        total = time.thread_time() - self._began
        stats: Any = pstats.Stats(self._profile).stats  # type: ignore[attr-defined]
        self._profile = None
        out: dict[str, float] = defaultdict(float)
        for (filename, _, function), (_, _, own, _, callers) in stats.items():
            if filename != "~":
                out[component(filename, function)] += own
                continue
            for (caller_file, _, caller), (_, _, own_from, _) in callers.items():
                out[component(caller_file, caller)] += own_from  # a C function: its caller's
        out["thread total"] = total
        return dict(out)
