"""Optional libraries (nixl, ucxx, ...) imported once per process, on first use.

A transport plugin module must import without its library, so ``p2pkv plugins`` can explain
what is missing. :class:`OptionalLibrary` runs the transport's importer once, caches the
outcome, success or :class:`~p2pkv.errors.TransportUnavailable` (a failed import of a compiled
extension is not worth retrying), and re-raises a fresh error each time so tracebacks do not
grow. :func:`missing_extra` tells whether a library of one of p2pkv's own extras (rich, for
the ``cli`` extra) is there.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Generic, TypeVar

from p2pkv.errors import TransportUnavailable

T = TypeVar("T")


class OptionalLibrary(Generic[T]):
    """``importer`` returns the library's API object, or the ``TransportUnavailable`` saying
    what to install; it must not raise."""

    def __init__(self, importer: Callable[[], T | TransportUnavailable]) -> None:
        self._importer = importer
        self._outcome: T | TransportUnavailable | None = None

    def load(self) -> T:
        """The library's API, importing it on first use; raises ``TransportUnavailable``."""
        if self._outcome is None:
            self._outcome = self._importer()
        if isinstance(self._outcome, TransportUnavailable):
            cached = self._outcome
            raise TransportUnavailable(cached.transport, cached.package, cached.cause)
        return self._outcome

    def problem(self) -> TransportUnavailable | None:
        """Why the library cannot be used here, or None. Never raises."""
        try:
            self.load()
        except TransportUnavailable as exc:
            return exc
        return None


def missing_extra(module: str, extra: str) -> str | None:
    """None if ``module`` imports, else one line naming it and the fix (``pip install
    'p2pkv[extra]'``). Never raises ``ImportError``."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        return (
            f"{module} is not installed ({exc}); it comes with the {extra!r} extra: "
            f"pip install 'p2pkv[{extra}]'"
        )
    return None
