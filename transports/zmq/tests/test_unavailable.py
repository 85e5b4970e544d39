"""Without pyzmq: the plugin still imports, ``availability`` explains, ``create`` raises
``TransportUnavailable`` naming p2pkv-zmq and pyzmq, and ``p2pkv keys`` says what to install."""

from __future__ import annotations

import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent(
    """
    import sys
    sys.modules["zmq"] = None  # every `import zmq` now fails like a missing package

    import p2pkv_zmq.plugin as plugin
    from p2pkv.contracts import ControlSettings
    from p2pkv.errors import TransportUnavailable
    from p2pkv.registry import Registry

    registry = Registry.from_plugins([("zmq", plugin)])
    cls = registry.transport("control", "zmq")
    problem = cls.availability()
    assert isinstance(problem, TransportUnavailable), problem
    assert problem.package == "p2pkv-zmq" and "pyzmq" in str(problem), str(problem)
    try:
        cls.create(ControlSettings("127.0.0.1", 0))
    except TransportUnavailable as exc:
        assert "p2pkv-zmq" in str(exc) and "pyzmq" in str(exc)
    else:
        raise AssertionError("create() without pyzmq must raise TransportUnavailable")

    from p2pkv_zmq.cli import run_keys
    import argparse
    assert run_keys(argparse.Namespace(dir=".", name="x", force=False)) == 1
    print("ok")
    """
)


def test_missing_pyzmq_is_explained_not_crashed() -> None:
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"
    assert "pip install p2pkv-zmq" in done.stderr


def test_importing_the_plugin_does_not_import_zmq() -> None:
    code = "import sys, p2pkv_zmq.plugin, p2pkv_zmq; print('zmq' in sys.modules)"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "False"
