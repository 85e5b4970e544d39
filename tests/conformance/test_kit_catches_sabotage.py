"""The suites catch every sabotaged transport of ``sabotage.py``, and pass the working
transport the variants derive from.

Every variant runs in a pytest subprocess of its own (as an author's suite run would: a fresh
interpreter, only the tests named for its defect), which must fail. How long a catch takes is
not asserted (a test that passes on a quiet machine and fails on a busy one is a bug); each
run is bounded by the subprocess timeout, and its seconds are reported with ``-rP``. The
suites run with ``timeout = 2.0`` (the default 10 s bounds the dead-peer wait on its own).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))
from sabotage import SABOTAGE  # noqa: E402

TIMEOUT = 2.0

SUITE_RUN = textwrap.dedent(
    f"""
    import sabotage
    from p2pkv.testing.suites import DataTransportSuite
    from socket_transport import SocketDataTransport

    def only(tests):  # test_x = None in a subclass removes an inherited test
        return {{n: None for n in dir(DataTransportSuite)
                 if n.startswith("test_") and n not in tests}}

    UNION = {{t for _, tests in sabotage.SABOTAGE.values() for t in tests}}

    class TestWorking(DataTransportSuite):
        transport = SocketDataTransport
        timeout = {TIMEOUT}
        locals().update(only(UNION))

    for name, (cls, tests) in sabotage.SABOTAGE.items():
        globals()["Test" + name] = type("Test" + name, (DataTransportSuite,), {{
            "transport": cls, "timeout": {TIMEOUT}, **only(tests)}})
    """
)

_ENV_KEPT = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "VIRTUAL_ENV")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("sabotage")
    (tmp / "test_sabotage_run.py").write_text(SUITE_RUN)
    return tmp


def run_suite(run_dir: Path, cls: str) -> tuple[subprocess.CompletedProcess[str], float]:
    """Run test class ``cls`` of the generated module; returns the process and its seconds."""
    env = {k: v for k, v in os.environ.items() if k in _ENV_KEPT}
    env["PYTHONPATH"] = str(HERE)
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", f"test_sabotage_run.py::{cls}", "-q",
         "-p", "no:cacheprovider", "-o", "addopts=", "--tb=line", "--timeout=60",
         "--rootdir", str(run_dir)],
        cwd=run_dir, env=env, capture_output=True, text=True, timeout=120, check=False,
    )
    return proc, time.monotonic() - start


def test_the_working_transport_passes(run_dir: Path) -> None:
    proc, _ = run_suite(run_dir, "TestWorking")
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("variant", sorted(SABOTAGE))
def test_the_suite_catches(run_dir: Path, variant: str) -> None:
    proc, seconds = run_suite(run_dir, f"Test{variant}")
    doc = (SABOTAGE[variant][0].__doc__ or "").split("\n")[0]
    assert proc.returncode == 1 and " failed" in proc.stdout, (
        f"{variant} ({doc}) was not caught:\n{proc.stdout[-3000:]}\n{proc.stderr[-2000:]}"
    )
    print(f"{variant} caught in {seconds:.1f}s")
