"""Run a function in a spawned child process, with bounded waits and a hard kill.

The child runs ``target(conn, *args)`` where ``conn`` is the child's end of a duplex
``multiprocessing`` pipe (harness traffic only: a test's or a benchmark's commands and
replies, never a p2pkv wire). Every wait takes a timeout and raises ``TimeoutError`` naming
what was awaited, so a stuck peer fails the test or the measurement instead of hanging it.

Product code (the transports' benchmarks and baselines) imports it from here; the
conformance kit re-exports it as ``p2pkv.testing.child``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

FIRST_MESSAGE_BOUND = 120.0
"""Seconds the child's first message may take at least, whatever timeout the caller gives.

A spawned interpreter imports the transports' libraries before it can answer; on a busy
2-core machine that alone has taken over 10 s. Later messages get the caller's timeout."""


def _entry(target: Callable[..., Any], conn: Connection, args: tuple[Any, ...]) -> None:
    try:
        target(conn, *args)
    finally:
        conn.close()


class Child:
    """A spawned process talking to its parent over a pipe. Use as a context manager."""

    def __init__(self, target: Callable[..., Any], *args: Any, name: str = "p2pkv-child") -> None:
        ctx = mp.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(
            target=_entry, args=(target, child_conn, args), name=name, daemon=True
        )
        self._child_conn = child_conn
        self._heard = False

    def start(self) -> Child:
        self.process.start()
        self._child_conn.close()
        return self

    def __enter__(self) -> Child:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def pid(self) -> int:
        assert self.process.pid is not None
        return self.process.pid

    def send(self, obj: Any) -> None:
        self._conn.send(obj)

    def pending(self) -> bool:
        """Whether a message from the child is waiting (never blocks)."""
        return self._conn.poll(0)

    def recv(self, timeout: float, what: str = "a message") -> Any:
        """Next object from the child; ``TimeoutError`` if none within ``timeout`` seconds.

        The first message waits at least ``FIRST_MESSAGE_BOUND``: the child's start-up is
        load, not a failure."""
        if not self._heard:
            timeout = max(timeout, FIRST_MESSAGE_BOUND)
        if not self._conn.poll(timeout):
            state = "alive" if self.process.is_alive() else f"exited {self.process.exitcode}"
            raise TimeoutError(f"child {self.process.name} ({state}) sent no {what} in {timeout}s")
        try:
            message = self._conn.recv()
        except EOFError:
            raise EOFError(
                f"child {self.process.name} closed its pipe (exit {self.process.exitcode})"
            ) from None
        self._heard = True
        return message

    def request(self, obj: Any, timeout: float, what: str = "a reply") -> Any:
        self.send(obj)
        return self.recv(timeout, what)

    def kill(self) -> None:
        """SIGKILL the child (no cleanup on its side) and reap it."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGKILL)
        self.process.join(10)

    def pause(self) -> None:
        """SIGSTOP the child: it stays connected but falls silent (a hung peer)."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT a paused child (harmless if it is running or gone)."""
        if self.process.is_alive():
            os.kill(self.pid, signal.SIGCONT)

    def stop(self, timeout: float = 10.0) -> None:
        """Ask politely (close the pipe), then kill if it does not exit in time."""
        stop_all([self], timeout)

    def _ask_to_stop(self) -> None:
        try:
            self._conn.close()
        except OSError:
            pass


def stop_all(children: Sequence[Child], timeout: float) -> None:
    """Ask every child to stop at once (close its pipe), wait for them within one shared
    ``timeout``, then kill the ones still running: stopping many children costs one
    ``timeout`` at most, not one each."""
    for child in children:
        child._ask_to_stop()
    deadline = time.monotonic() + timeout
    for child in children:
        child.process.join(max(0.0, deadline - time.monotonic()))
        if child.process.is_alive():
            child.kill()
