"""CURVE key material: read keys from Z85 text or key files, write key pairs.

Key files are small ZPL certificates (``curve`` section with ``public-key`` and, in the secret
file, ``secret-key``), readable by ``zmq.auth.load_certificate``; a file holding just the
40-character Z85 key works too. ``NAME.key`` holds the public key (give it to peers), and
``NAME.key_secret`` both halves (mode 0600; keep it private).

Error messages never include key text.
"""

from __future__ import annotations

import base64
import hashlib
import os
import re
from pathlib import Path
from typing import Literal

import zmq
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger
from zmq.utils import z85

from p2pkv_zmq.key_files import FLEET_CLIENT, FLEET_SERVER, PUBLIC_SUFFIX, SECRET_SUFFIX

__all__ = [
    "PUBLIC_SUFFIX",
    "SECRET_SUFFIX",
    "fleet_secret_manifest",
    "key_fingerprint",
    "key_pair_files",
    "public_of",
    "read_key",
    "read_key_list",
    "write_fleet_keys",
    "write_key_pair",
]

log = module_logger(__name__)

_Z85_LEN = 40
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_FLEET_PAIRS = (FLEET_SERVER, FLEET_CLIENT)
_LOOSE = 0o027
"""Mode bits a secret key file must not have: any access for others, write for the group. A
Secret volume's ``defaultMode: 0440`` (owner and the pod's fsGroup read) is accepted."""
_LINE = re.compile(r"""^\s*(public|secret)-key\s*=\s*["']?([^"'\s]+)["']?\s*$""")

Kind = Literal["public", "secret"]


def read_key(value: str, option: str, kind: Kind) -> bytes:
    """The 40-byte Z85 key named by ``value``: the key itself or a key file holding it."""
    path = _existing(value)
    if path is not None and path.is_file():
        return _from_file(path, option, kind)
    if len(value) == _Z85_LEN:
        return _checked(value, option, "the value")
    raise ConfigError(
        f"zmq option {option!r} is neither a {_Z85_LEN}-character Z85 {kind} key nor an "
        f"existing key file ({len(value)} characters given)"
    )


def read_key_list(values: tuple[str, ...], option: str) -> frozenset[bytes]:
    """Raw 32-byte public keys from keys, key files and directories of ``*.key`` files."""
    keys: set[bytes] = set()
    for i, value in enumerate(values):
        path = _existing(value)
        if path is not None and path.is_dir():
            files = sorted(path.glob(f"*{PUBLIC_SUFFIX}"))
            if not files:
                raise ConfigError(f"{_named(option)}: no *{PUBLIC_SUFFIX} files in {path}")
            keys.update(z85.decode(_from_file(f, option, "public")) for f in files)
        else:
            keys.add(z85.decode(read_key(value, f"{option}[{i}]", "public")))
    return frozenset(keys)


def key_fingerprint(public: bytes) -> str:
    """12 hex digits naming a Z85 public key (SHA-256 of its 32 bytes): what ``p2pkv probe``
    and ``p2pkv keys`` print, so two sides can compare keys without showing them."""
    return hashlib.sha256(z85.decode(public)).hexdigest()[:12]


def public_of(secret: bytes) -> bytes:
    """The Z85 public key of a Z85 secret key."""
    return zmq.curve_public(secret)


def write_key_pair(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (0600) into ``directory``; returns both paths.

    Refuses to overwrite existing files unless ``force``.
    """
    public_text, secret_text = key_pair_files()
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise FileExistsError(f"{path} exists (use --force to overwrite)")
    _write(secret_path, 0o600, secret_text)
    _write(public_path, 0o644, public_text)
    return public_path, secret_path


def key_pair_files() -> tuple[str, str]:
    """A fresh CURVE key pair as the text of its two files: ``NAME.key`` (the public key)
    and ``NAME.key_secret`` (both halves)."""
    public, secret = zmq.curve_keypair()
    pub, sec = public.decode("ascii"), secret.decode("ascii")
    secret_text = (
        "# p2pkv CURVE secret key. Keep it private; peers need only the .key file.\n"
        f'curve\n    public-key = "{pub}"\n    secret-key = "{sec}"\n'
    )
    public_text = (
        "# p2pkv CURVE public key. List it in the peers' allowed_client_keys (or use "
        "it as\n# their server_public_key when this pair is the cluster's server key).\n"
        f'curve\n    public-key = "{pub}"\n'
    )
    return public_text, secret_text


def write_fleet_keys(directory: Path, *, force: bool = False) -> list[Path]:
    """Write a fleet's key directory (``$P2PKV_CURVE_DIR``): the server and the client pair
    (:mod:`p2pkv_zmq.security`); returns the paths. Refuses to overwrite unless ``force``
    (``FileExistsError`` naming the rotation instead)."""
    for name in _FLEET_PAIRS if not force else ():
        for suffix in (PUBLIC_SUFFIX, SECRET_SUFFIX):
            if (directory / f"{name}{suffix}").exists():
                raise FileExistsError(
                    f"{directory / (name + suffix)} exists: {directory} holds a fleet's keys. "
                    f"Rotate them without an outage (`p2pkv keys --rotate begin --dir "
                    f"{directory}`, docs/security.md), or pass --force to replace them (every "
                    "peer still on the old keys is then refused)"
                )
    return [path for name in _FLEET_PAIRS for path in write_key_pair(directory, name, force=True)]


def fleet_secret_manifest(name: str, namespace: str | None = None) -> str:
    """A Kubernetes ``Secret`` (YAML) holding fresh fleet keys, file name -> content: mounted
    at ``$P2PKV_CURVE_DIR`` it is the fleet key directory. ``ConfigError`` for a ``name`` or
    ``namespace`` Kubernetes would refuse."""
    for what, value in (("name", name), ("namespace", namespace)):
        if value is not None and (len(value) > 253 or not _K8S_NAME.match(value)):
            raise ConfigError(
                f"Secret {what} {value!r} is not a valid Kubernetes name: use "
                "lowercase letters, digits, '-' and '.'"
            )
    files: dict[str, str] = {}
    for pair in _FLEET_PAIRS:
        files[f"{pair}{PUBLIC_SUFFIX}"], files[f"{pair}{SECRET_SUFFIX}"] = key_pair_files()
    lines = ["apiVersion: v1", "kind: Secret", "metadata:", f"  name: {name}"]
    if namespace is not None:
        lines.append(f"  namespace: {namespace}")
    lines += ["  labels:", "    app.kubernetes.io/part-of: p2pkv", "type: Opaque", "data:"]
    lines += [
        f"  {file}: {base64.b64encode(text.encode('ascii')).decode('ascii')}"
        for file, text in files.items()
    ]
    return "\n".join(lines) + "\n"


def _existing(value: str) -> Path | None:
    """``value`` as an existing path, or None (a Z85 key may look like anything)."""
    try:
        path = Path(value).expanduser()
        return path if path.exists() else None
    except (OSError, RuntimeError, ValueError):  # unknown ~user, name too long, NUL byte
        return None


def _write(path: Path, mode: int, text: str) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.chmod(path, mode)  # O_CREAT's mode does not apply to an existing file


def _named(option: str) -> str:
    """How a message names where a key came from: an environment variable or a command's
    flag (``--curve-dir``) as is, else the zmq option."""
    return option if option.startswith(("P2PKV_", "--")) else f"zmq option {option!r}"


def _from_file(path: Path, option: str, kind: Kind) -> bytes:
    try:
        text = path.read_text(encoding="ascii")
    except PermissionError:
        raise ConfigError(
            f"{_named(option)}: cannot read key file {path}: this process (uid {os.getuid()}, "
            f"gid {os.getgid()}) may not read it: give it read access (a Secret volume: the "
            "pod's securityContext.fsGroup and the volume's defaultMode 0440)"
        ) from None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"{_named(option)}: cannot read key file {path}: {why}") from None
    found = {m.group(1): m.group(2) for m in map(_LINE.match, text.splitlines()) if m}
    value = found.get(kind) if found else text.strip()
    if value is None:
        fix = (
            ": give the NAME.key_secret file `p2pkv keys` wrote (NAME.key is its public "
            "half, for the peers' allowed_client_keys)"
            if kind == "secret"
            else ""
        )
        raise ConfigError(f"{_named(option)}: {path} holds no {kind} key{fix}")
    if kind == "secret" and os.stat(path).st_mode & _LOOSE:
        log.warning(
            "CURVE secret key file %s is readable or writable by every user: set the "
            "Secret volume's defaultMode to 0400 (or 0440 with the pod's fsGroup); "
            "outside Kubernetes, chmod 600 it",
            path,
        )
    return _checked(value, option, str(path))


def _checked(value: str, option: str, where: str) -> bytes:
    raw = value.encode("ascii", "replace")
    try:
        ok = len(raw) == _Z85_LEN and len(z85.decode(raw)) == 32
    except Exception:  # any decoding failure means "not a key"
        ok = False
    if not ok:
        raise ConfigError(f"{_named(option)}: {where} is not a {_Z85_LEN}-character Z85 key")
    return raw
