"""``p2pkv-memory``: the ``memory`` transports as a plugin, found through the ``p2pkv``
entry-point group like any transport.

The code is core's reference backend (:mod:`p2pkv.reference`), which the conformance kit
and core's tests use without this plugin; its public names (``__all__``) are re-exported.
"""

from __future__ import annotations

from p2pkv.reference import *  # noqa: F403 (this distribution's API is the reference backend's)
from p2pkv.reference import __all__ as __all__
