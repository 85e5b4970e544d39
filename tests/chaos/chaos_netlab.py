"""Two test "hosts": network namespaces joined by a veth pair, created and removed by the test.

Everything lives inside the two namespaces (the veth ends, their addresses ``10.123.N.1`` and
``10.123.N.2``, the qdiscs), so nothing touches the machine's own network. Nodes enter a
namespace with ``chaos_node.enter_netns``. ``cut()`` takes host A's link down (both sides go
silent: no FIN, no RST, exactly like a pulled cable), ``restore()`` brings it back,
``shape()`` adds ``tc netem`` delay and loss on both ends and ``limit_rate()`` a ``tc tbf``
bandwidth limit.

Every call that changes a link (creation, ``restore()``, a qdisc) returns only once both ends
are usable again: operstate ``up`` with a carrier, the address in place, and the other end
answering a TCP dial (a refusal counts as an answer). Replacing a root qdisc briefly takes a
veth out of service, and UCX refuses a device in that state ("network device ... is not
available"); a node started inside that window would fail for no fault of the code under test.
"""

from __future__ import annotations

import itertools
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass

from p2pkv.testing.waiting import WaitTimeout, wait_until

__all__ = ["NetLab", "NetLabUnavailable", "netlab_problem"]

_SEQ = itertools.count()
_CMD_TIMEOUT = 20.0
_USABLE_TIMEOUT = 20.0
"""How long a changed link may take to carry traffic again before the test fails."""
_DIAL_PROBE = (
    "import errno, socket, sys\n"
    "s = socket.socket(); s.settimeout(0.5)\n"
    "code = s.connect_ex((sys.argv[1], 9))\n"
    "sys.exit(0 if code in (0, errno.ECONNREFUSED) else 1)\n"
)
"""Dial the discard port: connected or refused means the far end answered."""


class NetLabUnavailable(RuntimeError):
    """This machine cannot create network namespaces (the reason says why)."""


def netlab_problem() -> str | None:
    """Why namespaces cannot be used here, or None."""
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CI runs the chaos suite as root)"
    return None


def _ip(*args: str, netns: str | None = None) -> None:
    cmd = ["ip", *(("-n", netns) if netns else ()), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
    if done.returncode:
        raise NetLabUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")


def _out(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT).stdout


@dataclass
class NetLab:
    """Hosts ``a`` and ``b`` (namespace names) with addresses ``addr_a`` / ``addr_b``."""

    a: str
    b: str
    dev_a: str
    dev_b: str
    addr_a: str
    addr_b: str
    _created: bool = False

    def host(self, side: str) -> tuple[str, str, str]:
        """Host ``side`` ("a" or "b"): its namespace, its end of the link, its address."""
        if side == "a":
            return self.a, self.dev_a, self.addr_a
        return self.b, self.dev_b, self.addr_b

    @classmethod
    def create(cls) -> NetLab:
        n = next(_SEQ)
        tag = f"{os.getpid() % 100000}x{n}"
        subnet = f"10.123.{(os.getpid() + n) % 250}"
        lab = cls(
            a=f"p2pkv-chaos-{tag}a",
            b=f"p2pkv-chaos-{tag}b",
            dev_a=f"pkv{tag}a"[:15],
            dev_b=f"pkv{tag}b"[:15],
            addr_a=f"{subnet}.1",
            addr_b=f"{subnet}.2",
        )
        try:
            lab._up()
        except BaseException:
            lab.remove()
            raise
        return lab

    def _up(self) -> None:
        self._created = True
        _ip("netns", "add", self.a)
        _ip("netns", "add", self.b)
        _ip(
            "link",
            "add",
            self.dev_a,
            "netns",
            self.a,
            "type",
            "veth",
            "peer",
            "name",
            self.dev_b,
            "netns",
            self.b,
        )
        for ns, dev, addr in ((self.a, self.dev_a, self.addr_a), (self.b, self.dev_b, self.addr_b)):
            _ip("addr", "add", f"{addr}/24", "dev", dev, netns=ns)
            _ip("link", "set", "lo", "up", netns=ns)
            _ip("link", "set", dev, "up", netns=ns)
        self.wait_usable()

    def cut(self) -> None:
        """Pull the cable: host A's end goes down (nothing is sent, nothing arrives)."""
        _ip("link", "set", self.dev_a, "down", netns=self.a)

    def restore(self) -> None:
        """Plug it back in (addresses survive a link going down; the route comes back)."""
        _ip("link", "set", self.dev_a, "up", netns=self.a)
        self.wait_usable()

    def shape(self, delay_ms: float, loss_pct: float) -> None:
        """``tc netem`` on both ends: every packet delayed ``delay_ms``, ``loss_pct`` % lost,
        in each direction. ``NetLabUnavailable`` if the kernel has no netem."""
        self._qdisc("netem", "delay", f"{delay_ms}ms", "loss", f"{loss_pct}%")

    def limit_rate(self, mbit: float) -> None:
        """``tc tbf`` on both ends: each direction carries at most ``mbit`` Mbit/s (packets
        queue, then drop, beyond it)."""
        self._qdisc("tbf", "rate", f"{mbit}mbit", "burst", "32kbit", "latency", "400ms")

    def _qdisc(self, *spec: str) -> None:
        for ns, dev in ((self.a, self.dev_a), (self.b, self.dev_b)):
            cmd = ["ip", "netns", "exec", ns, "tc", "qdisc", "replace", "dev", dev, "root", *spec]
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=_CMD_TIMEOUT)
            if done.returncode:
                raise NetLabUnavailable(f"`{' '.join(cmd)}` failed: {done.stderr.strip()}")
        self.wait_usable()

    def wait_usable(self, timeout: float = _USABLE_TIMEOUT) -> None:
        """Return once both ends carry traffic (see the module docstring); ``AssertionError``
        naming what was still wrong after ``timeout`` seconds."""
        problem: list[str | None] = [None]

        def usable() -> bool:
            problem[0] = self._unusable()
            return problem[0] is None

        try:
            wait_until(usable, timeout=timeout, what="both ends of the test link to carry traffic")
        except WaitTimeout as exc:
            raise AssertionError(f"{exc}; still: {problem[0]}") from None

    def _unusable(self) -> str | None:
        ends = (
            (self.a, self.dev_a, self.addr_a, self.addr_b),
            (self.b, self.dev_b, self.addr_b, self.addr_a),
        )
        for ns, dev, addr, other in ends:
            link = _out("ip", "-n", ns, "-o", "link", "show", "dev", dev)
            if "state UP" not in link or "LOWER_UP" not in link:
                return f"{ns}/{dev}: {link.strip() or 'missing'}"
            if f"inet {addr}/" not in _out("ip", "-n", ns, "-o", "-4", "addr", "show", "dev", dev):
                return f"{ns}/{dev} has no address {addr} yet"
            probe = subprocess.run(
                ["ip", "netns", "exec", ns, sys.executable, "-c", _DIAL_PROBE, other],
                capture_output=True,
                timeout=_CMD_TIMEOUT,
            )
            if probe.returncode:
                return f"{other} does not answer from {ns}"
        return None

    def remove(self) -> None:
        """Delete both namespaces (their veth ends and qdiscs go with them); idempotent."""
        if not self._created:
            return
        self._created = False
        for ns in (self.a, self.b):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=_CMD_TIMEOUT)
