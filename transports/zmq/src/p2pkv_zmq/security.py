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
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from p2pkv.addressing import is_loopback_host
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger

from p2pkv_zmq.options import CURVE_DIR_ENV, ZmqOptions

__all__ = ["FLEET_CLIENT", "FLEET_SERVER", "CurveKeys", "curve_keys", "fleet_keys"]

log = module_logger(__name__)

_REQUIRED = ("server_secret_key", "client_secret_key", "allowed_client_keys")
FLEET_SERVER = "server"
"""Name (``NAME.key``/``NAME.key_secret``) of the listeners' pair in a fleet key directory."""
FLEET_CLIENT = "client"
"""Name of the dialers' pair in a fleet key directory."""


@dataclass(frozen=True, repr=False)
class CurveKeys:
    """Z85 keys (40 bytes) for our sockets; ``allowed`` holds raw 32-byte client keys."""

    server_secret: bytes
    server_public: bytes
    client_secret: bytes
    client_public: bytes
    allowed: frozenset[bytes]

    def __repr__(self) -> str:  # never print secrets
        return f"CurveKeys(server_public={self.server_public!r}, allowed={len(self.allowed)})"


def curve_keys(
    bind_host: str, options: ZmqOptions, *, curve_supported: bool,
    environ: Mapping[str, str] = os.environ,
) -> CurveKeys | None:
    """The CURVE keys to use, or None for plain (unauthenticated) ZMTP.

    Raises ``ConfigError`` when the options break the policy above or a key cannot be read.
    """
    directory = environ.get(CURVE_DIR_ENV, "")
    if not options.curve_requested and directory:
        if options.insecure:
            raise ConfigError(f"zmq option insecure: true and {CURVE_DIR_ENV}={directory!r} "
                              f"contradict each other: unset {CURVE_DIR_ENV} or drop insecure")
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
                "encryption; anyone who can reach the port can open sessions", bind_host,
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
        server_secret=server_secret,
        server_public=server_public,
        client_secret=client_secret,
        client_public=public_of(client_secret),
        allowed=read_key_list(options.allowed_client_keys, "allowed_client_keys"),
    )


def fleet_keys(directory: Path) -> CurveKeys:
    """A fleet's keys from ``directory`` (the layout in the module docstring)."""
    from p2pkv_zmq.keys import PUBLIC_SUFFIX, SECRET_SUFFIX, public_of, read_key, read_key_list

    if not directory.is_dir():
        raise ConfigError(f"{CURVE_DIR_ENV}={str(directory)!r} is not a directory: mount the "
                          "fleet's key Secret there (`p2pkv keys --secret NAME` writes one)")
    secrets = {}
    for name in (FLEET_SERVER, FLEET_CLIENT):
        path = directory / f"{name}{SECRET_SUFFIX}"
        if not path.is_file():
            raise ConfigError(f"{CURVE_DIR_ENV}: no {path.name} in {directory} (a fleet key "
                              "directory holds the server and client pairs `p2pkv keys "
                              "--fleet` or `--secret` writes)")
        secrets[name] = read_key(str(path), f"{CURVE_DIR_ENV}: {path.name}", "secret")
    allowed = [str(path) for path in sorted(directory.glob(f"*{PUBLIC_SUFFIX}"))
               if path.name != f"{FLEET_SERVER}{PUBLIC_SUFFIX}"]
    if not allowed:
        raise ConfigError(f"{CURVE_DIR_ENV}: no client public key (*{PUBLIC_SUFFIX} other than "
                          f"{FLEET_SERVER}{PUBLIC_SUFFIX}) in {directory}")
    server, client = secrets[FLEET_SERVER], secrets[FLEET_CLIENT]
    log.info("zmq CURVE keys from %s=%s (%d allowed client key file(s))", CURVE_DIR_ENV,
             directory, len(allowed))
    return CurveKeys(server_secret=server, server_public=public_of(server),
                     client_secret=client, client_public=public_of(client),
                     allowed=read_key_list(tuple(allowed), f"{CURVE_DIR_ENV}: client keys"))
