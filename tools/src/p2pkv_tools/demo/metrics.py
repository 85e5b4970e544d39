"""``p2pkv demo --metrics``: the run's Prometheus metrics, served while it runs or printed after.

The metrics are those of ``p2pkv-prometheus`` in the processes that run the tiers. With two
role processes they report in multi-process mode, into ``PROMETHEUS_MULTIPROC_DIR`` when it is
set, else into a temporary directory removed at the end, and this process merges that
directory (``MultiProcessCollector``); in the one-process mode (a process-local transport)
the tiers report into this process's default registry, which is what is shown. Once the roles
have exited their gauges are gone and their counters and histograms stay: a role that exits
removes its own gauges, and this process removes those of a role it had to kill.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
from collections.abc import Iterable
from typing import Any

from p2pkv.addressing import format_address
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry

__all__ = ["DUMP", "PLUGIN", "DemoMetrics", "metrics_option"]

DUMP = "dump"
PLUGIN = "p2pkv-prometheus"
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def metrics_option(text: str) -> int | str:
    """The argparse type of ``--metrics``: ``dump``, or a TCP port (0 picks a free one)."""
    if text == DUMP:
        return DUMP
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(
            f"expected a port 0..65535 (0 picks a free one) or {DUMP!r}, got {text!r}"
        )
    return port


class DemoMetrics:
    """What ``--metrics`` set up for one run; every method is a no-op when it was not given.

    Use it as a context manager around the run: the server stops and a temporary directory
    goes away on exit."""

    def __init__(self, target: int | str | None, *, host: str, inline: bool) -> None:
        """Prepare before any role starts: check that ``p2pkv-prometheus`` is loaded, choose
        where the roles report and, for a port, start serving ``/metrics`` on ``host``.

        Raises ``ConfigError`` (one line naming the fix) when the plugin is missing or
        disabled, ``PROMETHEUS_MULTIPROC_DIR`` is not a directory, or the port cannot be
        bound."""
        self.dump = target == DUMP
        self.url = ""
        self._directory: str | None = None
        self._temporary = False
        self._server: Any = None
        self._thread: threading.Thread | None = None
        self._registry: Any = None
        if target is None:
            return
        _require_plugin()
        self._registry = self._collect_from(inline)
        if isinstance(target, int):
            self._serve(host, target)

    def _collect_from(self, inline: bool) -> Any:
        """The registry to show: this process's default one, or the role processes' merged
        directory (made the roles' ``PROMETHEUS_MULTIPROC_DIR``; spawned roles inherit it)."""
        from prometheus_client import REGISTRY, CollectorRegistry
        from prometheus_client.multiprocess import MultiProcessCollector

        if inline:
            return REGISTRY
        directory = os.environ.get(MULTIPROC_ENV)
        if directory is None:
            directory = tempfile.mkdtemp(prefix="p2pkv-demo-metrics-")
            self._temporary = True
            os.environ[MULTIPROC_ENV] = directory
        elif not os.path.isdir(directory):
            raise ConfigError(
                f"--metrics: {MULTIPROC_ENV}={directory} is not a directory; "
                "create it or unset the variable"
            )
        self._directory = directory
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=directory)  # type: ignore[no-untyped-call]
        return registry

    def _serve(self, host: str, port: int) -> None:
        from prometheus_client import start_http_server

        try:
            self._server, self._thread = start_http_server(port, addr=host, registry=self._registry)
        except OSError as exc:
            self.close()
            raise ConfigError(
                f"--metrics {port}: cannot serve on "
                f"{format_address(host, port)}: {exc.strerror or exc}; choose "
                "another port (0 picks a free one)"
            ) from None
        bound = self._server.server_address[1]
        self.url = f"http://{format_address(host, bound)}/metrics"

    def forget(self, pids: Iterable[int | None]) -> None:
        """Remove the live gauges of role processes that are gone (a killed role could not
        remove its own); ``None`` stands for a role that ran in this process."""
        if self._directory is None:
            return
        from prometheus_client.multiprocess import mark_process_dead

        for pid in pids:
            if pid is not None:
                mark_process_dead(pid, self._directory)  # type: ignore[no-untyped-call]

    def print_dump(self) -> None:
        """With ``--metrics dump``: the metrics as Prometheus text, on stdout."""
        if not self.dump:
            return
        from prometheus_client import generate_latest

        sys.stdout.write("# p2pkv demo: metrics of the run (Prometheus text format)\n")
        sys.stdout.write(generate_latest(self._registry).decode())
        sys.stdout.flush()

    def close(self) -> None:
        """Stop serving and remove a temporary directory (idempotent)."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
        if self._temporary and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)
            self._temporary = False

    def __enter__(self) -> DemoMetrics:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _require_plugin() -> None:
    registry = default_registry()
    if PLUGIN not in registry.plugins.values():
        raise ConfigError(f"--metrics needs the {PLUGIN} plugin: {registry.install_hint(PLUGIN)}")
