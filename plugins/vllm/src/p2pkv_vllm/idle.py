"""Serving peers while the engine sleeps, on vLLM releases without a tier-poll thread.

Before vLLM 0.33 only the engine thread calls a tier, and an engine with nothing to do blocks
on its input queue once its tiers report no pending work: nothing would read a peer's dial,
probe or fetch until the engine's next request. :class:`IdleWatch` closes that gap without
keeping the engine busy:

- while the engine sleeps, a thread of ours (``p2pkv-idle``) drives the tier: it waits
  for control I/O (at most ``wait`` seconds at a time, so it wakes at once on a peer's
  frame and costs nothing in between) and ticks;
- when the tier then has work that needs the engine (``P2PTier.needs_engine``: a probe its
  cache must answer, a fetch whose blocks it must pin, a result vLLM must collect), the
  watcher wakes the engine through its input queue with vLLM's own no-op request
  (``EngineCoreRequestType.WAKEUP``, the one vLLM uses to interrupt that wait at shutdown);
  the engine then steps, and the tier reports pending work until it is done. A peer's
  handshake needs no engine: the watcher completes it while the engine sleeps;
- while the engine computes a step (:meth:`IdleWatch.lend`, from the end of its schedule
  to its next call), the watcher drives the tier too, but never wakes the engine. So a
  peer's fetch of blocks pinned earlier gets its ``ready`` within the step it arrives in,
  not at the next step's end. A probe still waits for the engine: its cache answers it.
  While lent with work in flight (``needs_engine``), it ticks every :data:`LENT_PACE` at
  least: a peer's read over tcp needs this side's data progress (NIXL without its
  progress thread), which no control frame signals.

**Hand-off (the single-driver rule).** One lock: the engine thread holds it inside every
adapter call (:meth:`IdleWatch.engine`), the watcher only while it ticks, and only between
:meth:`IdleWatch.sleep` (the engine is about to block) or :meth:`IdleWatch.lend` (the engine
is about to compute) and the engine's next call. So
exactly one thread is ever inside the tier, and ``DriverGuard`` still refuses anything else.
An engine call that arrives while the watcher ticks first interrupts the tick's wait
(``P2PTier.interrupt``, the tier's one cross-thread call), then waits for the tick to return;
the watcher's wait can therefore be long (``wait``), which is what keeps it cheap.

The engine's input queue is found on the call stack of ``has_pending_work``
(:func:`engine_waker`: vLLM calls it from its engine loop); where none is found (not inside
vLLM's engine, e.g. a test harness), the adapter falls back to pacing the engine.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import queue
import sys
import threading
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from p2pkv.logs import module_logger

__all__ = ["IdleWatch", "engine_waker"]

log = module_logger(__name__)

_MAX_FRAMES = 24
"""How far up the stack :func:`engine_waker` looks for vLLM's engine loop."""
THREAD_NAME = "p2pkv-idle"
"""The watcher's thread name, in Python and (Linux, 15 bytes at most) in the OS, where
``top -H`` and ``/proc/<pid>/task/*/comm`` show it apart from the engine's threads."""
_PR_SET_NAME = 15
LENT_PACE = 0.001
"""Seconds the watcher waits at most per tick while lent to a computing engine with work in
flight (a pin, a round, a result): the pace of the data progress a peer's read may need."""


def engine_waker(frame: FrameType | None = None) -> Callable[[], None] | None:
    """A function that wakes the vLLM engine whose loop is on this thread's stack (it puts
    vLLM's no-op ``WAKEUP`` request into the engine's input queue), or None when no engine
    loop is on the stack."""
    frame = sys._getframe(1) if frame is None else frame
    for _ in range(_MAX_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        inbox = getattr(owner, "input_queue", None)
        if isinstance(inbox, queue.Queue) and hasattr(owner, "has_work"):
            try:
                from vllm.v1.engine import EngineCoreRequestType
            except ImportError:
                return None
            wakeup = (EngineCoreRequestType.WAKEUP, None)
            return lambda: inbox.put_nowait(wakeup)
        frame = frame.f_back
    return None


class IdleWatch:
    """Drives ``tier`` from a thread of its own while the engine sleeps (see the module)."""

    def __init__(self, tier: Any, wake: Callable[[], None], wait: float) -> None:
        self._tier = tier
        self._wake = wake
        self._wait = wait
        self._lock = threading.RLock()
        self._asleep = threading.Event()
        """Set while the watcher may drive the tier (the engine sleeps or computes)."""
        self._wakes = True
        """Whether the watcher wakes the engine when the tier needs it (False while lent)."""
        self._stopped = False
        self.wakeups = 0
        """Times the watcher woke the engine for a peer."""
        self._thread = threading.Thread(target=self._run, name=THREAD_NAME, daemon=True)
        self._thread.start()

    # -- the engine thread ------------------------------------------------------------------

    def engine(self) -> IdleWatch:
        """``with watch.engine():`` around every call the engine makes into the tier."""
        return self

    def __enter__(self) -> IdleWatch:
        if self._asleep.is_set():
            self._asleep.clear()  # awake: the watcher stops after its current tick ...
            self._tier.interrupt()  # ... which stops waiting at once
        self._lock.acquire()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._lock.release()

    def sleep(self) -> None:
        """The engine reported no pending work and is about to block: watch for peers."""
        self._wakes = True
        self._asleep.set()

    def lend(self) -> None:
        """The engine ended its schedule and computes until its next call: drive the tier
        meanwhile, without waking the engine (it calls again once its step ends)."""
        self._wakes = False
        self._asleep.set()

    def close(self, timeout: float) -> None:
        """Stop the watcher; joins it for at most ``timeout`` seconds."""
        self._stopped = True
        self._asleep.set()
        self._tier.interrupt()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout)

    # -- the watcher ------------------------------------------------------------------------

    def _run(self) -> None:
        _name_os_thread(THREAD_NAME)
        needed = False
        while not self._stopped:
            if not self._asleep.wait(timeout=1.0):
                continue
            with self._lock:
                if self._stopped or not self._asleep.is_set():
                    continue
                wait = LENT_PACE if needed and not self._wakes else self._wait
                try:
                    self._tier.tick(wait)
                    needed = self._tier.needs_engine()
                except Exception:  # the engine's next call meets the same state: it reports
                    log.exception("p2pkv idle watch: ticking the tier failed")
                    needed = True
                    if not self._wakes:  # lent: stop here, not retry every LENT_PACE
                        self._asleep.clear()
            if needed and self._wakes and self._asleep.is_set():
                self._asleep.clear()
                self.wakeups += 1
                self._wake()


def _name_os_thread(name: str) -> None:
    """Give the calling thread ``name`` in the OS too (Linux ``prctl``; elsewhere nothing:
    Python before 3.14 names its threads only for itself)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    libc.prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)
