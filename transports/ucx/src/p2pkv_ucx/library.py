"""Loading ucxx lazily, and the one libucxx call its Python API does not expose.

Nothing here imports ``ucxx`` at module import time: ``import p2pkv_ucx.plugin`` works on a
host without it, and ``p2pkv plugins`` explains why the transport is unavailable.

:func:`load` imports ``ucxx`` once per process and caches the outcome, success or failure.
Any exception while importing (package missing, ``libucxx.so`` not found because
``librmm-cu12`` is absent, an API that moved) becomes
:class:`~p2pkv.errors.TransportUnavailable` naming the lean install command.

Side effect of loading, process-wide and skipped if the user decided already:
``UCX_WARN_UNUSED_ENV_VARS=n`` (ucxx sets ``UCX_MEMTYPE_CACHE`` on import, which UCX then
reports as unused on every context creation on a host without CUDA).

**Request cancellation.** ucxx cancels a request only when its Python object is garbage
collected, which loses sight of whether the cancel took. :attr:`Ucxx.cancel` calls
``ucxx::RequestTag::cancel()`` (exported by ``libucxx.so``) on a request we still hold, so we can
check ``completed`` right after: an unmatched tag receive completes at once with
``UCS_ERR_CANCELED``; a matched one (payload already moving) and any send are not stopped.
When the symbol is missing (another libucxx), ``cancel`` is None and every receive counts as
unstoppable, which is safe (the caller keeps it in flight) but slower to drain.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from p2pkv.errors import TransportUnavailable
from p2pkv.optional import OptionalLibrary

__all__ = ["LEAN_INSTALL", "Ucxx", "load", "problem", "ucx_environment"]

TRANSPORT = "ucx"
LEAN_INSTALL = (
    "--no-deps ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 "
    "librmm-cu12==26.10.0 rapids-logger==0.3.0"
)
"""What to put after ``pip install``. A plain ``pip install ucxx-cu12`` also pulls the CUDA
Python bindings, rmm and pynvml, none of which host-memory transfers use. ``ucx-py-cu12`` on
PyPI is a stub that downloads its wheel from a vendor index at install time: not usable here."""

_ENV_DEFAULTS = {"UCX_WARN_UNUSED_ENV_VARS": "n"}
_CANCEL_SYMBOL = "_ZN4ucxx10RequestTag6cancelEv"  # ucxx::RequestTag::cancel()


@dataclass(frozen=True)
class Ucxx:
    """The parts of ucxx this package uses."""

    api: Any
    """``ucxx._lib.libucxx``: ``UCXContext``, ``UCXWorker``, ``UCXEndpoint``, ``UCXAddress``,
    ``UCXXTag``, ``UCXXTagMask``, ``Feature``."""
    array: Any
    """``ucxx._lib.arr.Array``: wraps a buffer-protocol object for a send or receive."""
    cancel: Callable[[Any], None] | None
    """``cancel(request)``: ask libucxx to cancel a tag request we still hold (see module doc)."""
    version: str
    env: Mapping[str, str]
    """UCX variables ucxx (and we) would set process-wide on import; applied only while our
    own UCX context is created (see :func:`ucx_environment`), so processes spawned later (a
    NIXL peer, a bench worker) do not inherit them: NIXL ran 30-100x slower with them."""


@contextlib.contextmanager
def ucx_environment(env: Mapping[str, str]) -> Iterator[None]:
    """Set ``env`` in ``os.environ`` for the duration of the block, then restore it exactly."""
    saved = {key: os.environ.get(key) for key in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _import() -> Ucxx | TransportUnavailable:
    before = dict(os.environ)
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        return _import_ucxx()
    finally:
        # ucxx writes UCX_* defaults into os.environ on import; keep them for our context only.
        added = {k: v for k, v in os.environ.items() if before.get(k) != v}
        os.environ.clear()
        os.environ.update(before)
        _IMPORT_ENV.update(added)


_IMPORT_ENV: dict[str, str] = {}


def _import_ucxx() -> Ucxx | TransportUnavailable:
    try:
        ucxx = importlib.import_module("ucxx")
        api = importlib.import_module("ucxx._lib.libucxx")
        arr = importlib.import_module("ucxx._lib.arr")
        for name in (
            "UCXContext",
            "UCXWorker",
            "UCXEndpoint",
            "UCXAddress",
            "UCXXTag",
            "UCXXTagMask",
            "Feature",
        ):
            getattr(api, name)
        array = arr.Array
    except Exception as exc:  # ImportError, OSError from a missing .so, AttributeError
        return TransportUnavailable(
            TRANSPORT, LEAN_INSTALL, f"cannot import ucxx ({type(exc).__name__}: {exc})"
        )
    return Ucxx(api, array, _cancel_function(), str(getattr(ucxx, "__version__", "?")), _IMPORT_ENV)


def _cancel_function() -> Callable[[Any], None] | None:
    try:
        import libucxx  # the wheel that ships libucxx.so

        paths = glob.glob(os.path.join(os.path.dirname(libucxx.__file__), "lib*", "libucxx.so"))
        symbol = getattr(ctypes.CDLL(paths[0]), _CANCEL_SYMBOL)
    except (ImportError, IndexError, OSError, AttributeError):
        return None
    symbol.argtypes = [ctypes.c_void_p]
    symbol.restype = None

    def cancel(request: Any) -> None:
        symbol(request.ucxx_ptr)

    return cancel


_LIBRARY = OptionalLibrary(_import)
load = _LIBRARY.load
problem = _LIBRARY.problem
