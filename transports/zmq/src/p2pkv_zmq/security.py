"""Who may talk to us: CURVE keys from the options, and the fail-closed bind policy.

Policy (checked before any socket exists):

- any CURVE option given: ``server_secret_key``, ``client_secret_key`` and
  ``allowed_client_keys`` are all required, and ``insecure`` must not be set;
- else ``$P2PKV_CURVE_DIR`` set: the fleet's keys from that directory (a mounted Kubernetes
  ``Secret``, which ``p2pkv keys --secret`` writes): ``server.key_secret`` (the listeners'
  pair), ``client.key_secret`` (the dialers' pair), and every ``*.key`` but ``server.key``
  as the allowed client keys (``client.key``, plus any per-instance ones added beside it).
  Identical replicas then share one Secret and the tier entry names no path. ``insecure``
  must not be set with it;
- no keys and a non-loopback ``host`` (wildcards, interface addresses, host names): refused
  unless ``insecure: true``, which is logged as a warning at every start.

Trust model: every peer of a cluster listens with the same server key pair (the listeners'
identity) and dials with a client key pair; a listener accepts only clients whose public key
is on its allow-list. Traffic is encrypted both ways.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Set
from pathlib import Path

from p2pkv.addressing import is_loopback_host
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger

from p2pkv_zmq.fleet_dir import AllowedView, KeySet, LiveKeys
from p2pkv_zmq.key_files import FLEET_CLIENT, FLEET_SERVER
from p2pkv_zmq.options import CURVE_DIR_ENV, ZmqOptions

__all__ = ["FLEET_CLIENT", "FLEET_SERVER", "CurveKeys", "curve_keys", "fleet_keys"]

log = module_logger(__name__)

_REQUIRED = ("server_secret_key", "client_secret_key", "allowed_client_keys")


class CurveKeys:
    """The CURVE keys of our sockets: fixed (from the key options), or a fleet directory's as
    they are now (:class:`~p2pkv_zmq.fleet_dir.LiveKeys`: the client pair and the allowed
    keys follow the directory). Keys are Z85 (40 bytes); ``allowed`` is a view of the raw
    32-byte client keys admitted at each lookup. Driver thread only."""

    def __init__(self, keys: KeySet | LiveKeys) -> None:
        self._keys = keys
        self.allowed: Set[bytes] = AllowedView(self.current)

    def current(self) -> KeySet:
        """The keys now."""
        keys = self._keys
        return keys if isinstance(keys, KeySet) else keys.current()

    @property
    def server_secret(self) -> bytes:
        return self.current().server_secret

    @property
    def server_public(self) -> bytes:
        return self.current().server_public

    @property
    def client_secret(self) -> bytes:
        return self.current().client_secret

    @property
    def client_public(self) -> bytes:
        return self.current().client_public

    def __repr__(self) -> str:  # never print secrets
        return f"CurveKeys({self.current()!r})"


def curve_keys(
    bind_host: str,
    options: ZmqOptions,
    *,
    curve_supported: bool,
    environ: Mapping[str, str] = os.environ,
) -> CurveKeys | None:
    """The CURVE keys to use, or None for plain (unauthenticated) ZMTP.

    Raises ``ConfigError`` when the options break the policy above or a key cannot be read.
    """
    directory = environ.get(CURVE_DIR_ENV)
    if directory is not None and not directory.strip():
        raise ConfigError(
            f"{CURVE_DIR_ENV} is set but empty: set it to the directory where the "
            "fleet's key Secret is mounted, or unset it (a tier without keys must "
            "say insecure: true)"
        )
    if not options.curve_requested and directory:
        if options.insecure:
            raise ConfigError(
                f"zmq option insecure: true and {CURVE_DIR_ENV}={directory!r} "
                f"contradict each other: unset {CURVE_DIR_ENV} or drop insecure"
            )
        if not curve_supported:
            raise ConfigError(f"{CURVE_DIR_ENV} is set but this libzmq was built without CURVE")
        return fleet_keys(Path(directory))
    if not options.curve_requested:
        if not options.insecure and not is_loopback_host(bind_host):
            raise ConfigError(
                f"refusing to listen on non-loopback host {bind_host!r} without authentication: "
                f"set {CURVE_DIR_ENV} to a directory of fleet keys (`p2pkv keys --secret NAME` "
                "writes them as a Kubernetes Secret to mount there), or the zmq control_options "
                "server_secret_key, client_secret_key and allowed_client_keys, or insecure: "
                "true to accept unauthenticated, unencrypted peers"
            )
        if options.insecure:
            log.warning(
                "zmq control transport on %r runs with insecure: true: no authentication and no "
                "encryption; anyone who can reach the port can open sessions",
                bind_host,
            )
        return None
    if options.insecure:
        raise ConfigError("zmq option 'insecure' cannot be combined with CURVE key options")
    missing = [name for name in _REQUIRED if not getattr(options, name)]
    if missing:
        raise ConfigError(
            f"zmq CURVE options incomplete: {', '.join(missing)} missing (with any CURVE option, "
            f"all of {', '.join(_REQUIRED)} are required)"
        )
    if not curve_supported:
        raise ConfigError("zmq CURVE options given but this libzmq was built without CURVE")
    from p2pkv_zmq.keys import public_of, read_key, read_key_list

    assert options.server_secret_key and options.client_secret_key  # checked above
    server_secret = read_key(options.server_secret_key, "server_secret_key", "secret")
    client_secret = read_key(options.client_secret_key, "client_secret_key", "secret")
    server_public = (
        read_key(options.server_public_key, "server_public_key", "public")
        if options.server_public_key
        else public_of(server_secret)
    )
    return CurveKeys(
        KeySet(
            server_secret,
            server_public,
            client_secret,
            public_of(client_secret),
            read_key_list(options.allowed_client_keys, "allowed_client_keys"),
        )
    )


def fleet_keys(
    directory: Path, client: str = FLEET_CLIENT, *, named: str = CURVE_DIR_ENV
) -> CurveKeys:
    """A fleet's keys from ``directory``, followed as it changes (:mod:`p2pkv_zmq.fleet_dir`),
    dialing with the pair ``client``; ``ConfigError`` naming what is missing or unreadable,
    the directory called ``named`` (the environment variable, or a command-line option)."""
    live = LiveKeys(directory, client=client, named=named)
    log.info(
        "zmq CURVE keys from %s=%s (%d allowed client key(s); re-read when it changes)",
        named,
        directory,
        len(live.current().allowed),
    )
    return CurveKeys(live)
