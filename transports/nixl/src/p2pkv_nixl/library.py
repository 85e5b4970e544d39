"""Loading NIXL lazily, and the UCX environment defaults it runs with.

Nothing here imports ``nixl`` at module import time: ``import p2pkv_nixl.plugin`` works on a
host without NIXL, and ``p2pkv plugins`` explains why the transport is unavailable.

:func:`load` imports ``nixl`` once per process and caches the outcome, success or failure (a
failed import of a compiled extension is not worth retrying). Any exception while importing
(missing package, a shared library it cannot find, an API that moved) becomes
:class:`~p2pkv.errors.TransportUnavailable` naming the lean install command and the
underlying error.

Side effects of loading, both process-wide and both skipped if the user decided already:

- ``UCX_RCACHE_MAX_UNRELEASED`` is set to ``1024`` (UCX's default lets its registration cache
  hold an unbounded number of released regions);
- NIXL's Python logger (which writes INFO lines to *stdout*) is raised to WARNING unless
  ``NIXL_LOG_LEVEL`` is set.
"""

from __future__ import annotations

import importlib
import logging
import os
from dataclasses import dataclass
from typing import Any

from p2pkv.errors import TransportUnavailable
from p2pkv.optional import OptionalLibrary

__all__ = [
    "LEAN_INSTALL",
    "UCX_DEFAULTS",
    "Nixl",
    "apply_ucx_defaults",
    "load",
    "problem",
]

TRANSPORT = "nixl"
LEAN_INSTALL = "--no-deps nixl-cu12==1.5.1 nixl==1.5.1"
"""What to put after ``pip install``. A plain ``pip install nixl`` pulls torch and the CUDA
stack (about 6 GB) because ``nixl-cu12`` declares torch although NIXL never imports it; numpy
(its only real dependency) comes with p2pkv-nixl. ``nixl`` 1.5.2 does not resolve: pin 1.5.1."""

UCX_DEFAULTS: dict[str, str] = {"UCX_RCACHE_MAX_UNRELEASED": "1024"}
"""UCX environment variables set when unset (read by UCX when an agent is created)."""


@dataclass(frozen=True)
class Nixl:
    """The parts of the ``nixl`` Python API this package uses."""

    agent_cls: Any
    """``nixl._api.nixl_agent``."""
    config_cls: Any
    """``nixl._api.nixl_agent_config``."""
    remote_disconnect: type[BaseException]
    """``nixl._bindings.nixlRemoteDisconnectError`` (a dead peer, raised at submit or check)."""
    version: str


def apply_ucx_defaults(environ: Any = None) -> None:
    """Set every :data:`UCX_DEFAULTS` variable the user has not set (``os.environ`` by default)."""
    env = os.environ if environ is None else environ
    for key, value in UCX_DEFAULTS.items():
        env.setdefault(key, value)


def _unavailable(cause: str) -> TransportUnavailable:
    return TransportUnavailable(
        TRANSPORT,
        LEAN_INSTALL,
        f"{cause} (install NIXL lean: a plain `pip install nixl` also pulls torch and CUDA, "
        f"about 6 GB)",
    )


def _import() -> Nixl | TransportUnavailable:
    apply_ucx_defaults()
    try:
        importlib.import_module("nixl")
        api = importlib.import_module("nixl._api")
        bindings = importlib.import_module("nixl._bindings")
        found = Nixl(
            agent_cls=api.nixl_agent,
            config_cls=api.nixl_agent_config,
            remote_disconnect=bindings.nixlRemoteDisconnectError,
            version=_version(),
        )
    except Exception as exc:  # ImportError, OSError from a .so, AttributeError if the API moved
        return _unavailable(f"cannot import nixl ({type(exc).__name__}: {exc})")
    if not os.environ.get("NIXL_LOG_LEVEL"):
        logging.getLogger("nixl").setLevel(logging.WARNING)
    return found


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("nixl")
    except PackageNotFoundError:
        return "?"


_LIBRARY = OptionalLibrary(_import)
load = _LIBRARY.load
problem = _LIBRARY.problem
