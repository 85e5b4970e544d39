"""``import p2pkv`` (and the tier and registry) never imports a transport library, nor rich
(the ``cli`` extra); without rich the ``p2pkv`` command says which extra to install."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from child_python import RunPython

HEAVY = ("zmq", "nixl", "nixl_cu12", "ucxx", "ucp")

PROBE = """
import json, sys
{imports}
heavy = {heavy!r}
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in heavy)))
"""


@pytest.mark.parametrize(
    "imports",
    [
        "import p2pkv",
        "import p2pkv.tier",
        "import p2pkv.registry",
        "import p2pkv.config, p2pkv.contracts, p2pkv.errors, p2pkv.hookspecs, p2pkv.types",
        "from p2pkv.registry import Registry; Registry.load()",
    ],
)
def test_no_transport_library_is_imported(imports: str, run_python: RunPython) -> None:
    proc = run_python("-c", PROBE.format(imports=imports, heavy=HEAVY))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


@pytest.mark.parametrize(
    "imports",
    [
        "import p2pkv",
        "from p2pkv.tier import P2PTier",
        "import p2pkv.observers, p2pkv.cli",
        "from p2pkv.registry import Registry; Registry.load()",
    ],
)
def test_rich_is_not_imported(imports: str, run_python: RunPython) -> None:
    proc = run_python("-c", PROBE.format(imports=imports, heavy=("rich",)))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []


WITHOUT_RICH = """
import runpy, sys

class RefuseRich:
    def find_spec(self, name, path=None, target=None):
        if name == "rich" or name.startswith("rich."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, RefuseRich())
sys.argv = [sys.argv[1], "plugins"]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_console_script_without_rich_names_the_extra(run_python: RunPython) -> None:
    script = Path(sys.executable).parent / "p2pkv"
    if not script.exists():
        pytest.skip("p2pkv console script not installed next to this interpreter")
    proc = run_python("-c", WITHOUT_RICH, str(script))
    assert proc.returncode == 2
    assert proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line.startswith("p2pkv: rich is not installed")
    assert line.endswith("it comes with the 'cli' extra: pip install 'p2pkv[cli]'")
