"""Run a kit state machine in a child process, so a crash is reported with its steps.

A transport that segfaults kills an in-process machine run with nothing printed and nothing
saved for hypothesis to replay. :func:`run_machine_in_child` runs the whole hypothesis run of
a machine in a spawned child with a step log open (:mod:`p2pkv.testing.steps`) and a fixed
seed; the test process only waits (bounded) for the outcome::

    from p2pkv.testing.isolated import run_machine_in_child


    def test_data_machine():
        run_machine_in_child(MyDataMachine)

- the child's run passes: so does the call;
- it fails: ``AssertionError`` with the child's traceback (hypothesis' printed steps go to the
  child's stderr, which pytest captures like the test's own);
- the child dies (a signal, an exit) or does not finish within ``timeout``:
  ``AssertionError`` naming the signal, with the last example's steps as logged before each
  call, and how to replay it: the same seed makes the same draws (the example database is off
  in the child, so nothing else is replayed first).

The child rebuilds the machine class: an importable class goes as it is; one built in a test
(``type(name, (DataTransportMachine,), {...})``) goes as its bases and class attributes, which
must then be importable or picklable (transport classes, options, timeouts).
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import random
import signal
import sys
import tempfile
import traceback
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import hypothesis
from hypothesis.stateful import run_state_machine_as_test

from p2pkv.child import Child
from p2pkv.testing import steps

__all__ = ["run_machine_in_child"]

_SHOWN_LINES = 200
"""At most this many lines of the last example's steps are printed."""


def run_machine_in_child(
    machine: type[Any],
    *,
    settings: hypothesis.settings | None = None,
    seed: int | None = None,
    timeout: float = 900.0,
) -> None:
    """Run ``run_state_machine_as_test(machine)`` in a spawned child (see the module
    docstring). ``settings`` default to the machine's own; ``seed`` (random by default) is
    printed with any failure; ``timeout`` bounds the whole run, in seconds."""
    seed = random.randrange(2**32) if seed is None else seed
    chosen = hypothesis.settings(settings or machine.TestCase.settings, database=None)
    recipe = _recipe(machine)
    replay = f"replay: run_machine_in_child({machine.__name__}, seed={seed}) makes the same draws"
    with tempfile.TemporaryDirectory(prefix="p2pkv-steps-") as tmp:
        log = Path(tmp) / "steps.log"
        with Child(
            _child_main, recipe, chosen, seed, str(log), name=f"p2pkv-{machine.__name__}"
        ) as child:
            outcome, detail = _outcome(child, timeout)
            if outcome == "passed":
                return
            if outcome == "failed":
                raise AssertionError(
                    f"{machine.__name__} failed in its child process (seed "
                    f"{seed}; {replay}):\n{detail}"
                )
            child.kill()
        raise AssertionError(
            f"{machine.__name__}'s child process {detail}; its last example's steps, each "
            f"logged before it ran:\n{_last_example(log)}\n{replay}"
        )


def _outcome(child: Child, timeout: float) -> tuple[str, str]:
    """("passed", ""), ("failed", the child's traceback), or ("died"/"hung", how)."""
    try:
        reply: tuple[str, str] = child.recv(timeout, "the outcome of its machine run")
        return reply
    except TimeoutError:
        return "hung", f"did not finish within {timeout}s"
    except EOFError:
        child.process.join(10)
        code = child.process.exitcode
        if code is not None and code < 0:
            return "died", f"died of {signal.Signals(-code).name}"
        return "died", f"exited with status {code} before reporting an outcome"


def _child_main(
    conn: Connection, recipe: Any, chosen: hypothesis.settings, seed: int, log: str
) -> None:
    """Child side: run the machine with its step log open; send the outcome."""
    os.environ[steps.ENV] = log
    machine = recipe if isinstance(recipe, type) else type(*recipe)
    try:
        run_state_machine_as_test(hypothesis.seed(seed)(machine), settings=chosen)
    except BaseException:
        conn.send(("failed", traceback.format_exc()))
        return
    conn.send(("passed", ""))


def _recipe(machine: type[Any]) -> Any:
    """What the child rebuilds ``machine`` from: the class itself when a fresh interpreter
    can import it, else ``(name, bases, class attributes)``; ``TypeError`` naming what cannot
    cross to the child."""
    if _importable(machine):
        return machine
    attrs = {
        k: v
        for k, v in vars(machine).items()  # not hypothesis' per-class caches
        if not k.startswith("_") and k != "TestCase"
    }
    recipe = (machine.__name__, machine.__bases__, attrs)
    try:
        pickle.dumps(recipe)
    except Exception as exc:
        raise TypeError(
            f"run_machine_in_child: {machine.__name__} cannot be rebuilt in a "
            f"child ({exc}); define it at module level of an importable module, "
            f"or build it with type() over importable classes and values"
        ) from None
    return recipe


def _importable(cls: type[Any]) -> bool:
    """Whether a fresh interpreter finds ``cls`` by its module and qualified name."""
    module = sys.modules.get(cls.__module__)
    if module is None or cls.__module__ == "__main__":
        return False
    try:
        spec = importlib.util.find_spec(cls.__module__)
    except (ImportError, ValueError):
        return False
    return spec is not None and getattr(module, cls.__qualname__, None) is cls


def _last_example(log: Path) -> str:
    """The steps logged since the last example began (at most ``_SHOWN_LINES`` lines)."""
    lines = log.read_text().splitlines() if log.exists() else []
    starts = [i for i, line in enumerate(lines) if line.startswith(steps.EXAMPLE)]
    last = lines[starts[-1] :] if starts else lines
    if not last:
        return "  (no step was logged)"
    return "\n".join(last[-_SHOWN_LINES:])
