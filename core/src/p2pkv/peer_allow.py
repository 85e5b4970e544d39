"""``peers.allow``: the peers a request may make the tier dial, parsed, checked and matched.

An entry is a network (``10.0.0.0/8``, ``fd00::/8``), an address (``10.1.2.3``, a /32), or a
host name. A peer named by an IP address is allowed when the address is in one of the
networks; a peer named by a host name when the same name (case-insensitive) is listed. The
list never resolves names: matching costs the engine thread nothing.

Entries that could never match the peer a router names are refused at start, and by
``p2pkv check-config``, with the fix (:func:`parse_allow_list`):

- ``*`` (or ``any``, ``all``): an empty list already allows any peer;
- a range ``10.0.0.0-10.0.0.255`` or a wildcard ``10.0.0.*``: written as the networks that
  cover it (``10.0.0.0/24``);
- a Kubernetes Service's DNS name (a label ``svc``: ``ms-p2p.llm-d.svc.cluster.local``):
  routers name pods by their IP, never by a Service's name; allow the pods' network. Its
  short forms (``ms-p2p``, ``ms-p2p.llm-d``) too, when ``peers.connect`` names that Service
  (:func:`service_allowed`): a short name alone cannot be told from a host's;
- a ``$(VAR)`` Kubernetes left unexpanded (``VAR`` defined below the variable using it);
- several entries separated by spaces or semicolons: the list is comma-separated;
- anything with a port or a scheme.

A plain host name stays allowed: it matches requests that name that host (p2pkv's own proxy
may name peers so), never a pod IP.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from p2pkv.errors import ConfigError

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_ANY = frozenset({"*", "any", "all", "*.*.*.*"})
_SERVICE_LABEL = "svc"
SERVICE_NEVER_MATCHES = (
    "which never matches: routers name pods by their IP; give the pods' network (the "
    "cluster's pod CIDR, e.g. 10.0.0.0/8)"
)
"""Why an allow-list entry naming a Service (or its short form) is refused, and the fix."""
_HOST_NAME = re.compile(r"^[A-Za-z0-9_]([A-Za-z0-9_.-]*[A-Za-z0-9_.])?$")


@dataclass(frozen=True)
class PeerAllowList:
    """A parsed ``peers.allow``; empty: any peer."""

    networks: tuple[Network, ...] = ()
    names: frozenset[str] = frozenset()

    @property
    def open(self) -> bool:
        """True when the list is empty: every peer is allowed."""
        return not self.networks and not self.names

    def allows(self, host: str) -> bool:
        """Whether a peer named ``host`` (an IP literal or a name) may be dialed."""
        if self.open:
            return True
        try:
            address = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            return host.lower() in self.names
        return any(address in network for network in self.networks)


def parse_allow_list(entries: Sequence[str], variable: str | None = None) -> PeerAllowList:
    """``entries`` as a :class:`PeerAllowList`. ``ConfigError`` for the first entry that is
    malformed or could never match, naming it and the fix: as the environment ``variable``'s
    entry when the list came from one (``P2PKV_PEERS_ALLOW``), else as the tier config key
    ``peers.allow[i]``."""
    networks: list[Network] = []
    names: set[str] = set()
    for i, entry in enumerate(entries):
        text = entry.strip().strip("[]")
        try:
            networks.append(ipaddress.ip_network(text, strict=False))
            continue
        except ValueError:
            pass
        problem = _never_matches(text)
        if problem:
            where = (
                f"{variable} entry {entry!r}"
                if variable is not None
                else f"tier config key peers.allow[{i}] = {entry!r}"
            )
            raise ConfigError(f"{where} {problem}")
        names.add(text.lower().rstrip("."))
    return PeerAllowList(tuple(networks), frozenset(names))


def service_allowed(entries: Sequence[str], hosts: Iterable[str]) -> tuple[int, str] | None:
    """The first of ``entries`` (``peers.allow``) that is a short form (``name`` or
    ``name.namespace``) of one of ``hosts`` that is a Kubernetes Service's DNS name, as
    (its index, that host); else None. Pre-connect (``peers.connect``) dials such a Service
    and reaches its pods; requests name those pods by IP, so the short name never matches."""
    short: dict[str, str] = {}
    for host in hosts:
        labels = host.lower().rstrip(".").split(".")
        if _SERVICE_LABEL in labels:
            short.setdefault(labels[0], host)
            short.setdefault(".".join(labels[:2]), host)
    for i, entry in enumerate(entries):
        service = short.get(entry.strip().lower().rstrip("."))
        if service is not None:
            return i, service
    return None


def _never_matches(text: str) -> str:
    """Why the entry ``text`` (not a network) can never match a peer, with the fix; ""
    when it is a usable host name."""
    if text.lower() in _ANY:
        return (
            "would allow nothing, not everything: leave peers.allow empty (unset) to "
            "allow any peer, or give the pods' network (10.0.0.0/8)"
        )
    cover = _range_cover(text)
    if cover is not None:
        return (
            f"is a range, which never matches a peer's address: write it as "
            f"{', '.join(map(str, cover))}"
        )
    if "$(" in text:
        return (
            "holds a $(VAR) reference Kubernetes did not expand: define VAR above this "
            "variable in the container's env list (only earlier ones expand)"
        )
    if not _HOST_NAME.match(text):
        parts = re.split(r"[\s;]+", text)
        return (
            f"holds {len(parts)} entries: separate them with commas ({','.join(parts)})"
            if len(parts) > 1
            else "is neither a network (10.0.0.0/8), an address nor a "
            "host name (no port, no scheme)"
        )
    if _SERVICE_LABEL in text.lower().rstrip(".").split("."):
        return f"is a Kubernetes Service's name, {SERVICE_NEVER_MATCHES}"
    return ""


def _range_cover(text: str) -> list[Network] | None:
    """The networks covering ``a-b`` (or ``a.b.c.*``), or None if ``text`` is neither."""
    if text.count("*") and "." in text:
        parts = text.split(".")
        fixed = [p for p in parts if p != "*"]
        if len(parts) == 4 and parts[len(fixed) :] == ["*"] * (4 - len(fixed)):
            text = (
                ".".join(fixed + ["0"] * (4 - len(fixed)))
                + "-"
                + ".".join(fixed + ["255"] * (4 - len(fixed)))
            )
    first, dash, last = text.partition("-")
    if not dash:
        return None
    try:
        low, high = ipaddress.ip_address(first.strip()), ipaddress.ip_address(last.strip())
        return list(ipaddress.summarize_address_range(low, high))
    except (ValueError, TypeError):
        return None
