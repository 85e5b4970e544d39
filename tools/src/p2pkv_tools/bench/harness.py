"""Synchronous commands to the bench's helper processes, over a ``multiprocessing`` pipe.

The pipe carries only the bench's own ``(op, args)`` tuples and ``("ok" | "error", value)``
replies between processes it spawned itself; never anything from a p2pkv wire.
"""

from __future__ import annotations

import multiprocessing as mp
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.connection import Connection
from typing import Any

from p2pkv_tools.bench.netns import Placement, enter

__all__ = ["Helper", "HelperError", "serve", "serve_built"]


class HelperError(RuntimeError):
    """A helper process refused a command, died, or did not answer in time."""


def serve(
    conn: Connection,
    handlers: Mapping[str, Callable[..., Any]],
    idle: Callable[[], bool] | None = None,
) -> None:
    """Answer commands until ``("exit", ())`` or a closed pipe (also one that closes while a
    reply is on its way: the caller is gone, e.g. an interrupted run).

    Between commands ``idle()`` runs (if given); it returns True while it has work, and then
    the pipe is checked without waiting, else with a 50 ms wait. A handler's exception is
    sent back as an error reply; the loop goes on."""
    conn.send(("ok", None))
    while True:
        if idle is not None and not conn.poll(0 if idle() else 0.05):
            continue
        try:
            op, args = conn.recv()
        except EOFError:
            return
        if op == "exit":
            return
        try:
            reply: tuple[str, Any] = ("ok", handlers[op](*args))
        except Exception as exc:  # the caller raises it as HelperError
            reply = ("error", f"{type(exc).__name__}: {exc}")
        try:
            conn.send(reply)
        except OSError:  # BrokenPipeError: nobody waits for the reply any more
            return


def serve_built(
    conn: Connection,
    build: Callable[[], Any],
    commands: Sequence[str],
    *,
    idle: str | None = None,
) -> None:
    """Build the object a helper process serves, answer ``commands`` (names of its methods)
    with :func:`serve`, ``idle`` (a method name) between them, and call its ``shutdown()``
    at the end. A failure to build is the first reply (an error), and nothing is served."""
    try:
        target = build()
    except Exception as exc:
        conn.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        serve(
            conn,
            {name: getattr(target, name) for name in commands},
            getattr(target, idle) if idle is not None else None,
        )
    finally:
        target.shutdown()


def _placed(
    placement: Placement, target: Callable[..., None], conn: Connection, *args: Any
) -> None:
    """Child entry of a placed helper: join ``placement`` before ``target`` runs (so before
    any socket or thread exists); a failure to join is the first reply (an error)."""
    try:
        enter(placement)
    except OSError as exc:
        conn.send(("error", f"joining its network namespace: {exc}"))
        return
    target(conn, *args)


STOP_TIMEOUT = 10.0
"""Seconds :meth:`Helper.stop` waits for a helper to exit before it kills it. Not the reply
``timeout``: a helper in the middle of a long cell reads ``exit`` only once the cell ends,
and an interrupted run must not wait for that."""


class Helper:
    """A spawned process running ``target(conn, *args)`` (which calls :func:`serve`), in
    ``placement`` (a network namespace and environment, see :mod:`p2pkv_tools.bench.netns`) when
    given, else where this process is.

    Every wait for a reply is bounded by ``timeout``, ``stop`` by :data:`STOP_TIMEOUT`.
    ``daemon`` helpers die with this process; a helper that spawns processes itself must not
    be daemonic."""

    def __init__(
        self,
        target: Callable[..., None],
        args: tuple[Any, ...],
        *,
        name: str,
        daemon: bool,
        timeout: float,
        placement: Placement | None = None,
    ) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe(duplex=True)
        self.name = name
        self.timeout = timeout
        entry, entry_args = (
            (target, (child, *args))
            if placement is None
            else (_placed, (placement, target, child, *args))
        )
        self.process = ctx.Process(target=entry, args=entry_args, name=name, daemon=daemon)
        self.process.start()
        child.close()
        self._started = False

    def _state(self) -> str:
        code = self.process.exitcode
        return "running" if code is None else f"exit code {code}"

    def send(self, op: str, *args: Any) -> None:
        if not self._started:  # the first reply says the helper is up
            self.reply("startup")
            self._started = True
        try:
            self.conn.send((op, args))
        except (BrokenPipeError, OSError):
            raise HelperError(f"{self.name} is gone ({self._state()})") from None

    def reply(self, what: str) -> Any:
        if not self.conn.poll(self.timeout):
            raise HelperError(f"{self.name} ({self._state()}) sent no {what} in {self.timeout}s")
        try:
            status, value = self.conn.recv()
        except EOFError:
            raise HelperError(f"{self.name} died ({self._state()})") from None
        if status != "ok":
            raise HelperError(f"{self.name}: {value}")
        return value

    def call(self, op: str, *args: Any) -> Any:
        self.send(op, *args)
        return self.reply(f"reply to {op}")

    def stop(self) -> None:
        """Ask it to exit, then kill it if it has not within :data:`STOP_TIMEOUT` (or
        ``timeout``, when shorter)."""
        try:
            self.conn.send(("exit", ()))
        except (BrokenPipeError, OSError):
            pass
        self.process.join(min(self.timeout, STOP_TIMEOUT))
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        self.conn.close()
