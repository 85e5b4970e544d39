"""The probe exchange of the zmq link protocol: ``probe`` and its answer, ``identity``.

``p2pkv probe`` asks a listening tier who it is without opening a session (docs/protocol.md,
§11). It dials the tier's PULL like a peer and sends one link message
``[link, "", "probe", nonce]``; ``link`` is the prober's link id (the address of a PULL the
prober listens on), ``nonce`` 8 to 64 bytes the answer echoes. The tier answers over a notice
PUSH dialed to that address, with ``[tier_link, "", "identity", payload]``, and nothing else:
no connection, no session, no data-transport peer, nothing logged above DEBUG.

``payload`` is one msgpack map (the session protocol's rules, §2: string keys, ``bin`` bytes,
no extension types) of :class:`Identity`'s fields. Receivers ignore keys they do not know,
so later versions may add fields. Pure Python: importing this module never imports zmq.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import msgpack
from p2pkv import __version__
from p2pkv.protocol import WIRE_MAJOR, WIRE_MINOR

from p2pkv_zmq.identity import parse_link_id

__all__ = [
    "IDENTITY",
    "MAX_IDENTITY_BYTES",
    "PROBE",
    "Identity",
    "ProbeWireError",
    "decode_identity",
    "encode_identity",
    "identity_answer",
    "probe_request",
    "valid_nonce",
]

PROBE = b"probe"
"""The verb of the prober's link message."""
IDENTITY = b"identity"
"""The verb of the tier's answer."""
MAX_IDENTITY_BYTES = 4096
"""The largest identity payload a prober decodes."""
MIN_NONCE_BYTES = 8
MAX_NONCE_BYTES = 64
_MAX_TEXT = 64
_VERSION_TEXT = re.compile(r"^[0-9A-Za-z.+!_-]{1,64}$")
SECURITY_MODES = ("curve", "none")


class ProbeWireError(ValueError):
    """A probe frame that breaks the format; the message names the field."""


@dataclass(frozen=True)
class Identity:
    """What a tier says of itself in answer to a probe."""

    nonce: bytes
    """The probe's nonce, echoed."""
    version: str
    """The tier's p2pkv version (``p2pkv.__version__``)."""
    wire: tuple[int, int]
    """The session protocol version the tier speaks (major, minor)."""
    control: str
    """Its control transport's name (``zmq``)."""
    security: str
    """``curve`` or ``none`` (an ``insecure`` listener)."""


def valid_nonce(nonce: bytes) -> bool:
    """Whether ``nonce`` may be echoed (its length is within the bounds)."""
    return MIN_NONCE_BYTES <= len(nonce) <= MAX_NONCE_BYTES


def probe_request(parts: list[bytes]) -> tuple[bytes, str] | str | None:
    """Of a message on a tier's PULL: None if it is not a ``probe``; else ``(PROBE, the
    prober's address)``, or why it is malformed (a bad link id or nonce)."""
    if len(parts) != 4 or parts[1] != b"" or parts[2] != PROBE:
        return None
    parsed = parse_link_id(parts[0])
    if parsed is None:
        return "malformed link id in a probe (not a p2pkv probe?)"
    if not valid_nonce(parts[3]):
        return f"a probe whose nonce is not {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES} bytes"
    return PROBE, parsed[0]


def encode_identity(identity: Identity) -> bytes:
    """The payload of an ``identity`` message."""
    return bytes(
        msgpack.packb(
            {
                "nonce": identity.nonce,
                "p2pkv": identity.version,
                "wire": list(identity.wire),
                "control": identity.control,
                "security": identity.security,
            },
            use_bin_type=True,
        )
    )


def decode_identity(payload: bytes) -> Identity:
    """An ``identity`` payload, checked field by field; ``ProbeWireError`` names the first
    violation (size, not a map, a missing field, a wrong type or range)."""
    if len(payload) > MAX_IDENTITY_BYTES:
        raise ProbeWireError(f"identity: {len(payload)} bytes, more than {MAX_IDENTITY_BYTES}")
    try:
        raw = msgpack.unpackb(payload, raw=False, strict_map_key=True, ext_hook=_no_extensions)
    except (
        ValueError,
        TypeError,
        msgpack.ExtraData,
        msgpack.FormatError,
        msgpack.StackError,
    ) as exc:
        raise ProbeWireError(f"identity: not one msgpack map ({type(exc).__name__})") from None
    if not isinstance(raw, dict):
        raise ProbeWireError(f"identity: expected a map, got {type(raw).__name__}")
    nonce = _field(raw, "nonce", bytes)
    if not valid_nonce(nonce):
        raise ProbeWireError(
            f"identity.nonce: expected {MIN_NONCE_BYTES}..{MAX_NONCE_BYTES} bytes, got {len(nonce)}"
        )
    version = _field(raw, "p2pkv", str)
    if not _VERSION_TEXT.match(version):
        raise ProbeWireError("identity.p2pkv: expected a version string")
    wire = _field(raw, "wire", list)
    if len(wire) != 2 or not all(_is_int(n) and 0 <= n < 2**16 for n in wire):
        raise ProbeWireError("identity.wire: expected [major, minor], integers in 0..65535")
    control = _field(raw, "control", str)
    if not 0 < len(control) <= _MAX_TEXT:
        raise ProbeWireError(f"identity.control: expected 1..{_MAX_TEXT} characters")
    security = _field(raw, "security", str)
    if security not in SECURITY_MODES:
        raise ProbeWireError(f"identity.security: expected one of {', '.join(SECURITY_MODES)}")
    return Identity(nonce, version, (wire[0], wire[1]), control, security)


def _field(raw: dict[str, Any], name: str, kind: type) -> Any:
    value = raw.get(name)
    if not isinstance(value, kind) or isinstance(value, bool):
        raise ProbeWireError(
            f"identity.{name}: expected {kind.__name__}, got {type(value).__name__}"
        )
    return value


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_extensions(code: int, data: bytes) -> Any:
    raise ProbeWireError(f"identity: msgpack extension type {code} is not allowed")


def identity_answer(nonce: bytes, *, curve: bool) -> bytes:
    """This process's answer to a probe carrying ``nonce``: its p2pkv version, the session
    wire version, ``zmq``, and whether the listener runs CURVE."""
    return encode_identity(
        Identity(nonce, __version__, (WIRE_MAJOR, WIRE_MINOR), "zmq", "curve" if curve else "none")
    )
