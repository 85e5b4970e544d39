"""CURVE key material: read keys from Z85 text or key files, write key pairs.

Key files are small ZPL certificates (``curve`` section with ``public-key`` and, in the secret
file, ``secret-key``), readable by ``zmq.auth.load_certificate``; a file holding just the
40-character Z85 key works too. ``NAME.key`` holds the public key (give it to peers), and
``NAME.key_secret`` both halves (mode 0600; keep it private).

Error messages never include key text.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Literal

import zmq
from p2pkv.errors import ConfigError
from p2pkv.logs import module_logger
from zmq.utils import z85

__all__ = ["PUBLIC_SUFFIX", "SECRET_SUFFIX", "public_of", "read_key", "read_key_list",
           "write_key_pair"]

log = module_logger(__name__)

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
_Z85_LEN = 40
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
                raise ConfigError(f"zmq option {option!r}: no *{PUBLIC_SUFFIX} files in {path}")
            keys.update(z85.decode(_from_file(f, option, "public")) for f in files)
        else:
            keys.add(z85.decode(read_key(value, f"{option}[{i}]", "public")))
    return frozenset(keys)


def public_of(secret: bytes) -> bytes:
    """The Z85 public key of a Z85 secret key."""
    return zmq.curve_public(secret)


def write_key_pair(directory: Path, name: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write ``NAME.key`` and ``NAME.key_secret`` (0600) into ``directory``; returns both paths.

    Refuses to overwrite existing files unless ``force``.
    """
    public, secret = zmq.curve_keypair()
    directory.mkdir(parents=True, exist_ok=True)
    public_path = directory / f"{name}{PUBLIC_SUFFIX}"
    secret_path = directory / f"{name}{SECRET_SUFFIX}"
    if not force:
        for path in (public_path, secret_path):
            if path.exists():
                raise FileExistsError(f"{path} exists (use --force to overwrite)")
    pub = public.decode("ascii")
    _write(secret_path, 0o600,
           "# p2pkv CURVE secret key. Keep it private; peers need only the .key file.\n"
           f'curve\n    public-key = "{pub}"\n    secret-key = "{secret.decode("ascii")}"\n')
    _write(public_path, 0o644,
           "# p2pkv CURVE public key. List it in the peers' allowed_client_keys (or use it as\n"
           "# their server_public_key when this pair is the cluster's server key).\n"
           f'curve\n    public-key = "{pub}"\n')
    return public_path, secret_path


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


def _from_file(path: Path, option: str, kind: Kind) -> bytes:
    try:
        text = path.read_text(encoding="ascii")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"zmq option {option!r}: cannot read key file {path}: {exc}") from exc
    found = {m.group(1): m.group(2) for m in map(_LINE.match, text.splitlines()) if m}
    value = found.get(kind) if found else text.strip()
    if value is None:
        fix = (": give the NAME.key_secret file `p2pkv keys` wrote (NAME.key is its public "
               "half, for the peers' allowed_client_keys)" if kind == "secret" else "")
        raise ConfigError(f"zmq option {option!r}: {path} holds no {kind} key{fix}")
    if kind == "secret" and os.stat(path).st_mode & 0o077:
        log.warning("CURVE secret key file %s is readable by other users (chmod 600 it)", path)
    return _checked(value, option, str(path))


def _checked(value: str, option: str, where: str) -> bytes:
    raw = value.encode("ascii", "replace")
    try:
        ok = len(raw) == _Z85_LEN and len(z85.decode(raw)) == 32
    except Exception:  # any decoding failure means "not a key"
        ok = False
    if not ok:
        raise ConfigError(f"zmq option {option!r}: {where} is not a {_Z85_LEN}-character Z85 key")
    return raw
