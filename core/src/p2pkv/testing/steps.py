"""The kit's machines write each step down before they take it.

A transport that crashes the process (a segfault in its library) ends a machine run before
hypothesis can print or save the failing example. So, while a step log is open, every rule of
the kit's machines is logged *before* it runs, with its arguments and then each value it
draws, one line each, written straight to the file (``os.write``: nothing buffered, so the
file holds every step up to the crash).

Open one with ``P2PKV_MACHINE_STEPS=PATH`` (every kit machine of the process appends to
``PATH``), or run the machine with :func:`p2pkv.testing.isolated.run_machine_in_child`, which
opens one for its child and prints the last example's steps when the child dies.

A machine's rules use :func:`step` where they would use ``hypothesis.stateful.rule`` (same
arguments). Threading: the driver thread of the machine only.
"""

from __future__ import annotations

import functools
import itertools
import os
from collections.abc import Callable
from typing import Any, TypeVar

from hypothesis.stateful import rule
from hypothesis.strategies import DataObject, SearchStrategy

ENV = "P2PKV_MACHINE_STEPS"
"""The environment variable naming the step log's file."""

EXAMPLE = "example "
"""How the line that starts an example begins (``example N: state = Machine()``)."""

_F = TypeVar("_F", bound=Callable[..., Any])


class StepLog:
    """An append-only file of machine steps, written unbuffered line by line."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        self._examples = itertools.count(1)
        self._steps = 0

    def example(self, machine: str) -> None:
        """A new example begins: the machine ``machine`` is built."""
        self._steps = 0
        self.write(f"{EXAMPLE}{next(self._examples)}: state = {machine}()")

    def step(self, name: str, arguments: str) -> None:
        """Rule ``name`` is about to run with ``arguments`` (or ``teardown``)."""
        self._steps += 1
        self.write(f"  step {self._steps}: {name}({arguments})")

    def draw(self, label: object, value: object) -> None:
        """The running rule drew ``value`` (labelled ``label``)."""
        self.write(f"      {label if label is not None else 'draw'} = {value!r}")

    def write(self, line: str) -> None:
        os.write(self._fd, (line + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


_log: StepLog | None = None


def current() -> StepLog | None:
    """The step log ``P2PKV_MACHINE_STEPS`` names (opened on first use; reopened when the
    variable names another file), or None when it is not set."""
    global _log
    path = os.environ.get(ENV)
    if not path:
        return None
    if _log is None or _log.path != path:
        if _log is not None:
            _log.close()
        _log = StepLog(path)
    return _log


class _LoggedData:
    """A rule's ``st.data()`` object that logs every value it draws, before it is used."""

    def __init__(self, data: DataObject, log: StepLog) -> None:
        self._data = data
        self._log = log

    def draw(self, strategy: SearchStrategy[Any], label: object = None) -> Any:
        value = self._data.draw(strategy, label=label)
        self._log.draw(label, value)
        return value

    def __repr__(self) -> str:
        return repr(self._data)


def _logged(value: Any, log: StepLog) -> Any:
    return _LoggedData(value, log) if isinstance(value, DataObject) else value


def step(**arguments: Any) -> Callable[[_F], _F]:
    """``hypothesis.stateful.rule(**arguments)`` for a rule that is logged before it runs
    (with its arguments, then each value it draws) while a step log is open."""

    def decorate(function: _F) -> _F:
        @functools.wraps(function)
        def logged(self: Any, *args: Any, **values: Any) -> Any:
            log = current()
            if log is not None:  # hypothesis passes keywords; a rule calling another, not
                shown = [
                    *map(repr, args),
                    *(f"{k}={v!r}" for k, v in values.items() if not isinstance(v, DataObject)),
                ]
                log.step(function.__name__, ", ".join(shown))
                args = tuple(_logged(v, log) for v in args)
                values = {k: _logged(v, log) for k, v in values.items()}
            return function(self, *args, **values)

        ruled: _F = rule(**arguments)(logged)  # type: ignore[no-untyped-call]
        return ruled

    return decorate
