"""``import p2pkv`` (and the tier and registry) never imports a transport library."""

from __future__ import annotations

import json
from typing import Any

import pytest

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
def test_no_transport_library_is_imported(imports: str, run_python: Any) -> None:
    proc = run_python("-c", PROBE.format(imports=imports, heavy=HEAVY))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == []
