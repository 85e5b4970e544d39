"""Logger names: everything p2pkv logs is under the ``p2pkv`` logger.

Core modules use ``logging.getLogger(__name__)`` (already ``p2pkv.*``). Plugin distributions
call :func:`module_logger` with their ``__name__`` so ``p2pkv_zmq.hub`` logs as
``p2pkv.zmq.hub``: one ``logging`` setting for ``p2pkv`` covers every transport and plugin.
"""

from __future__ import annotations

import logging


def logger_name(module: str) -> str:
    """``p2pkv_<dist>.<rest>`` -> ``p2pkv.<dist>.<rest>``; other names unchanged."""
    if module.startswith("p2pkv_"):
        return "p2pkv." + module.removeprefix("p2pkv_")
    return module


def module_logger(module: str) -> logging.Logger:
    return logging.getLogger(logger_name(module))
