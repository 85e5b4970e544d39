"""NIXL missing or broken: a clear ``TransportUnavailable``, never an ``AttributeError`` later.

Each case runs in a fresh interpreter where ``nixl`` cannot be imported: blocked by a
``sys.meta_path`` finder (not installed), or shadowed by a package that raises ``ImportError``
the way a wheel missing a CUDA library does.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

PROBE = textwrap.dedent(
    """
    import json, sys
    {setup}
    import p2pkv_nixl.plugin  # must not need nixl
    from p2pkv.cli_plugins import plugin_report
    from p2pkv.contracts import DataSettings
    from p2pkv.errors import TransportUnavailable
    from p2pkv.registry import Registry
    from p2pkv_nixl import NixlDataTransport

    out = {{"nixl_imported_by_plugin": "nixl._api" in sys.modules}}
    problem = NixlDataTransport.availability()
    out["availability"] = None if problem is None else [type(problem).__name__, str(problem),
                                                         problem.package]
    try:
        NixlDataTransport.create(DataSettings(memoryview(bytearray(64)), 16))
        out["create"] = "created"
    except TransportUnavailable as exc:
        out["create"] = ["TransportUnavailable", str(exc)]
    except Exception as exc:
        out["create"] = [type(exc).__name__, str(exc)]
    rows = plugin_report(Registry.load())["transports"]
    out["plugins"] = [r for r in rows if r["name"] == "nixl"]
    print(json.dumps(out))
    """
)

BLOCKER = textwrap.dedent(
    """
    class _NoNixl:
        def find_spec(self, name, path=None, target=None):
            if name == "nixl" or name.startswith(("nixl.", "nixl_")):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None
    sys.meta_path.insert(0, _NoNixl())
    """
)


def _run(setup: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(setup=setup)],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _assert_unavailable(out: dict[str, Any], cause: str) -> None:
    assert out["nixl_imported_by_plugin"] is False
    kind, message, package = out["availability"]
    assert kind == "TransportUnavailable"
    assert package == "--no-deps nixl-cu12==1.5.1 nixl==1.5.1"
    assert "pip install --no-deps nixl-cu12==1.5.1 nixl==1.5.1" in message
    assert cause in message
    assert out["create"][0] == "TransportUnavailable"
    assert cause in out["create"][1]
    (row,) = out["plugins"]
    assert row["available"] is False
    assert "nixl-cu12==1.5.1" in row["reason"] and cause in row["reason"]


def test_nixl_not_installed() -> None:
    out = _run(BLOCKER)
    _assert_unavailable(out, "No module named 'nixl'")


def test_nixl_failing_to_import(tmp_path: Path) -> None:
    shadow = tmp_path / "nixl"
    shadow.mkdir()
    (shadow / "__init__.py").write_text(
        "raise ImportError('libcuda.so.1: cannot open shared object file')\n"
    )
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path}
    out = _run("", env)
    _assert_unavailable(out, "ImportError: libcuda.so.1: cannot open shared object file")
