"""What a benchmark or a bug report must say about the host: CPU, libraries, UCX settings."""

from __future__ import annotations

import os
import platform
from collections.abc import Iterator
from contextlib import contextmanager
from importlib import metadata
from typing import Any

__all__ = ["RELEVANT_ENV", "describe_host", "environ_restored", "library_versions"]

RELEVANT_ENV = (
    "UCX_TLS",
    "UCX_NET_DEVICES",
    "UCX_PROTO_INFO",
    "UCX_LOG_LEVEL",
    "UCX_RNDV_THRESH",
    "UCX_RCACHE_MAX_UNRELEASED",
    "UCX_MEMTYPE_CACHE",
    "UCX_WARN_UNUSED_ENV_VARS",
    "NIXL_PLUGIN_DIR",
    "P2PKV_HOST",
    "P2PKV_PORT",
    "VLLM_P2P_SIDE_CHANNEL_HOST",
    "VLLM_P2P_SIDE_CHANNEL_PORT",
    "P2PKV_DISABLE_PLUGINS",
    "P2PKV_TEST_PLUGINS",
    "P2PKV_TRACE_HOOKS",
)
"""Environment variables that change which lane, port or plugins p2pkv uses (under vLLM the
``VLLM_P2P_SIDE_CHANNEL_*`` ones beat ``P2PKV_HOST``/``P2PKV_PORT``)."""

_LIBRARIES = (
    "p2pkv",
    "nixl",
    "nixl-cu12",
    "nixl-cu13",
    "ucxx-cu12",
    "libucxx-cu12",
    "libucx-cu12",
    "pyzmq",
    "msgpack",
    "numpy",
    "pluggy",
    "rich",
    "matplotlib",
)


def library_versions() -> dict[str, str]:
    """Installed versions of the libraries p2pkv's speed and behaviour depend on."""
    found = {}
    for dist in _LIBRARIES:
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return found


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _memory_gib() -> float | None:
    try:
        pages = os.sysconf("SC_PHYS_PAGES")
        return round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1)
    except (ValueError, OSError, AttributeError):
        return None


def describe_host() -> dict[str, Any]:
    """Host facts for a benchmark's header and JSON."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "memory_gib": _memory_gib(),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "libraries": library_versions(),
        "env": {k: os.environ[k] for k in RELEVANT_ENV if k in os.environ},
    }


@contextmanager
def environ_restored() -> Iterator[None]:
    """Undo whatever the block does to ``os.environ``.

    ``availability()`` may import a transport's library, and some set variables on import
    (ucxx sets ``UCX_RNDV_FRAG_MEM_TYPE=cuda``, ``UCX_RNDV_THRESH`` and more): left in
    ``os.environ`` they leak into every process spawned afterwards and change how *another*
    library's UCX (NIXL's) picks its protocols — here, a 30-100x slowdown."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        if os.environ != saved:
            os.environ.clear()
            os.environ.update(saved)
