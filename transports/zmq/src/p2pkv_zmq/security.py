"""Who may talk to us: CURVE keys from the options, and the fail-closed bind policy.

Policy (checked before any socket exists):

- any CURVE option given: ``server_secret_key``, ``client_secret_key`` and
  ``allowed_client_keys`` are all required, and ``insecure`` must not be set;
- no keys and a non-loopback ``host`` (wildcards, interface addresses, host names): refused
  unless ``insecure: true``, which is logged as a warning at every start.

Trust model: every peer of a cluster listens with the same server key pair (the listeners'
identity) and dials with a client key pair; a listener accepts only clients whose public key
is on its allow-list. Traffic is encrypted both ways.
"""

from __future__ import annotations

from dataclasses import dataclass

from p2pkv.addressing import is_loopback_host
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger

from p2pkv_zmq.options import ZmqOptions

__all__ = ["CurveKeys", "curve_keys"]

log = module_logger(__name__)

_REQUIRED = ("server_secret_key", "client_secret_key", "allowed_client_keys")


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


def curve_keys(bind_host: str, options: ZmqOptions, *, curve_supported: bool) -> CurveKeys | None:
    """The CURVE keys to use, or None for plain (unauthenticated) ZMTP.

    Raises ``ConfigError`` when the options break the policy above or a key cannot be read.
    """
    if not options.curve_requested:
        if not options.insecure and not is_loopback_host(bind_host):
            raise ConfigError(
                f"refusing to listen on non-loopback host {bind_host!r} without authentication: "
                "set the zmq control_options server_secret_key, client_secret_key and "
                "allowed_client_keys (create keys with `p2pkv keys`), or set insecure: true "
                "to accept unauthenticated, unencrypted peers"
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
