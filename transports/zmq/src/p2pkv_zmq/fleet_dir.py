"""A fleet's key directory (``$P2PKV_CURVE_DIR``): read once at start, then re-read when it
changes, so keys rotate without a restart (docs/security.md, "Rotating keys").

Layout: ``server.key_secret`` (the listeners' pair), ``client.key_secret`` (the dialers'
pair), and public keys: every ``*.key`` but ``server.key`` is an allowed client key. A
Kubernetes Secret volume fits: kubelet writes a new version into a fresh directory and swaps
the ``..data`` link to it in one step, and the file names are links through it, so the
directory changes as a whole.

What a change does: the allowed client keys and the dialers' pair are taken from the new
contents (new dials present the new client key; the ZAP handler admits the new set), at most
:data:`RELOAD_INTERVAL` seconds after it is first looked at again. The server pair is kept
for the process's life: its listener is bound with it, and peers dial with its public half (a
changed server pair is logged, and used from the next start). A change that cannot be read
(a missing pair, an unreadable file) keeps the last good keys and is logged once.

Threading: the transport's driver thread (the hub reads the keys there); not thread-safe.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator, Set
from dataclasses import dataclass
from pathlib import Path

from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger

from p2pkv_zmq.key_files import FLEET_CLIENT, FLEET_SERVER, PUBLIC_SUFFIX, SECRET_SUFFIX
from p2pkv_zmq.keys import public_of, read_key, read_key_list
from p2pkv_zmq.options import CURVE_DIR_ENV

__all__ = ["RELOAD_INTERVAL", "AllowedView", "KeySet", "LiveKeys", "read_fleet_dir"]

log = module_logger(__name__)

RELOAD_INTERVAL = 1.0
"""Seconds between two looks at the directory (each a few ``stat`` calls)."""


@dataclass(frozen=True, repr=False)
class KeySet:
    """One reading of the keys: Z85 keys (40 bytes); ``allowed`` holds raw 32-byte keys."""

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes
    allowed: frozenset[bytes]

    def __repr__(self) -> str:  # never print secrets
        return f"KeySet(server_public={self.server_public!r}, allowed={len(self.allowed)})"


def read_fleet_dir(
    directory: Path, client: str = FLEET_CLIENT, *, named: str = CURVE_DIR_ENV
) -> KeySet:
    """The keys of a fleet key directory, dialing with the pair ``client`` (the fleet's, or
    another one of the directory: ``client-next`` during a rotation); ``ConfigError`` naming
    what is missing or unreadable and the fix, the directory called ``named`` (how the user
    gave it: the environment variable, or a command-line option)."""
    _check_readable(directory, named)
    secrets = {}
    for name in (FLEET_SERVER, client):
        path = directory / f"{name}{SECRET_SUFFIX}"
        if not path.is_file():
            raise ConfigError(
                f"{named}: no {path.name} in {directory} (a fleet key "
                "directory holds the server and client pairs `p2pkv keys "
                "--fleet` or `--secret` writes)"
            )
        secrets[name] = read_key(str(path), f"{named}: {path.name}", "secret")
    allowed = [
        str(path)
        for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}"))
        if path.name != f"{FLEET_SERVER}{PUBLIC_SUFFIX}"
    ]
    if not allowed:
        raise ConfigError(
            f"{named}: no client public key (*{PUBLIC_SUFFIX} other than "
            f"{FLEET_SERVER}{PUBLIC_SUFFIX}) in {directory}"
        )
    server, ours = secrets[FLEET_SERVER], secrets[client]
    return KeySet(
        server,
        public_of(server),
        ours,
        public_of(ours),
        read_key_list(tuple(allowed), f"{named}: client keys"),
    )


def _check_readable(directory: Path, named: str) -> None:
    if not directory.is_dir():
        raise ConfigError(
            f"{named}={str(directory)!r} is not a directory: mount the "
            "fleet's key Secret there (`p2pkv keys --secret NAME` writes one)"
        )
    if not os.access(directory, os.R_OK | os.X_OK):
        raise ConfigError(
            f"{named}={str(directory)!r} cannot be listed by this "
            f"process (uid {os.getuid()}): give it read access (a Secret "
            "volume: the pod's securityContext.fsGroup and the volume's "
            "defaultMode 0440)"
        )


class LiveKeys:
    """The keys of a fleet key directory as they are now (see the module docstring);
    ``clock`` is injectable for tests."""

    def __init__(
        self,
        directory: Path,
        *,
        client: str = FLEET_CLIENT,
        clock: Callable[[], float] = time.monotonic,
        named: str = CURVE_DIR_ENV,
    ) -> None:
        self.directory = directory
        self._client = client
        self._clock = clock
        self._named = named
        self._keys = read_fleet_dir(directory, client, named=named)
        self._signature = _signature(directory)
        self._next_look = clock() + RELOAD_INTERVAL
        self._logged: object = None

    def current(self) -> KeySet:
        """The keys now: re-read first if the directory changed since the last look (at most
        one look per :data:`RELOAD_INTERVAL`)."""
        now = self._clock()
        if now >= self._next_look:
            self._next_look = now + RELOAD_INTERVAL
            signature = _signature(self.directory)
            if signature != self._signature:
                self._reload(signature)
        return self._keys

    def _reload(self, signature: object) -> None:
        try:
            fresh = read_fleet_dir(self.directory, self._client, named=self._named)
        except ConfigError as exc:
            if self._logged != signature:
                self._logged = signature
                log.warning(
                    "zmq CURVE keys in %s changed but cannot be read (%s): keeping the "
                    "keys read before",
                    self.directory,
                    exc,
                )
            return
        self._signature = signature
        old = self._keys
        if fresh.server_secret != old.server_secret:
            log.warning(
                "zmq CURVE server key pair in %s changed: this process keeps listening "
                "and dialing with the one it started with (a server pair changes at "
                "restart; docs/security.md, rotating keys)",
                self.directory,
            )
        self._keys = KeySet(
            old.server_secret,
            old.server_public,
            fresh.client_secret,
            fresh.client_public,
            fresh.allowed,
        )
        log.info(
            "zmq CURVE keys re-read from %s: %d allowed client key(s)%s",
            self.directory,
            len(fresh.allowed),
            ", new client key pair" if fresh.client_secret != old.client_secret else "",
        )


class AllowedView(Set[bytes]):
    """The allowed client keys of a :class:`LiveKeys` as they are at each lookup."""

    def __init__(self, keys: Callable[[], KeySet]) -> None:
        self._keys = keys

    def __contains__(self, key: object) -> bool:
        return key in self._keys().allowed

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._keys().allowed)

    def __len__(self) -> int:
        return len(self._keys().allowed)


def _signature(directory: Path) -> object:
    """What changes when a file of ``directory`` does (names, and each target's identity,
    size and time, links followed); None if it cannot be listed."""
    try:
        names = sorted(os.listdir(directory))
    except OSError:
        return None
    entries = []
    for name in names:
        try:
            st = os.stat(directory / name)
        except OSError:
            continue
        entries.append((name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(entries)
