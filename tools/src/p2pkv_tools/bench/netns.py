"""Two network namespaces joined by a veth pair: the link of ``p2pkv bench --tier --netns``.

:func:`open_link` creates, for one run, namespace ``p2pkv-bench-<pid>-a`` (the *source* end:
the producer tier, the raw baseline's target) and ``p2pkv-bench-<pid>-b`` (the *reader* end:
the consumer tier, the raw baseline's initiator), a veth pair between them addressed
``10.77.0.1/30`` and ``10.77.0.2/30`` (private to the two namespaces: nothing touches the
host's own network, and a parallel run's link cannot collide with it), optionally shaped to
one rate in both directions with ``tc`` (``tbf``; ``htb`` on a kernel without it). On leaving
the block, also through an exception, Ctrl-C or SIGTERM, it deletes the namespaces it created
(their veth ends and qdiscs go with them), never any other.

A spawned bench process joins its end with :func:`enter` before anything else runs in it
(:class:`~p2pkv_tools.bench.harness.Helper` does this when given a ``placement``): the network
namespace (:func:`join_namespace`, which the chaos suite's nodes use too), then, in a private
mount namespace, a fresh sysfs on ``/sys`` so that
``/sys/class/net`` (where UCX looks for ``UCX_NET_DEVICES``) lists that namespace's devices;
then its environment: ``UCX_TLS=tcp`` and ``UCX_NET_DEVICES=<its veth end>``, so UCX carries
the data over TCP and the nixl transport takes its staged lane, as between hosts without RDMA.
The parent process stays where it is; it talks to its children over pipes, which namespaces
do not affect.

Needs root and iproute2 (``ip``; ``tc`` to shape): :func:`check_tools`, and every command that
fails while the link is built, raise :class:`NetnsUnavailable`, a ``ConfigError`` whose one-line
message names what failed.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger

__all__ = [
    "PREFIX",
    "Link",
    "NetnsUnavailable",
    "Placement",
    "Traffic",
    "check_tools",
    "enter",
    "format_rate",
    "join_namespace",
    "open_link",
    "parse_rate",
]

log = module_logger(__name__)

PREFIX = "p2pkv-bench-"
"""Every namespace :func:`open_link` creates is named ``PREFIX<pid>-a`` / ``-b``."""
_NEEDS = "--netns needs root and iproute2 (ip, tc)"
_ADDRESSES = ("10.77.0.1", "10.77.0.2")
_PREFIX_LEN = 30
_MTU = 1500
"""Ethernet's default, as between hosts without jumbo frames."""
_CMD_TIMEOUT = 20.0
_UP_TIMEOUT = 20.0
_MIN_BURST = 128 * 1024
"""tbf/htb bucket floor in bytes: above one GSO packet (64 KiB), which a veth passes whole."""
_QUEUE_LATENCY = "20ms"
_CLONE_NEWNET = 0x40000000
_CLONE_NEWNS = 0x00020000
_MS_REC = 0x4000
_MS_SLAVE = 0x80000
_MNT_DETACH = 2
_RATE = re.compile(r"(\d+(?:\.\d+)?)([kmgt]?)(bit|bps)")
_SCALE = {"": 1, "k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}


class NetnsUnavailable(ConfigError):
    """The link cannot be built here; the message is ``--netns needs root and iproute2
    (ip, tc): <what failed>``."""

    def __init__(self, what: str) -> None:
        super().__init__(f"{_NEEDS}: {what}")


@dataclass(frozen=True)
class Placement:
    """One end of the link, where a spawned process lives (picklable: it crosses to it)."""

    netns: str
    device: str
    address: str
    env: Mapping[str, str] = field(default_factory=dict)
    """Set in the process right after it joined ``netns``, before any library reads it."""


@dataclass(frozen=True)
class Link:
    """The two ends and how the link is shaped (``rate_bits`` per second each way, by
    ``qdisc``; both None when unshaped)."""

    source: Placement
    reader: Placement
    rate_bits: int | None = None
    qdisc: str | None = None

    def sent_bytes(self) -> int | None:
        """Bytes the source end has sent so far (producer -> consumer: every read's payload
        and the producer's control frames); None when ``ip`` cannot tell."""
        done = _run(
            "ip", "-n", self.source.netns, "-s", "-j", "link", "show", "dev", self.source.device
        )
        try:
            return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])
        except (ValueError, LookupError, TypeError):
            return None

    def describe(self) -> dict[str, Any]:
        """The link as the report's JSON states it."""
        ends = {"producer": self.source, "consumer": self.reader}
        return {
            "kind": "netns",
            "namespaces": {k: e.netns for k, e in ends.items()},
            "veth": {k: e.device for k, e in ends.items()},
            "addresses": {k: f"{e.address}/{_PREFIX_LEN}" for k, e in ends.items()},
            "rate": format_rate(self.rate_bits) if self.rate_bits else None,
            "rate_bits_per_s": self.rate_bits,
            "qdisc": self.qdisc,
            "mtu": _MTU,
            "env": {k: dict(e.env) for k, e in ends.items()},
        }


class Traffic:
    """What a link carried from its source end, per phase of a run (``phases``: name ->
    bytes, None when unreadable); records nothing without a link. Driver-thread only."""

    def __init__(self, link: Link | None) -> None:
        self._link = link
        self.phases: dict[str, int | None] = {}

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count the bytes sent while the block runs (a block that raises is not counted).
        A phase entered again adds to its count (a phase that runs in turns, e.g. one tier
        of several taking turns); once unreadable, it stays None."""
        if self._link is None:
            yield
            return
        before = self._link.sent_bytes()
        yield
        after = self._link.sent_bytes()
        sent = None if before is None or after is None else after - before
        so_far = self.phases.get(name, 0)
        self.phases[name] = None if sent is None or so_far is None else so_far + sent


def parse_rate(text: str) -> int:
    """A ``tc`` rate (``25gbit``, ``800mbit``, ``1.5gbps``: ``bit`` counts bits, ``bps``
    bytes, ``k``/``m``/``g``/``t`` are powers of 1000) in bits per second. ``ValueError``
    naming the text and examples when it is not one, or not above 0."""
    match = _RATE.fullmatch(text.strip().lower())
    if match is None:
        raise ValueError(f"not a tc rate: {text!r} (examples: 25gbit, 800mbit, 1.5gbps)")
    number, scale, unit = match.groups()
    bits = round(float(number) * _SCALE[scale] * (8 if unit == "bps" else 1))
    if bits <= 0:
        raise ValueError(f"a rate must be above 0: {text!r} (examples: 25gbit, 800mbit)")
    return bits


def format_rate(bits: int) -> str:
    """Bits per second as ``tc`` writes rates (``25gbit``, ``1500mbit``, ``64kbit``)."""
    for unit, scale in (("t", 10**12), ("g", 10**9), ("m", 10**6), ("k", 10**3)):
        if bits % scale == 0:
            return f"{bits // scale}{unit}bit"
    return f"{bits}bit"


def check_tools(shaped: bool) -> None:
    """``NetnsUnavailable`` when this process is not root, ``ip`` is missing, or ``shaped``
    and ``tc`` is."""
    if os.geteuid() != 0:
        raise NetnsUnavailable(f"this process runs as uid {os.geteuid()}, not root")
    for tool in ("ip", *(("tc",) if shaped else ())):
        if shutil.which(tool) is None:
            raise NetnsUnavailable(f"`{tool}` is not on PATH (install iproute2)")


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(cmd, 1, "", str(exc))


def _must(*cmd: str) -> None:
    done = _run(*cmd)
    if done.returncode:
        raise NetnsUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


class _Namespaces:
    """The namespaces this run created, so that exactly those are deleted."""

    def __init__(self) -> None:
        self.created: list[str] = []

    def add(self, name: str) -> None:
        _must("ip", "netns", "add", name)
        self.created.append(name)

    def remove(self) -> None:
        """Delete every namespace created (idempotent); a failure is logged with the
        command that removes it by hand, and the others are still deleted."""
        while self.created:
            name = self.created.pop()
            done = _run("ip", "netns", "del", name)
            if done.returncode:
                log.warning(
                    "could not remove network namespace %s (%s): run `ip netns del %s`",
                    name,
                    done.stderr.strip(),
                    name,
                )


def _ends(tag: str) -> tuple[Placement, Placement]:
    ends = []
    for side, address in zip("ab", _ADDRESSES, strict=True):
        device = f"pkb{tag}{side}"[:15]  # IFNAMSIZ
        ends.append(
            Placement(
                f"{PREFIX}{tag}-{side}",
                device,
                address,
                {"UCX_TLS": "tcp", "UCX_NET_DEVICES": device},
            )
        )
    return ends[0], ends[1]


def _shape(end: Placement, bits: int) -> str:
    """Limit ``end``'s egress to ``bits``/s: ``tbf``, else ``htb`` when the kernel has no
    tbf; the qdisc used."""
    burst = str(max(bits // 8 // 1000, _MIN_BURST))  # a millisecond of traffic
    rate = f"{bits}bit"
    dev = ("tc", "-n", end.netns)
    done = _run(
        *dev,
        "qdisc",
        "add",
        "dev",
        end.device,
        "root",
        "tbf",
        "rate",
        rate,
        "burst",
        burst,
        "latency",
        _QUEUE_LATENCY,
    )
    if not done.returncode:
        return "tbf"
    if "unknown" not in done.stderr.lower():
        raise NetnsUnavailable(f"tc tbf on {end.device} failed: {done.stderr.strip()}")
    _must(*dev, "qdisc", "add", "dev", end.device, "root", "handle", "1:", "htb", "default", "1")
    _must(
        *dev,
        "class",
        "add",
        "dev",
        end.device,
        "parent",
        "1:",
        "classid",
        "1:1",
        "htb",
        "rate",
        rate,
        "ceil",
        rate,
        "burst",
        burst,
        "cburst",
        burst,
    )
    return "htb"


def _state(end: Placement) -> str | None:
    """What keeps ``end`` from carrying traffic, or None when it is up with its address."""
    link = _run("ip", "-n", end.netns, "-o", "link", "show", "dev", end.device).stdout
    if "state UP" not in link or "LOWER_UP" not in link:
        return f"{end.netns}/{end.device}: {link.strip() or 'missing'}"
    addr = _run("ip", "-n", end.netns, "-o", "-4", "addr", "show", "dev", end.device).stdout
    if f"inet {end.address}/" not in addr:
        return f"{end.netns}/{end.device} has no address {end.address}"
    return None


def _wait_up(ends: tuple[Placement, ...]) -> None:
    """Return once every end is up with its address; ``NetnsUnavailable`` after
    ``_UP_TIMEOUT`` seconds naming what was not."""
    deadline = time.monotonic() + _UP_TIMEOUT
    pause = threading.Event()  # never set: a bounded pause between polls
    while True:
        problems = [p for p in map(_state, ends) if p]
        if not problems:
            return
        if time.monotonic() > deadline:
            raise NetnsUnavailable(
                f"the veth link is not up after {_UP_TIMEOUT:.0f} s: {problems[0]}"
            )
        pause.wait(0.01)


def _build(spaces: _Namespaces, rate_bits: int | None) -> Link:
    """Namespaces, the veth pair, addresses, qdiscs, links up; the link once usable."""
    source, reader = _ends(str(os.getpid()))
    for end in (source, reader):
        spaces.add(end.netns)
    _must(
        "ip",
        "link",
        "add",
        source.device,
        "mtu",
        str(_MTU),
        "netns",
        source.netns,
        "type",
        "veth",
        "peer",
        "name",
        reader.device,
        "mtu",
        str(_MTU),
        "netns",
        reader.netns,
    )
    qdisc = None
    for end in (source, reader):
        _must(
            "ip", "-n", end.netns, "addr", "add", f"{end.address}/{_PREFIX_LEN}", "dev", end.device
        )
        _must("ip", "-n", end.netns, "link", "set", "lo", "up")
        if rate_bits:  # before the link is up: a replaced root qdisc would bounce it
            qdisc = _shape(end, rate_bits)
        _must("ip", "-n", end.netns, "link", "set", end.device, "up")
    _wait_up((source, reader))
    return Link(source, reader, rate_bits, qdisc)


@contextmanager
def _sigterm_exits() -> Iterator[None]:
    """Within the block, SIGTERM raises ``SystemExit`` (so ``finally`` clauses run), when
    called from the main thread; elsewhere, nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)

    previous: Callable[..., Any] | int | None = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextmanager
def open_link(rate_bits: int | None = None) -> Iterator[Link]:
    """The link (see the module docstring), shaped to ``rate_bits``/s each way if given,
    removed on leaving the block however it is left. ``NetnsUnavailable`` (after removing
    what was already created) when it cannot be built."""
    check_tools(shaped=bool(rate_bits))
    spaces = _Namespaces()
    with _sigterm_exits():
        try:
            yield _build(spaces, rate_bits)
        finally:
            spaces.remove()


def join_namespace(name: str) -> None:
    """Move this process into network namespace ``name`` (``/run/netns/<name>``) the way
    ``ip netns exec`` does: join it, then, in a private mount namespace, mount a fresh sysfs
    on ``/sys`` so that ``/sys/class/net`` (where UCX finds its devices) lists that
    namespace's interfaces. Call it before any thread or socket exists (threads created later
    inherit it). Raises ``OSError`` naming the step that failed and the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what} (network namespace {name}): {os.strerror(err)}")

    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        check(libc.setns(fd, _CLONE_NEWNET), "setns")
    finally:
        os.close(fd)
    check(libc.unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    check(libc.mount(b"none", b"/", None, _MS_REC | _MS_SLAVE, None), "mount --make-rslave /")
    check(libc.umount2(b"/sys", _MNT_DETACH), "umount /sys")
    check(libc.mount(b"sysfs", b"/sys", b"sysfs", 0, None), "mount sysfs on /sys")


def enter(placement: Placement) -> None:
    """Move this process into ``placement`` (see the module docstring): its network
    namespace (:func:`join_namespace`), then its environment. Call it first thing in a fresh
    process, before any thread or socket exists. Raises ``OSError`` naming the step that
    failed."""
    join_namespace(placement.netns)
    os.environ.update(placement.env)
