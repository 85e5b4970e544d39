"""Run one side of a test in a child process (``Child``, ``stop_all``): the kit's name for
:mod:`p2pkv.child`, which holds the code so that product code need not import the kit."""

from __future__ import annotations

from p2pkv.child import Child, stop_all

__all__ = ["Child", "stop_all"]
