"""The public surface of ``p2pkv``, pinned: what users and plugin authors may import.

The ``p2pkv`` namespace exports :data:`EXPORTED`, and the public packages' entry modules
export :data:`PUBLIC_MODULES`. Changing either is a deliberate act: change the pin here, add a
changelog fragment, and say in it whether a user's code breaks. Every other module of the
package is internal (docs/api.md, "What is public").
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import subprocess
import sys
from pathlib import Path

import p2pkv
import pytest

EXPORTED = [
    "DRAIN_GRACE",
    "DRIVER_BOUND",  # the driver bound a transport keeps (plugin-authors.md)
    "EMPTY_POLL",
    "OVERSIZED",
    "PLUGIN_API_VERSION",
    "AttachedPeer",
    "Capabilities",
    "CheckResult",
    "ConcurrentCall",
    "ConfigError",
    "ConnectionClosed",
    "ControlConnection",
    "ControlSettings",
    "ControlTransport",
    "DataBackend",
    "DataSettings",
    "DataTransport",
    "DoctorCheck",
    "Flow",
    "FrameTooLarge",
    "InboxConnection",
    "InboxControlTransport",
    "Indexes",
    "Job",
    "JobResult",
    "Limits",
    "LocalHitSource",
    "LookupResult",
    "Outcome",
    "P2PKVError",
    "P2PTier",
    "PeerRejected",
    "Peers",
    "PollResult",
    "ProtocolError",
    "ReadState",
    "RequestContext",
    "ResourceUnavailable",
    "SendQueueFull",
    "TierConfig",
    "Timeouts",
    "TransferBusy",
    "TransferSubmitError",
    "TransportKind",
    "TransportUnavailable",
    "UsageError",
    "__version__",
    "check_read",
    "format_address",
    "hookimpl",
    "option",
    "parse_address",
    "parse_options",
]
"""``p2pkv.__all__`` (sorted as ruff's RUF022 sorts it)."""

PUBLIC_MODULES = {
    "p2pkv.hookspecs": [
        "PLUGIN_API_VERSION",
        "PROJECT",
        "CheckResult",
        "DoctorCheck",
        "hookimpl",
        "hookspec",
    ],
    "p2pkv.reference": [
        "Fault",
        "FaultInjector",
        "FaultRule",
        "MemoryConnection",
        "MemoryControlTransport",
        "MemoryDataTransport",
    ],
    "p2pkv.reference.delegating": ["DelegatingControlTransport", "DelegatingDataTransport"],
    "p2pkv.testing.child": ["Child", "stop_all"],
    "p2pkv.testing.harness": [
        "REGISTRY",
        "Cluster",
        "Node",
        "RawPeer",
        "advance",
        "assert_clean",
        "config",
        "keys",
        "probe_until",
        "pump",
        "pump_until",
    ],
    "p2pkv.testing.isolated": ["run_machine_in_child"],
    "p2pkv.testing.peers": [
        "ChildControlPeer",
        "ChildDataPeer",
        "ControlPeer",
        "DataPeer",
        "LocalControlPeer",
        "LocalDataPeer",
        "PeerHost",
        "RemotePeerError",
        "make_region",
    ],
    "p2pkv.testing.polllog": ["PollLog"],
    "p2pkv.testing.profiles": ["PROFILE", "machine_settings"],
    "p2pkv.testing.stateful": ["ControlTransportMachine", "DataTransportMachine"],
    "p2pkv.testing.strategies": [
        "binary_frames",
        "byes",
        "fetches",
        "frames",
        "hello_acks",
        "hellos",
        "hostile_frames",
        "lookup_resps",
        "lookups",
        "messages",
        "readies",
        "releases",
        "round_faileds",
    ],
    "p2pkv.testing.suites": [
        "ControlTransportSuite",
        "DataIsolationSuite",
        "DataTransportSuite",
        "installed_transport",
    ],
    "p2pkv.testing.tier_machine": ["FakeClock", "TierMachine", "TierNode"],
    "p2pkv.testing.waiting": ["WaitTimeout", "pumping_in_background", "quietly", "wait_until"],
}
"""The entry modules of the public packages (the conformance kit, the reference backend, the
hook specifications) and their ``__all__``."""

INIT = Path(p2pkv.__file__)


def test_the_namespace_exports_exactly_the_pinned_names() -> None:
    assert p2pkv.__all__ == EXPORTED


@pytest.mark.parametrize("name", EXPORTED)
def test_every_exported_name_is_the_object_its_module_defines(name: str) -> None:
    value = getattr(p2pkv, name)
    if name == "__version__":
        assert isinstance(value, str) and value
        return
    module = importlib.import_module(p2pkv._MODULE_OF[name])
    assert value is getattr(module, name)
    if inspect.isclass(value) or inspect.isfunction(value):
        assert inspect.getdoc(value), f"p2pkv.{name} has no docstring"


def test_no_other_public_looking_name_in_the_namespace() -> None:
    """Submodules show up as attributes once imported; anything else must be exported."""
    for name in EXPORTED:
        getattr(p2pkv, name)
    extra = {
        name
        for name, value in vars(p2pkv).items()
        if not name.startswith("_") and not inspect.ismodule(value)
    } - set(EXPORTED)
    assert not extra, f"public-looking names not in p2pkv.__all__: {sorted(extra)}"
    assert set(EXPORTED) <= set(dir(p2pkv))


def test_the_type_checking_imports_match_the_lazy_table() -> None:
    """mypy and editors read the ``if TYPE_CHECKING:`` imports; the runtime reads
    ``_SOURCES``. Both must name the same (module, name) pairs, each as ``name as name``."""
    tree = ast.parse(INIT.read_text())
    (block,) = [
        n
        for n in tree.body
        if isinstance(n, ast.If)
        and isinstance(n.test, ast.Attribute)
        and n.test.attr == "TYPE_CHECKING"
    ]
    imported = set()
    for node in block.body:
        assert isinstance(node, ast.ImportFrom) and node.module, ast.dump(node)
        for alias in node.names:
            assert alias.asname == alias.name, f"import {alias.name} as itself (re-export)"
            imported.add((node.module, alias.name))
    lazy = [(module, name) for module, names in p2pkv._SOURCES.items() for name in names]
    assert imported == set(lazy)
    assert set(p2pkv.__all__) == {"__version__", *(name for _, name in lazy)}


def test_import_p2pkv_stays_light() -> None:
    """``import p2pkv`` loads no numpy, pluggy or msgspec until a name needs them."""
    code = (
        "import json, sys, p2pkv; print(json.dumps(sorted({m.split('.')[0] "
        "for m in sys.modules} & {'numpy', 'pluggy', 'msgspec', 'msgpack'})))"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(proc.stdout) == []


@pytest.mark.parametrize("module", sorted(PUBLIC_MODULES))
def test_public_modules_export_the_pinned_names(module: str) -> None:
    mod = importlib.import_module(module)
    assert list(mod.__all__) == PUBLIC_MODULES[module]
    for name in mod.__all__:
        assert hasattr(mod, name), f"{module}.{name} is listed but missing"


def test_the_api_reference_documents_the_public_surface_only() -> None:
    """docs/api.md is generated from ``p2pkv`` and public modules, never an internal one."""
    import api_reference

    assert api_reference.MODULES[0] == "p2pkv"
    assert set(api_reference.MODULES[1:]) <= set(PUBLIC_MODULES)
