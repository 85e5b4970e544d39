"""``KitMachine``: the base of the kit's hypothesis state machines.

It gives every machine three things:

- its settings: a subclass gets :func:`p2pkv.testing.profiles.machine_settings` as its
  ``TestCase.settings`` when it is defined (a ``@settings(...)`` decorator on it, or
  ``settings=`` given to ``run_state_machine_as_test``, still wins);
- its step log: each example starts a new section of the open step log
  (:mod:`p2pkv.testing.steps`), and the teardown is logged as a step of its own;
- a teardown that never replaces a failure: :meth:`KitMachine.teardown_after_failure` tells
  a machine's ``teardown`` that a step or invariant failed, so that it only closes what it
  opened (quietly, without waiting for anything) and the failure stays the reported error.
"""

from __future__ import annotations

import sys
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from p2pkv.testing import steps
from p2pkv.testing.profiles import machine_settings


class KitMachine(RuleBasedStateMachine):
    """Base of the kit's machines (see the module docstring)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls.TestCase.settings = machine_settings()

    def __init__(self) -> None:
        log = steps.current()
        if log is not None:
            log.example(type(self).__name__)
        super().__init__()
        self._handled_before = sys.exc_info()[1]
        """The exception being handled when the machine was built (the run's own caller
        may be inside an ``except`` clause): not a failure of this example."""

    def teardown_after_failure(self) -> bool:
        """Log the teardown (an open step log shows it as a step) and say whether it runs
        because a step or an invariant failed. Hypothesis calls ``teardown`` from a
        ``finally`` clause, so the failure is the exception being handled then: a teardown
        that raised or waited out a deadline on top of it would become the reported error."""
        log = steps.current()
        if log is not None:
            log.step("teardown", "")
        handled = sys.exc_info()[1]
        return handled is not None and handled is not self._handled_before
