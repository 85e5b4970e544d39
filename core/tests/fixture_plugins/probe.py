"""Run in a subprocess by the registry tests: load the registry from entry points, print JSON.

Arguments ``kind:name`` are looked up with ``Registry.transport``; the outcome is reported.
"""

from __future__ import annotations

import json
import sys

from p2pkv.errors import ConfigError
from p2pkv.registry import Registry

registry = Registry.load()
lookups = {}
for arg in sys.argv[1:]:
    kind, name = arg.split(":", 1)
    try:
        cls = registry.transport(kind, name)  # type: ignore[arg-type]
        lookups[arg] = f"ok {cls.__module__}.{cls.__qualname__}"
    except ConfigError as exc:
        lookups[arg] = f"ConfigError: {exc}"
print(
    json.dumps(
        {
            "control": {n: e.distribution for n, e in registry.control.items()},
            "data": {n: e.distribution for n, e in registry.data.items()},
            "plugins": registry.plugins,
            "failures": [[f.plugin, f.distribution, f.reason] for f in registry.failures],
            "conflicts": {f"{k}:{n}": d for (k, n), d in registry.conflicts.items()},
            "lookups": lookups,
        }
    )
)
