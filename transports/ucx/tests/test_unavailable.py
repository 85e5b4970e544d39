"""Without a working ucxx: the plugin still imports, ``availability`` explains, and ``create``
raises ``TransportUnavailable`` naming the lean install (checked in fresh interpreters)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules[{blocked!r}] = None  # this import now fails like a missing or broken package

    import p2pkv_ucx.plugin as plugin
    import numpy as np
    from p2pkv.contracts import DataSettings
    from p2pkv.errors import TransportUnavailable
    from p2pkv.registry import Registry

    registry = Registry.from_plugins([("ucx", plugin)])
    cls = registry.transport("data", "ucx")
    problem = cls.availability()
    assert isinstance(problem, TransportUnavailable), problem
    assert "ucxx-cu12" in problem.package and "--no-deps" in problem.package, problem.package
    assert "ucxx" in str(problem), str(problem)
    region = np.zeros(4096, np.uint8)
    for make in (cls.create, registry.bench_baselines()["ucx"].create):
        try:
            make(DataSettings(region.data, 1024))
        except TransportUnavailable as exc:
            assert "pip install --no-deps ucxx-cu12" in str(exc), str(exc)
        else:
            raise AssertionError("create() without ucxx must raise TransportUnavailable")
    print("ok")
    """
)


@pytest.mark.parametrize("blocked", ["ucxx", "ucxx._lib.libucxx"])
def test_missing_or_broken_ucxx_is_explained_not_crashed(blocked: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT.format(blocked=blocked)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_importing_the_plugin_does_not_import_ucxx() -> None:
    code = (
        "import sys, p2pkv, p2pkv_ucx, p2pkv_ucx.plugin, p2pkv_ucx.transport; "
        "print('ucxx' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
