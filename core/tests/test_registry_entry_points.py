"""The registry loads plugins from installed distributions' entry points.

Each test runs ``fixture_plugins/probe.py`` in a subprocess whose PYTHONPATH holds the fixture
plugin distributions (installed with ``pip --target``), next to what ``.venv`` has installed.
No loader is monkeypatched.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from child_python import RunPython

PROBE = str(Path(__file__).parent / "fixture_plugins" / "probe.py")


Probe = Callable[..., dict[str, Any]]
"""The ``probe`` fixture: ``probe(*lookups, site=..., **env)``, the child's JSON report."""


@pytest.fixture
def probe(fixture_site: Path, run_python: RunPython) -> Probe:
    def probe(*lookups: str, site: Path | None = fixture_site, **env: str) -> dict[str, Any]:
        proc = run_python(PROBE, *lookups, site=site, timeout=60, **env)
        assert proc.returncode == 0, proc.stderr
        result: dict[str, Any] = json.loads(proc.stdout)
        result["stderr"] = proc.stderr
        return result

    return probe


def failure(result: dict[str, Any], plugin: str) -> tuple[str, str]:
    matches = [(dist, reason) for name, dist, reason in result["failures"] if name == plugin]
    assert len(matches) == 1, result["failures"]
    return matches[0]


def test_good_plugin_and_memory_load_from_entry_points(probe: Probe) -> None:
    result = probe("control:fixture", "control:memory", "data:memory")
    assert result["control"]["fixture"] == "p2pkv-fixture-good"
    assert result["control"]["memory"] == "p2pkv-memory"
    assert result["data"]["memory"] == "p2pkv-memory"
    assert result["plugins"]["fixture_good"] == "p2pkv-fixture-good"
    assert result["lookups"]["control:fixture"] == "ok p2pkv_fixture_good.FixtureControl"
    assert result["lookups"]["data:memory"] == "ok p2pkv.reference.data.MemoryDataTransport"


def test_duplicate_name_is_refused_naming_both_distributions(probe: Probe) -> None:
    result = probe("data:fixture")
    assert "fixture" not in result["data"]
    assert sorted(result["conflicts"]["data:fixture"]) == [
        "p2pkv-fixture-dup",
        "p2pkv-fixture-good",
    ]
    message = result["lookups"]["data:fixture"]
    assert message.startswith("ConfigError")
    assert "p2pkv-fixture-good" in message and "p2pkv-fixture-dup" in message
    assert "P2PKV_DISABLE_PLUGINS" in message
    assert "claimed by both" in result["stderr"]


def test_broken_import_is_reported_not_fatal(probe: Probe) -> None:
    result = probe()
    dist, reason = failure(result, "fixture_broken")
    assert dist == "p2pkv-fixture-broken"
    assert "import failed" in reason and "on purpose" in reason
    assert result["control"]["fixture"] == "p2pkv-fixture-good"
    assert "fixture_broken" not in result["plugins"]


def test_wrong_plugin_api_version_is_refused(probe: Probe) -> None:
    result = probe()
    dist, reason = failure(result, "fixture_oldapi")
    assert dist == "p2pkv-fixture-oldapi"
    assert "plugin API 99" in reason and "supports 1" in reason
    assert "fixture_oldapi" not in result["plugins"]


def test_disable_plugins_blocks_named_plugins(probe: Probe) -> None:
    result = probe(
        "data:fixture", "data:memory", P2PKV_DISABLE_PLUGINS="fixture_dup, memory,fixture_broken"
    )
    # blocking one claimant resolves the conflict in favour of the other
    assert result["data"]["fixture"] == "p2pkv-fixture-good"
    assert result["conflicts"] == {}
    assert "memory" not in result["data"] and "memory" not in result["control"]
    assert {f[0] for f in result["failures"]} == {"fixture_oldapi", "fixture_typo"}
    message = result["lookups"]["data:memory"]
    assert "data transport 'memory' is disabled" in message
    assert "P2PKV_DISABLE_PLUGINS blocks it; remove 'memory'" in message


def test_misspelled_hook_is_refused_naming_it(probe: Probe) -> None:
    result = probe()
    dist, reason = failure(result, "fixture_typo")
    assert dist == "p2pkv-fixture-typo"
    assert reason == (
        "implements unknown hook 'p2pkv_transprots' (did you mean 'p2pkv_transports'?)"
    )
    assert "fixture_typo" not in result["plugins"]
    assert result["control"]["fixture"] == "p2pkv-fixture-good"  # the others still load


def test_a_transport_of_a_disabled_plugin_names_the_variable(probe: Probe) -> None:
    assert probe("data:fixture_shm")["lookups"]["data:fixture_shm"].startswith("ok ")
    message = probe("data:fixture_shm", P2PKV_DISABLE_PLUGINS="fixture_shm")["lookups"][
        "data:fixture_shm"
    ]
    assert message.startswith("ConfigError: unknown data transport 'fixture_shm'")
    assert "plugin 'fixture_shm' (p2pkv-fixture-shm) may provide it" in message
    assert "P2PKV_DISABLE_PLUGINS blocks it; remove 'fixture_shm' from that variable" in message


def test_unknown_name_suggests_the_closest(probe: Probe) -> None:
    result = probe("data:memroy", "control:fixtur")
    assert "did you mean 'memory'?" in result["lookups"]["data:memroy"]
    assert "installed: " in result["lookups"]["data:memroy"]
    assert "did you mean 'fixture'?" in result["lookups"]["control:fixtur"]


def test_without_fixture_site_only_real_plugins_load(probe: Probe) -> None:
    result = probe(site=None)
    assert "fixture" not in result["control"]
    assert not [f for f in result["failures"] if "fixture" in f[1]]
    assert "data:fixture" not in result["conflicts"]
    assert result["control"]["memory"] == "p2pkv-memory"
