"""Observer hooks as typed methods: ``observers.session_opened(peer=..., local=...)``.

Each method is declared once, from its hookspec (``session_opened = _hook(
hookspecs.p2pkv_session_opened)``), so its signature is the spec's and a misspelled
argument fails type checking. Calls go through pluggy (so ``P2PKV_TRACE_HOOKS`` sees them),
one implementing plugin at a time: an observer that raises is logged (its first failure with
the traceback, then the 10th, 100th, ... of the same plugin and hook, counted) and the next
observer still gets the event. A method with no implementation is a shared no-op, so call
sites need no guard; ``enabled`` (any observer implemented) is for call sites that would
build expensive arguments or run per job or transfer (a no-op call still builds its keyword
arguments: ~0.3 µs).

Call with keyword arguments only (pluggy's rule). Threading: observers run on the calling
thread (a tier's driver thread); the failure counts are shared and locked.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any, Generic, ParamSpec, overload

import pluggy

from p2pkv import hookspecs

log = logging.getLogger(__name__)

P = ParamSpec("P")


def _noop(*_: Any, **__: Any) -> None:
    return None


class _hook(Generic[P]):
    """Declares ``Observers.<name>`` for hookspec ``p2pkv_<name>`` (checked at class creation).

    An :class:`Observers` whose hook has implementations holds its caller as an instance
    attribute, which takes precedence over this (non-data) descriptor; otherwise the
    descriptor answers with the no-op."""

    def __init__(self, spec: Callable[P, None]) -> None:
        self.hook_name = spec.__name__

    def __set_name__(self, owner: type, name: str) -> None:
        if self.hook_name != f"p2pkv_{name}":
            raise TypeError(
                f"{owner.__name__}.{name} is declared from hookspec "
                f"{self.hook_name}; name it {self.hook_name.removeprefix('p2pkv_')}"
            )

    @overload
    def __get__(self, instance: None, owner: type) -> _hook[P]: ...

    @overload
    def __get__(self, instance: object, owner: type) -> Callable[P, None]: ...

    def __get__(self, instance: object | None, owner: type) -> _hook[P] | Callable[P, None]:
        return self if instance is None else _noop


class Observers:
    """The observer hooks of one plugin manager, bound when built (plugins registered later
    are not seen). ``Observers()`` observes nothing."""

    session_opened = _hook(hookspecs.p2pkv_session_opened)
    session_closed = _hook(hookspecs.p2pkv_session_closed)
    handshake_rejected = _hook(hookspecs.p2pkv_handshake_rejected)
    protocol_error = _hook(hookspecs.p2pkv_protocol_error)
    transfer_submitted = _hook(hookspecs.p2pkv_transfer_submitted)
    transfer_finished = _hook(hookspecs.p2pkv_transfer_finished)
    job_finished = _hook(hookspecs.p2pkv_job_finished)
    timeout = _hook(hookspecs.p2pkv_timeout)
    tier_state = _hook(hookspecs.p2pkv_tier_state)

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.enabled = False
        self._failures: Counter[tuple[str, str]] = Counter()
        self._lock = threading.Lock()
        if pm is None:
            return
        for attr, declared in vars(Observers).items():
            if not isinstance(declared, _hook):
                continue
            callers = callers_per_plugin(pm, declared.hook_name)
            if callers:
                setattr(self, attr, self._guarded(declared.hook_name, callers))
                self.enabled = True

    def _guarded(
        self, hook_name: str, callers: Mapping[str, Callable[..., object]]
    ) -> Callable[..., None]:
        def call(**kwargs: Any) -> None:
            for plugin, caller in callers.items():
                try:
                    caller(**kwargs)
                except Exception:
                    self._failed(plugin, hook_name)

        return call

    def _failed(self, plugin: str, hook_name: str) -> None:
        with self._lock:
            self._failures[(plugin, hook_name)] += 1
            count = self._failures[(plugin, hook_name)]
        if count == 1:
            log.exception("observer %s of plugin %s raised; ignored", hook_name, plugin)
        elif str(count).rstrip("0") == "1":  # 10, 100, 1000, ...
            log.error(
                "observer %s of plugin %s has raised %d times; ignored",
                hook_name,
                plugin,
                count,
                exc_info=True,
            )


def callers_per_plugin(pm: pluggy.PluginManager, hook_name: str) -> dict[str, Any]:
    """Registered plugin name -> a caller of hook ``hook_name`` (through pluggy, so traced)
    that runs only that plugin's implementation, in pluggy's call order. Calling them one by
    one keeps one plugin's exception from hiding the event from the others."""
    hook = getattr(pm.hook, hook_name)
    plugins = list(dict.fromkeys(impl.plugin for impl in reversed(hook.get_hookimpls())))
    return {
        pm.get_name(plugin) or "?": pm.subset_hook_caller(
            hook_name, [p for p in plugins if p is not plugin]
        )
        for plugin in plugins
    }
