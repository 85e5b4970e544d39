"""The plugin registry: entry points -> pluggy -> a typed table of transports and observers.

Core code never touches ``pm.hook``: it asks :class:`Registry` for a transport class by kind and
name, and calls observers through :attr:`Registry.observers`. Built-in transports load through
the same ``p2pkv`` entry-point group as third-party ones.

Environment: ``P2PKV_DISABLE_PLUGINS=a,b`` blocks the named entry points;
``P2PKV_TRACE_HOOKS=1`` logs every hook call with its arguments (at INFO on the
``p2pkv.hooks`` logger, which it lowers to INFO if needed, so the calls show without
``--log-level INFO``). A plugin module that sets ``P2PKV_TEST_ONLY = True`` (a test fixture,
such as the example plugin ``p2pkv-example-loopback``) is hidden unless
``P2PKV_TEST_PLUGINS=1`` is set or the process runs under pytest (``PYTEST_VERSION`` is set),
so fixtures never show up in what a user runs.
"""

from __future__ import annotations

import difflib
import importlib.metadata as md
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy

from p2pkv import hookspecs
from p2pkv.contracts import ControlTransport, DataTransport, TransportKind
from p2pkv.errors import ConfigError

__all__ = [
    "DISABLE_ENV",
    "KNOWN_TRANSPORTS",
    "TEST_PLUGINS_ENV",
    "Observers",
    "PluginFailure",
    "Registry",
    "TransportEntry",
    "default_registry",
]

log = logging.getLogger(__name__)

DISABLE_ENV = "P2PKV_DISABLE_PLUGINS"
"""Comma-separated entry-point names not to load."""
TEST_PLUGINS_ENV = "P2PKV_TEST_PLUGINS"
"""``1``: load plugins marked ``P2PKV_TEST_ONLY`` (pytest runs load them anyway)."""

KNOWN_TRANSPORTS: Mapping[tuple[TransportKind, str], str] = {
    ("control", "zmq"): "p2pkv-zmq",
    ("control", "memory"): "p2pkv-memory",
    ("data", "nixl"): "p2pkv-nixl",
    ("data", "ucx"): "p2pkv-ucx",
    ("data", "memory"): "p2pkv-memory",
}
"""Transports the project publishes, with the distribution that provides each."""

_OBSERVER_HOOKS = (
    "p2pkv_session_opened",
    "p2pkv_session_closed",
    "p2pkv_handshake_rejected",
    "p2pkv_protocol_error",
    "p2pkv_transfer_submitted",
    "p2pkv_transfer_finished",
    "p2pkv_job_finished",
    "p2pkv_timeout",
    "p2pkv_tier_state",
)


@dataclass(frozen=True)
class TransportEntry:
    cls: type[ControlTransport] | type[DataTransport]
    plugin: str
    distribution: str
    version: str


@dataclass(frozen=True)
class PluginFailure:
    plugin: str
    distribution: str
    reason: str


def _noop(**_: Any) -> None:
    return None


class Observers:
    """Observer hooks as plain attributes: a no-op function when nobody implements a hook.

    ``enabled`` is False when no observer hook has any implementation, so hot paths can skip
    building arguments entirely.
    """

    session_opened: Callable[..., Any]
    session_closed: Callable[..., Any]
    handshake_rejected: Callable[..., Any]
    protocol_error: Callable[..., Any]
    transfer_submitted: Callable[..., Any]
    transfer_finished: Callable[..., Any]
    job_finished: Callable[..., Any]
    timeout: Callable[..., Any]
    tier_state: Callable[..., Any]

    def __init__(self, pm: pluggy.PluginManager | None = None) -> None:
        self.enabled = False
        for hook_name in _OBSERVER_HOOKS:
            attr = hook_name.removeprefix("p2pkv_")
            caller = getattr(pm.hook, hook_name) if pm is not None else None
            if caller is not None and caller.get_hookimpls():
                setattr(self, attr, _guarded(hook_name, caller))
                self.enabled = True
            else:
                setattr(self, attr, _noop)


def _guarded(hook_name: str, caller: Callable[..., Any]) -> Callable[..., Any]:
    def call(**kwargs: Any) -> None:
        try:
            caller(**kwargs)
        except Exception:
            log.exception("observer hook %s raised; ignored", hook_name)

    return call


@dataclass
class Registry:
    """Loaded plugins. Build with :meth:`load` (entry points) or :meth:`from_plugins` (tests)."""

    pm: pluggy.PluginManager
    control: dict[str, TransportEntry] = field(default_factory=dict)
    data: dict[str, TransportEntry] = field(default_factory=dict)
    failures: list[PluginFailure] = field(default_factory=list)
    conflicts: dict[tuple[TransportKind, str], list[str]] = field(default_factory=dict)
    plugins: dict[str, str] = field(default_factory=dict)
    """plugin name -> distribution."""
    disabled: dict[str, str] = field(default_factory=dict)
    """plugin name -> distribution, for entry points blocked by ``P2PKV_DISABLE_PLUGINS``."""
    hidden: dict[str, str] = field(default_factory=dict)
    """plugin name -> distribution, for test-only plugins not loaded (see the module doc)."""
    observers: Observers = field(default_factory=Observers)

    @classmethod
    def load(cls, *, environ: Mapping[str, str] | None = None) -> Registry:
        """Load every ``p2pkv`` entry point not blocked by ``P2PKV_DISABLE_PLUGINS`` (recorded
        in ``disabled``) and not test-only (recorded in ``hidden``, see the module doc).

        A plugin that fails to import or declares another plugin API is recorded in
        ``failures`` and skipped; the others still load.
        """
        env = os.environ if environ is None else environ
        blocked = {n.strip() for n in env.get(DISABLE_ENV, "").split(",") if n.strip()}
        with_tests = env.get(TEST_PLUGINS_ENV, "") == "1" or "PYTEST_VERSION" in env
        reg = cls(pm=_new_manager(env))
        for ep in md.entry_points(group=hookspecs.PROJECT):
            dist = ep.dist.name if ep.dist is not None else "?"
            version = ep.dist.version if ep.dist is not None else "?"
            if ep.name in blocked:
                reg.pm.set_blocked(ep.name)
                reg.disabled[ep.name] = dist
                log.info("plugin %s (%s) blocked by %s", ep.name, dist, DISABLE_ENV)
                continue
            try:
                plugin = ep.load()
            except Exception as exc:  # a broken plugin must not take the others down
                reg._fail(ep.name, dist, f"import failed: {type(exc).__name__}: {exc}")
                continue
            if getattr(plugin, "P2PKV_TEST_ONLY", False) is True and not with_tests:
                reg.hidden[ep.name] = dist
                continue
            reg._add(plugin, ep.name, dist, version)
        reg._finish()
        return reg

    @classmethod
    def from_plugins(
        cls, plugins: Iterable[tuple[str, object]], *, environ: Mapping[str, str] | None = None
    ) -> Registry:
        """A registry of in-process plugin objects (``(name, module)`` pairs), no entry points."""
        reg = cls(pm=_new_manager(os.environ if environ is None else environ))
        for name, plugin in plugins:
            reg._add(plugin, name, "(in-process)", "")
        reg._finish()
        return reg

    def _fail(self, plugin: str, dist: str, reason: str) -> None:
        log.warning("p2pkv plugin %s from %s not loaded: %s", plugin, dist, reason)
        self.failures.append(PluginFailure(plugin, dist, reason))

    def _add(self, plugin: object, name: str, dist: str, version: str) -> None:
        api = getattr(plugin, "P2PKV_PLUGIN_API", None)
        if api != hookspecs.PLUGIN_API_VERSION:
            self._fail(
                name,
                dist,
                f"built for plugin API {api!r}; this p2pkv supports "
                f"{hookspecs.PLUGIN_API_VERSION} (set P2PKV_PLUGIN_API = "
                f"{hookspecs.PLUGIN_API_VERSION} after porting)",
            )
            return
        try:
            self.pm.register(plugin, name=name)
            hook = cast(Any, self.pm.hook).p2pkv_transports
            impls = [i for i in hook.get_hookimpls() if i.plugin is plugin]
            classes: list[Any] = []
            for impl in impls:
                classes.extend(impl.function() or [])
        except Exception as exc:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._fail(name, dist, f"{type(exc).__name__}: {exc}")
            return
        self.plugins[name] = dist
        for tcls in classes:
            self._add_transport(tcls, name, dist, version)

    def _add_transport(self, tcls: Any, plugin: str, dist: str, version: str) -> None:
        kind = getattr(tcls, "kind", None)
        tname = getattr(tcls, "name", None)
        bases: dict[str, type[ControlTransport] | type[DataTransport]] = {
            "control": ControlTransport,
            "data": DataTransport,
        }
        base = bases.get(str(kind))
        if base is None or not isinstance(tname, str) or not (
            isinstance(tcls, type) and issubclass(tcls, base)
        ):
            self._fail(
                plugin, dist, f"{tcls!r} is not a ControlTransport/DataTransport with a name"
            )
            return
        table = self.control if kind == "control" else self.data
        key = (cast(TransportKind, kind), tname)
        if key in self.conflicts:
            self.conflicts[key].append(dist)
            return
        if tname in table:
            first = table.pop(tname)
            self.conflicts[key] = [first.distribution, dist]
            log.error(
                "%s transport %r is claimed by both %s and %s; refusing both",
                kind, tname, first.distribution, dist,
            )
            return
        table[tname] = TransportEntry(tcls, plugin, dist, version)

    def _finish(self) -> None:
        self.observers = Observers(self.pm)

    def transport(self, kind: TransportKind, name: str) -> type[Any]:
        """The class registered as ``name`` for ``kind``, or ``ConfigError`` saying what to do."""
        table = self.control if kind == "control" else self.data
        entry = table.get(name)
        if entry is not None:
            return entry.cls
        if (kind, name) in self.conflicts:
            dists = " and ".join(self.conflicts[(kind, name)])
            raise ConfigError(
                f"{kind} transport {name!r} is provided by more than one distribution ({dists}); "
                f"uninstall one or block it with P2PKV_DISABLE_PLUGINS"
            )
        dist = KNOWN_TRANSPORTS.get((kind, name))
        if dist is not None and dist in self.disabled.values():
            raise ConfigError(f"{kind} transport {name!r} is disabled: {self.install_hint(dist)}")
        installed = sorted(table)
        msg = f"unknown {kind} transport {name!r}; installed: {', '.join(installed) or 'none'}"
        close = difflib.get_close_matches(name, installed, n=1)
        if close:
            msg += f"; did you mean {close[0]!r}?"
        if dist is not None:
            msg += f"; {name!r} is provided by {dist}: {self.install_hint(dist)}"
        raise ConfigError(msg)

    def install_hint(self, dist: str) -> str:
        """How to get distribution ``dist``'s plugins loaded here: take its entry points out of
        ``P2PKV_DISABLE_PLUGINS`` if that blocked them, else ``pip install`` it."""
        blocked = sorted(name for name, d in self.disabled.items() if d == dist)
        if blocked:
            names = " and ".join(repr(n) for n in blocked)
            return (f"{dist} is installed but {DISABLE_ENV} blocks it; remove {names} from "
                    "that variable")
        return f"pip install {dist}"

    def entries(self, kind: TransportKind) -> dict[str, TransportEntry]:
        return dict(self.control if kind == "control" else self.data)

    def missing_known(self) -> list[tuple[TransportKind, str, str]]:
        """Published transports that are not installed here: (kind, name, distribution)."""
        return [
            (kind, name, dist)
            for (kind, name), dist in sorted(KNOWN_TRANSPORTS.items())
            if name not in (self.control if kind == "control" else self.data)
        ]

    def bench_baselines(self) -> dict[str, type[Any]]:
        """Raw-library baselines for ``p2pkv bench`` by name (hook ``p2pkv_bench_baselines``).

        A plugin whose hook raises is logged and skipped; the first of two same-named
        baselines wins (logged)."""
        found: dict[str, type[Any]] = {}
        hook = cast(Any, self.pm.hook).p2pkv_bench_baselines
        for impl in hook.get_hookimpls():
            try:
                classes = impl.function() or []
            except Exception:
                log.exception("p2pkv_bench_baselines of %s raised; ignored", impl.plugin_name)
                continue
            for cls in classes:
                name = getattr(cls, "name", None)
                if not isinstance(name, str):
                    log.warning("bench baseline %r of %s has no name", cls, impl.plugin_name)
                elif name in found:
                    log.warning("bench baseline %r offered twice; keeping the first", name)
                else:
                    found[name] = cls
        return found

    def add_cli_commands(self, subparsers: Any) -> None:
        """Let every plugin add its subcommands; one that raises is recorded in ``failures``
        and logged, so a broken plugin never takes the whole CLI down."""
        args = {"subparsers": subparsers}
        for impl in cast(Any, self.pm.hook).p2pkv_cli_commands.get_hookimpls():
            try:
                impl.function(*(args[name] for name in impl.argnames))
            except Exception as exc:
                name = impl.plugin_name
                self._fail(
                    name,
                    self.plugins.get(name, "?"),
                    f"p2pkv_cli_commands failed: {type(exc).__name__}: {exc}",
                )


def _new_manager(env: Mapping[str, str]) -> pluggy.PluginManager:
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if env.get("P2PKV_TRACE_HOOKS", "") not in ("", "0"):
        trace = logging.getLogger("p2pkv.hooks")
        trace.setLevel(min(trace.getEffectiveLevel(), logging.INFO))

        def before(hook_name: str, impls: Any, kwargs: Mapping[str, Any]) -> None:
            trace.info("hook %s(%s)", hook_name, ", ".join(f"{k}={v!r}" for k, v in kwargs.items()))

        def after(outcome: Any, hook_name: str, impls: Any, kwargs: Any) -> None:
            trace.debug("hook %s done", hook_name)

        pm.add_hookcall_monitoring(before, after)
    return pm


_DEFAULT: Registry | None = None


def default_registry() -> Registry:
    """The process-wide registry, loaded from entry points on first use."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Registry.load()
    return _DEFAULT
