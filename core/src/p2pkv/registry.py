"""The plugin registry: entry points -> pluggy -> a typed table of transports and observers.

Core code never touches ``pm.hook``: it asks :class:`Registry` for a transport class by kind and
name, and calls observers through :attr:`Registry.observers`. Built-in transports load through
the same ``p2pkv`` entry-point group as third-party ones. The registry imports no command
module: the CLI registers its built-in commands as p2pkv's own plugin (named ``p2pkv``, see
:meth:`Registry.add_internal_plugin`) when it builds its parser.

Every hook is called through pluggy (``pm.hook`` or a subset caller), so tracing sees it, and
once per plugin: a plugin whose hook raises is recorded in ``failures`` (or logged, for bench
baselines and observers) and the others go on. A plugin implementing a hook no hookspec
defines (pluggy's ``check_pending``) is refused, naming that hook.

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
import reprlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import pluggy
from pluggy import HookImpl

from p2pkv import hookspecs
from p2pkv.contracts import ControlTransport, DataTransport, TransportKind
from p2pkv.errors import ConfigError
from p2pkv.observers import Observers, callers_per_plugin

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

INTERNAL_PLUGIN = "p2pkv"
"""The name p2pkv's own plugin (``p2pkv.builtin_commands``, registered by the CLI) has."""


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

        A plugin that fails to import, declares another plugin API, implements a hook no
        hookspec defines or whose ``p2pkv_transports`` raises is recorded in ``failures`` and
        skipped (unregistered); the others still load.
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
        classes: list[Any] = []
        try:
            self.pm.register(plugin, name=name)
            reason = "; ".join(self._unknown_hooks(plugin))
            transports = callers_per_plugin(self.pm, "p2pkv_transports").get(name)
            if not reason and transports is not None:
                classes = [cls for result in transports() for cls in result or []]
        except Exception as exc:  # a broken plugin must not take the others down
            reason = f"{type(exc).__name__}: {exc}"
        if reason:
            if self.pm.is_registered(plugin):
                self.pm.unregister(plugin)
            self._fail(name, dist, reason)
            return
        self.plugins[name] = dist
        for tcls in classes:
            self._add_transport(tcls, name, dist, version)

    def _unknown_hooks(self, plugin: object) -> list[str]:
        """Why ``plugin`` (just registered) implements hooks no hookspec defines, one text per
        hook, found by pluggy's ``check_pending`` (every plugin registered before passed it)."""
        try:
            self.pm.check_pending()
        except pluggy.PluginValidationError:
            specs = [n for n in dir(hookspecs) if n.startswith(f"{hookspecs.PROJECT}_")]
            unknown = sorted(
                c.name for c in self.pm.get_hookcallers(plugin) or () if not c.has_spec()
            )
            return [
                f"implements unknown hook {hook!r}"
                + "".join(
                    f" (did you mean {m!r}?)" for m in difflib.get_close_matches(hook, specs, n=1)
                )
                for hook in unknown
            ]
        return []

    def _add_transport(self, tcls: Any, plugin: str, dist: str, version: str) -> None:
        kind = getattr(tcls, "kind", None)
        tname = getattr(tcls, "name", None)
        bases: dict[str, type[ControlTransport] | type[DataTransport]] = {
            "control": ControlTransport,
            "data": DataTransport,
        }
        base = bases.get(str(kind))
        if (
            base is None
            or not isinstance(tname, str)
            or not (isinstance(tcls, type) and issubclass(tcls, base))
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
                kind,
                tname,
                first.distribution,
                dist,
            )
            return
        table[tname] = TransportEntry(tcls, plugin, dist, version)

    def _finish(self) -> None:
        self.observers = Observers(self.pm)

    def transport(self, kind: TransportKind, name: str) -> type[Any]:
        """The class registered as ``name`` for ``kind``, or ``ConfigError`` saying what to do
        (for a name that a plugin blocked by ``P2PKV_DISABLE_PLUGINS`` may provide, one whose
        entry point or ``p2pkv-<name>`` distribution is that name: the variable to change)."""
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
        for plugin, plugin_dist in sorted(self.disabled.items()):
            if name in (plugin, plugin_dist.removeprefix("p2pkv-")):
                msg += (
                    f"; plugin {plugin!r} ({plugin_dist}) may provide it: "
                    f"{self.install_hint(plugin_dist)}"
                )
        raise ConfigError(msg)

    def install_hint(self, dist: str) -> str:
        """How to get distribution ``dist``'s plugins loaded here: take its entry points out of
        ``P2PKV_DISABLE_PLUGINS`` if that blocked them, else ``pip install`` it."""
        blocked = sorted(name for name, d in self.disabled.items() if d == dist)
        if blocked:
            names = " and ".join(repr(n) for n in blocked)
            return (
                f"{dist} is installed but {DISABLE_ENV} blocks it; remove {names} from "
                "that variable"
            )
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
        for plugin, outcome in self._call_each("p2pkv_bench_baselines"):
            if isinstance(outcome, Exception):
                log.error("p2pkv_bench_baselines of %s raised; ignored", plugin, exc_info=outcome)
                continue
            for cls in (cls for result in outcome for cls in result or []):
                name = getattr(cls, "name", None)
                if not isinstance(name, str):
                    log.warning("bench baseline %r of %s has no name", cls, plugin)
                elif name in found:
                    log.warning("bench baseline %r offered twice; keeping the first", name)
                else:
                    found[name] = cls
        return found

    def add_internal_plugin(self, plugin: object) -> None:
        """Register ``plugin`` as p2pkv's own plugin (:data:`INTERNAL_PLUGIN`; not listed in
        ``plugins``, its hook calls traced like any plugin's), unless one already is. The CLI
        registers its built-in commands (``p2pkv.builtin_commands``) this way before
        :meth:`add_cli_commands`; registered last, its ``tryfirst`` hook runs first."""
        if self.pm.get_plugin(INTERNAL_PLUGIN) is None:
            self.pm.register(plugin, name=INTERNAL_PLUGIN)

    def add_cli_commands(self, subparsers: Any) -> None:
        """Let p2pkv's own plugin (the built-in commands, first, once the CLI has added it with
        :meth:`add_internal_plugin`) and every other plugin add their subcommands; one that
        raises is recorded in ``failures`` and logged, so a broken plugin never takes the
        whole CLI down."""
        for plugin, outcome in self._call_each("p2pkv_cli_commands", subparsers=subparsers):
            if isinstance(outcome, Exception):
                self._fail(
                    plugin,
                    self.distribution(plugin),
                    f"p2pkv_cli_commands failed: {type(outcome).__name__}: {outcome}",
                )

    def doctor_checks(self) -> list[tuple[str, list[Any] | Exception]]:
        """Per plugin implementing ``p2pkv_doctor_checks``: what it returned (meant to be
        ``DoctorCheck`` objects; ``p2pkv doctor`` checks), or the exception it raised."""
        return [
            (
                plugin,
                outcome
                if isinstance(outcome, Exception)
                else [check for result in outcome for check in result or []],
            )
            for plugin, outcome in self._call_each("p2pkv_doctor_checks")
        ]

    def distribution(self, plugin: str) -> str:
        """The distribution plugin ``plugin`` was loaded from (``?`` when not known)."""
        return INTERNAL_PLUGIN if plugin == INTERNAL_PLUGIN else self.plugins.get(plugin, "?")

    def _call_each(self, hook_name: str, **kwargs: Any) -> list[tuple[str, list[Any] | Exception]]:
        """Call hook ``hook_name`` through pluggy once per implementing plugin, each alone, in
        pluggy's order: (plugin name, its results or the exception it raised)."""
        outcomes: list[tuple[str, list[Any] | Exception]] = []
        for plugin, caller in callers_per_plugin(self.pm, hook_name).items():
            try:
                outcomes.append((plugin, list(caller(**kwargs))))
            except Exception as exc:  # one broken plugin must not hide the others
                outcomes.append((plugin, exc))
        return outcomes


def _new_manager(env: Mapping[str, str]) -> pluggy.PluginManager:
    """A manager with the hookspecs (tracing when asked)."""
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    if env.get("P2PKV_TRACE_HOOKS", "") not in ("", "0"):
        trace = logging.getLogger("p2pkv.hooks")
        trace.setLevel(min(trace.getEffectiveLevel(), logging.INFO))

        def before(hook_name: str, impls: Sequence[HookImpl], kwargs: Mapping[str, Any]) -> None:
            trace.info(
                "hook %s(%s) -> %s",
                hook_name,
                ", ".join(f"{k}={reprlib.repr(v)}" for k, v in kwargs.items()),
                ", ".join(impl.plugin_name for impl in impls),
            )

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
