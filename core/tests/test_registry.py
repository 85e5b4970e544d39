"""Registry rules exercised with in-process plugin objects (``Registry.from_plugins``).

Loading from installed entry points is covered by ``test_registry_entry_points.py``.
"""

from __future__ import annotations

import argparse
import logging
from typing import Any, ClassVar

import pytest
from p2pkv import builtin_commands
from p2pkv.cli import TOOL_COMMANDS, build_parser
from p2pkv.contracts import Capabilities, ControlTransport, DataTransport
from p2pkv.errors import ConfigError
from p2pkv.hookspecs import hookimpl
from p2pkv.observers import Observers
from p2pkv.registry import INTERNAL_PLUGIN, KNOWN_TRANSPORTS, Registry


class _Control(ControlTransport):
    name: ClassVar[str] = "ctl"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=True)


class _Data(DataTransport):
    name: ClassVar[str] = "dat"
    capabilities: ClassVar[Capabilities] = Capabilities(cross_process=True, cross_host=True)


class Plugin:
    P2PKV_PLUGIN_API = 1

    def __init__(self, *classes: Any) -> None:
        self.classes = list(classes)

    @hookimpl
    def p2pkv_transports(self) -> list[type[Any]]:
        return self.classes


class Observer:
    P2PKV_PLUGIN_API = 1

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []

    @hookimpl
    def p2pkv_session_opened(self, peer: str, local: str) -> None:
        self.calls.append({"peer": peer, "local": local})

    @hookimpl
    def p2pkv_session_closed(self, peer: str, reason: str) -> None:
        raise RuntimeError("observer bug")

    @hookimpl
    def p2pkv_cli_commands(self, subparsers: Any) -> None:
        subparsers.add_parser("observed").set_defaults(func=lambda args: 0)


def test_transports_by_kind_and_name() -> None:
    reg = Registry.from_plugins([("p", Plugin(_Control, _Data))], environ={})
    assert reg.transport("control", "ctl") is _Control
    assert reg.transport("data", "dat") is _Data
    assert set(reg.entries("control")) == {"ctl"}
    assert reg.entries("data")["dat"].plugin == "p"
    with pytest.raises(ConfigError, match="unknown data transport 'ctl'"):
        reg.transport("data", "ctl")


@pytest.mark.parametrize(("kind", "name"), sorted(KNOWN_TRANSPORTS))
def test_known_but_absent_transport_names_its_distribution(kind: Any, name: str) -> None:
    reg = Registry.from_plugins([], environ={})
    dist = KNOWN_TRANSPORTS[(kind, name)]
    with pytest.raises(ConfigError) as info:
        reg.transport(kind, name)
    assert f"{name!r} is provided by {dist}: pip install {dist}" in str(info.value)
    assert "installed: none" in str(info.value)
    assert (kind, name, dist) in reg.missing_known()


def test_unknown_name_without_close_match() -> None:
    reg = Registry.from_plugins([("p", Plugin(_Data))], environ={})
    with pytest.raises(ConfigError) as info:
        reg.transport("data", "zzzzzz")
    message = str(info.value)
    assert "installed: dat" in message
    assert "did you mean" not in message and "pip install" not in message


def test_duplicate_in_process_plugins_are_refused() -> None:
    reg = Registry.from_plugins([("a", Plugin(_Data)), ("b", Plugin(_Data))], environ={})
    with pytest.raises(ConfigError, match="more than one distribution"):
        reg.transport("data", "dat")
    assert reg.conflicts == {("data", "dat"): ["(in-process)", "(in-process)"]}


def test_non_transport_class_is_a_failure() -> None:
    reg = Registry.from_plugins([("p", Plugin(int, _Data))], environ={})
    assert [f.plugin for f in reg.failures] == ["p"]
    assert "is not a ControlTransport/DataTransport" in reg.failures[0].reason
    assert reg.transport("data", "dat") is _Data


def test_hook_that_raises_is_a_failure_and_unregistered() -> None:
    class Raising:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_transports(self) -> list[type[Any]]:
            raise RuntimeError("boom")

    raising = Raising()
    reg = Registry.from_plugins([("bad", raising), ("good", Plugin(_Control))], environ={})
    assert [(f.plugin, f.reason) for f in reg.failures] == [("bad", "RuntimeError: boom")]
    assert not reg.pm.is_registered(raising)
    assert reg.transport("control", "ctl") is _Control


def test_plugin_without_api_version_is_refused() -> None:
    class NoApi:
        @hookimpl
        def p2pkv_transports(self) -> list[type[Any]]:
            return [_Data]

    reg = Registry.from_plugins([("old", NoApi())], environ={})
    assert "built for plugin API None" in reg.failures[0].reason
    assert reg.entries("data") == {}


def test_observers_are_noops_without_implementations() -> None:
    obs = Registry.from_plugins([("p", Plugin(_Data))], environ={}).observers
    assert not obs.enabled
    assert obs.session_opened(peer="x", local="y") is None
    assert not Observers().enabled


def test_observers_call_implementations_and_swallow_errors(
    caplog: pytest.LogCaptureFixture,
) -> None:
    observer = Observer()
    reg = Registry.from_plugins([("obs", observer)], environ={})
    assert reg.observers.enabled
    reg.observers.session_opened(peer="a:1", local="b:2")
    assert observer.calls == [{"peer": "a:1", "local": "b:2"}]
    with caplog.at_level(logging.ERROR, logger="p2pkv.observers"):
        reg.observers.session_closed(peer="a:1", reason="bye")
    assert "observer p2pkv_session_closed of plugin obs raised" in caplog.text


class ClosedRecorder:
    P2PKV_PLUGIN_API = 1

    def __init__(self) -> None:
        self.reasons: list[str] = []

    @hookimpl
    def p2pkv_session_closed(self, peer: str, reason: str) -> None:
        self.reasons.append(reason)


@pytest.mark.parametrize("raising_first", [True, False])
def test_a_raising_observer_does_not_stop_the_next(
    raising_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    recorder = ClosedRecorder()
    plugins: list[tuple[str, object]] = [("raising", Observer()), ("recorder", recorder)]
    reg = Registry.from_plugins(plugins if raising_first else plugins[::-1], environ={})
    with caplog.at_level(logging.ERROR, logger="p2pkv.observers"):
        for i in range(12):
            reg.observers.session_closed(peer="a:1", reason=f"bye {i}")
    assert recorder.reasons == [f"bye {i}" for i in range(12)]
    # the first failure with its traceback, then the 10th; not every one
    records = [r for r in caplog.records if r.name == "p2pkv.observers"]
    assert [r.exc_info is not None for r in records] == [True, True]
    assert "has raised 10 times" in records[1].getMessage()


def test_observer_methods_have_the_hookspecs_signatures() -> None:
    assert Observers.session_opened.hook_name == "p2pkv_session_opened"
    with pytest.raises(TypeError, match="from hookspec p2pkv_session_opened; name it session_"):
        Observers.session_opened.__set_name__(Observers, "opened")


def test_trace_hooks_logs_calls(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="p2pkv.hooks"):
        reg = Registry.from_plugins(
            [("p", Plugin(_Data)), ("obs", Observer())], environ={"P2PKV_TRACE_HOOKS": "1"}
        )
        reg.observers.session_opened(peer="a:1", local="b:2")
    assert "hook p2pkv_transports() -> p" in caplog.text  # registration goes through pluggy
    assert "hook p2pkv_session_opened(peer='a:1', local='b:2') -> obs" in caplog.text
    assert "no implementation" not in caplog.text  # a hook is called only where implemented


def test_misspelled_hook_is_a_failure_naming_it() -> None:
    class Typo:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_transprots(self) -> list[type[Any]]:
            raise AssertionError("never called")

    typo = Typo()
    reg = Registry.from_plugins([("typo", typo), ("good", Plugin(_Control))], environ={})
    assert [(f.plugin, f.reason) for f in reg.failures] == [
        ("typo", "implements unknown hook 'p2pkv_transprots' (did you mean 'p2pkv_transports'?)")
    ]
    assert not reg.pm.is_registered(typo) and "typo" not in reg.plugins
    assert reg.transport("control", "ctl") is _Control


def test_builtin_commands_are_an_internal_plugin() -> None:
    reg = Registry.from_plugins([("obs", Observer())], environ={})
    assert reg.pm.get_plugin(INTERNAL_PLUGIN) is None  # the registry imports no command module
    reg.add_internal_plugin(builtin_commands)
    reg.add_internal_plugin(builtin_commands)  # once per registry
    assert reg.pm.get_plugin(INTERNAL_PLUGIN) is builtin_commands
    assert INTERNAL_PLUGIN not in reg.plugins and reg.distribution(INTERNAL_PLUGIN) == "p2pkv"
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    reg.add_cli_commands(sub)
    assert list(sub.choices) == ["plugins", "check-config", "observed"]


def test_the_cli_adds_the_builtins_first_and_stands_in_for_missing_tools() -> None:
    reg = Registry.from_plugins([("obs", Observer())], environ={})
    parser = build_parser(reg)
    (sub,) = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    assert list(sub.choices) == ["plugins", "check-config", "observed", *TOOL_COMMANDS]
    assert reg.pm.get_plugin(INTERNAL_PLUGIN) is builtin_commands


def test_bench_baselines_survive_a_raising_plugin(caplog: pytest.LogCaptureFixture) -> None:
    class Baseline:
        name = "dat"

    class Offers:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_bench_baselines(self) -> list[type[Any]]:
            return [Baseline]

    class Raises:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_bench_baselines(self) -> list[type[Any]]:
            raise RuntimeError("baseline bug")

    for order in ([("ok", Offers()), ("bad", Raises())], [("bad", Raises()), ("ok", Offers())]):
        with caplog.at_level(logging.ERROR, logger="p2pkv.registry"):
            assert Registry.from_plugins(order, environ={}).bench_baselines() == {"dat": Baseline}
        assert "p2pkv_bench_baselines of bad raised" in caplog.text


def test_a_name_a_disabled_plugin_may_provide_names_the_variable() -> None:
    reg = Registry.from_plugins([("p", Plugin(_Data))], environ={})
    reg.disabled.update({"shm": "p2pkv-shm", "other": "p2pkv-other"})
    with pytest.raises(ConfigError) as info:
        reg.transport("data", "shm")
    message = str(info.value)
    assert message.startswith("unknown data transport 'shm'; installed: dat")
    assert "plugin 'shm' (p2pkv-shm) may provide it" in message
    assert "P2PKV_DISABLE_PLUGINS blocks it; remove 'shm'" in message
    assert "other" not in message


def test_plugins_add_cli_commands() -> None:
    reg = Registry.from_plugins([("obs", Observer())], environ={})
    parser = argparse.ArgumentParser()
    reg.add_cli_commands(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["observed"]).func(None) == 0


def test_a_failing_cli_hook_is_a_failure_not_fatal() -> None:
    class BadCli:
        P2PKV_PLUGIN_API = 1

        @hookimpl
        def p2pkv_cli_commands(self, subparsers: Any) -> None:
            raise ModuleNotFoundError("No module named 'gone'")

    reg = Registry.from_plugins([("bad", BadCli()), ("obs", Observer())], environ={})
    parser = argparse.ArgumentParser()
    reg.add_cli_commands(parser.add_subparsers(dest="command"))
    assert parser.parse_args(["observed"]).func(None) == 0
    assert [(f.plugin, f.distribution) for f in reg.failures] == [("bad", "(in-process)")]
    assert "p2pkv_cli_commands failed: ModuleNotFoundError" in reg.failures[0].reason
