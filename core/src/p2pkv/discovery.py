"""Peers the tier connects to before any request names them: ``peers.connect``.

Under llm-d no router sends p2pkv's ``p2pkv_connect`` hint, so without this every new pair of
pods pays the dial, the hellos and the data-peer setup on a user's request. Each entry of
``peers.connect`` is ``host:port``: an address is dialed as is; a host name is resolved every
``peers.resolve_interval`` seconds (a Kubernetes headless Service answers with one address
per ready pod). The tier's warm set (:mod:`p2pkv.tiering.warm`) keeps sessions to a bounded
number of those addresses, within ``peers.allow``; its own address is skipped.

Threading: names are resolved on a thread of this module (``p2pkv-discovery``), never on
the engine's; the driver thread only takes the latest answer (:meth:`Discovery.due`). A
name that does not resolve keeps its last answer and is logged once until it resolves
again.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Callable, Sequence

from p2pkv.addressing import format_address, parse_address

log = logging.getLogger(__name__)

Resolver = Callable[[str], list[str]]
"""Host name -> its addresses (may raise ``OSError``)."""


def resolve_all(host: str) -> list[str]:
    """Every address ``host`` resolves to (A and AAAA), in the resolver's order."""
    infos = socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


class Discovery:
    """The addresses of ``entries`` to keep sessions to, refreshed every ``interval`` s."""

    def __init__(
        self,
        entries: Sequence[str],
        interval: float,
        own_address: str,
        resolver: Resolver = resolve_all,
    ) -> None:
        self._entries = [parse_address(entry) for entry in entries]
        self._interval = interval
        self._own = own_address
        self._resolver = resolver
        self._lock = threading.Lock()
        self._answers: dict[tuple[str, int], list[str]] = {}
        """(entry host, port) -> the addresses it last resolved to (guarded by _lock)."""
        self._version = 0  # answers changed (guarded by _lock) ...
        self._seen = 0  # ... since the driver last took them
        self._failing: set[str] = set()
        self._stop = threading.Event()
        self._next_due = 0.0
        self._thread = threading.Thread(target=self._run, name="p2pkv-discovery", daemon=True)
        self._thread.start()

    def due(self, now: float) -> list[str]:
        """Driver thread: the addresses to (re)connect to, when an answer changed or once
        per ``interval`` (empty in between)."""
        with self._lock:
            changed = self._version != self._seen
            if not changed and now < self._next_due:
                return []
            self._seen = self._version
            found = [
                format_address(address, port)
                for (_, port), addresses in self._answers.items()
                for address in addresses
            ]
        self._next_due = now + self._interval
        return [address for address in dict.fromkeys(found) if address != self._own]

    def close(self, timeout: float) -> None:
        """Stop resolving; joins the thread for at most ``timeout`` seconds."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        while True:
            for host, port in self._entries:
                self._resolve(host, port)
            if self._stop.wait(self._interval):
                return

    def _resolve(self, host: str, port: int) -> None:
        try:
            found = self._resolver(host)
        except OSError as exc:
            if host not in self._failing:
                self._failing.add(host)
                log.warning(
                    "peers.connect: %s does not resolve (%s); keeping its last "
                    "answer and trying again every %g s",
                    host,
                    exc,
                    self._interval,
                )
            return
        if host in self._failing:
            self._failing.discard(host)
            log.info("peers.connect: %s resolves again", host)
        with self._lock:
            if self._answers.get((host, port)) != found:
                self._answers[(host, port)] = found
                self._version += 1
