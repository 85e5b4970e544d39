"""Where a peer is, and whether UCX's ``cma`` lane can carry our reads from it.

A NIXL READ over ``cma`` is executed by the *reading* process itself (``process_vm_readv``
inside our own UCX progress): releasing its handle stops it and no byte of it can land later,
so such reads may go straight into the caller's slots. Over any other lane (``tcp`` across or
within hosts, RDMA) the bytes keep arriving after the handle is released, and reads go
through the transport's staging pool instead (see :mod:`p2pkv_nixl.staging`).

UCX picks ``cma`` for a same-host peer only when both processes have it: ``UCX_TLS`` leaves
it enabled and the kernel lets the process use it (UCX's own checks: a
``process_vm_writev`` self-test and Yama's ``ptrace_scope``). :func:`cma_usable` repeats
those checks, conservatively; :func:`host_id` names the host *and* PID namespace (``cma``
addresses processes by pid, so two containers on one kernel are not "the same host" for it).
Both values travel in our descriptor, and the reading side decides per peer.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["Iovec", "cma_usable", "host_id", "process_vm_call", "tls_allows_cma"]

_CMA_NAMES = frozenset({"all", "cma", "sm", "shm"})
"""``UCX_TLS`` entries that enable ``cma``: itself, the shared-memory aliases, ``all``."""

_CAP_SYS_PTRACE = 19


def host_id() -> str:
    """``boot_id/hostname/pid-namespace`` of this process; ``""`` when the boot id or the
    PID namespace cannot be read (then no peer ever counts as local)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as f:
            boot = f.read().strip()
        pid_ns = os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""
    if not boot:
        return ""
    return f"{boot}/{socket.gethostname()}/{pid_ns}"


def tls_allows_cma(tls: str | None) -> bool:
    """Whether a ``UCX_TLS`` value leaves ``cma`` enabled: unset or empty (UCX's default
    ``all``), a list naming ``cma``/``sm``/``shm``/``all``, or an exclusion list (``^...``)
    naming none of them. Entries may carry a ``:aux``-style suffix; case is ignored."""
    if tls is None or not tls.strip():
        return True
    text = tls.strip().lower()
    negated = text.startswith("^")
    names = {entry.split(":", 1)[0].strip() for entry in text.lstrip("^").split(",")}
    return not (names & _CMA_NAMES) if negated else bool(names & _CMA_NAMES)


def cma_usable(environ: Mapping[str, str] | None = None) -> bool:
    """Whether UCX in a process with ``environ`` (``os.environ`` by default) will have its
    ``cma`` transport: ``UCX_TLS`` allows it and the kernel does (:func:`_kernel_allows_cma`)."""
    env = os.environ if environ is None else environ
    return tls_allows_cma(env.get("UCX_TLS")) and _kernel_allows_cma()


@functools.lru_cache(maxsize=1)
def _kernel_allows_cma() -> bool:
    """UCX's own gate for ``cma``, checked the same way: ``process_vm_writev`` works here (a
    seccomp profile may forbid it) and Yama's ``ptrace_scope`` is 0, 1 (UCX then calls
    ``PR_SET_PTRACER_ANY``), or 2 with ``CAP_SYS_PTRACE``."""
    return _vm_writev_works() and _ptrace_scope_allows()


class Iovec(ctypes.Structure):
    """``struct iovec`` of the ``process_vm_*`` calls."""

    _fields_ = [("base", ctypes.c_void_p), ("len", ctypes.c_size_t)]


def process_vm_call(name: str) -> Any:
    """libc's ``process_vm_readv`` or ``process_vm_writev`` with its signature set, or None
    where libc lacks it."""
    try:
        call = getattr(ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True), name)
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_ssize_t
    call.argtypes = [
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_void_p,
        ctypes.c_ulong,
        ctypes.c_ulong,
    ]
    return call


def _vm_writev_works() -> bool:
    """Eight bytes copied from ourselves to ourselves with ``process_vm_writev``."""
    writev = process_vm_call("process_vm_writev")
    if writev is None:
        return False
    src, dst = ctypes.c_uint64(0x5A5A), ctypes.c_uint64(0)
    local = Iovec(ctypes.cast(ctypes.pointer(src), ctypes.c_void_p), 8)
    remote = Iovec(ctypes.cast(ctypes.pointer(dst), ctypes.c_void_p), 8)
    moved = writev(os.getpid(), ctypes.byref(local), 1, ctypes.byref(remote), 1, 0)
    return bool(moved == 8 and dst.value == src.value)


def _ptrace_scope_allows() -> bool:
    try:
        with open("/proc/sys/kernel/yama/ptrace_scope", encoding="ascii") as f:
            scope = f.read().strip()
    except OSError:
        return True  # no Yama: no restriction beyond the same user
    if scope in ("0", "1"):
        return True
    return scope == "2" and _has_cap_sys_ptrace()


def _has_cap_sys_ptrace() -> bool:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_PTRACE & 1)
    except (OSError, ValueError, IndexError):
        pass
    return False
