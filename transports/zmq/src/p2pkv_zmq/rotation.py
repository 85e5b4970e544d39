"""Rotating a fleet's client key pair in three steps, without an outage (docs/security.md).

A fleet key directory admits every ``*.key`` but ``server.key`` as a client key, and tiers
re-read it when it changes (:mod:`p2pkv_zmq.fleet_dir`). So a new client pair can be made
acceptable everywhere before anyone uses it, then used, then the old one dropped:

1. ``begin``: a new pair as ``client-next.key`` and ``client-next.key_secret``. Every tier
   now admits both the old and the new client key; dialers still present the old one.
2. ``switch``: the new pair becomes ``client.key``/``client.key_secret``; the old public key
   stays as ``client-previous.key``. New dials present the new key; connections made with
   the old one stay admitted (their handshake is done).
3. ``finish``: ``client-previous.key`` is dropped: the old key is no longer admitted for new
   connections (restart a tier to cut its established ones).

Each step needs the previous one to have reached every tier first (``p2pkv probe`` with the
new directory says so). The server pair is not rotated in place (a listener keeps the key it
was bound with): docs/security.md says how.

The steps work on file maps (name -> text): a directory (:func:`rotate_dir`, each file
replaced atomically, in an order that keeps every moment a valid directory) or a Kubernetes
Secret read as JSON (:func:`rotate_secret`). Importing this module never imports zmq (only
``begin`` does, to make a pair), so the CLI can list the steps without pyzmq.
"""

from __future__ import annotations

import base64
import binascii
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from p2pkv.errors import ConfigError

from p2pkv_zmq.key_files import FLEET_CLIENT, PUBLIC_SUFFIX, SECRET_SUFFIX

__all__ = ["STEPS", "Step", "check_hint", "rotate", "rotate_dir", "rotate_secret"]

Step = Literal["begin", "switch", "finish"]
STEPS: tuple[Step, ...] = ("begin", "switch", "finish")
_CLIENT, _NEXT, _PREVIOUS = FLEET_CLIENT, f"{FLEET_CLIENT}-next", f"{FLEET_CLIENT}-previous"
_SECRET_KEEP = ("name", "namespace", "labels", "annotations")


def rotate(files: Mapping[str, str], step: Step) -> tuple[dict[str, str], list[str]]:
    """The file map after ``step``, and the names it removes; ``ConfigError`` when the map
    is not at the state the step starts from (naming the step to run instead)."""
    has = set(files)
    out = dict(files)
    current, following = f"{_CLIENT}{SECRET_SUFFIX}", f"{_NEXT}{SECRET_SUFFIX}"
    if current not in has:
        raise ConfigError(
            f"no {current}: this is not a fleet key directory (`p2pkv keys "
            "--fleet` or `--secret` makes one)"
        )
    if step == "begin":
        if following in has or f"{_PREVIOUS}{PUBLIC_SUFFIX}" in has:
            raise ConfigError(
                "a rotation is already under way (client-next or "
                "client-previous is present): run `switch` or `finish`"
            )
        from p2pkv_zmq.keys import key_pair_files

        out[f"{_NEXT}{PUBLIC_SUFFIX}"], out[following] = key_pair_files()
        return out, []
    if step == "switch":
        if following not in has:
            raise ConfigError("no client-next.key_secret: run `begin` first")
        out[f"{_PREVIOUS}{PUBLIC_SUFFIX}"] = files[f"{_CLIENT}{PUBLIC_SUFFIX}"]
        out[f"{_CLIENT}{PUBLIC_SUFFIX}"] = files[f"{_NEXT}{PUBLIC_SUFFIX}"]
        out[current] = files[following]
        gone = [f"{_NEXT}{PUBLIC_SUFFIX}", following]
        for name in gone:
            del out[name]
        return out, gone
    if f"{_PREVIOUS}{PUBLIC_SUFFIX}" not in has or following in has:
        raise ConfigError(
            "not switched yet (client-previous.key missing, or client-next "
            "present): run `switch` first"
        )
    del out[f"{_PREVIOUS}{PUBLIC_SUFFIX}"]
    return out, [f"{_PREVIOUS}{PUBLIC_SUFFIX}"]


def check_hint(step: Step, files: Mapping[str, str]) -> str:
    """What to check on every pod before the next step, with the key fingerprints (after
    ``step``, given the file map it left)."""
    from p2pkv_zmq.keys import key_fingerprint, read_key

    def fingerprint(name: str) -> str:
        text = files[f"{name}{PUBLIC_SUFFIX}"]
        key = next((part for part in text.split('"') if len(part) == 40), text.strip())
        return key_fingerprint(read_key(key, name, "public"))

    if step == "begin":
        return (
            f"new client key {fingerprint(_NEXT)} is admitted once this reaches a pod; "
            f"check every pod with `p2pkv probe --client-key {_NEXT}`, then run switch"
        )
    if step == "switch":
        return (
            f"new dials present client key {fingerprint(_CLIENT)}; check that `p2pkv "
            f"probe` shows 'its client key {fingerprint(_CLIENT)}' on every pod, then run "
            "finish"
        )
    return (
        f"only client key {fingerprint(_CLIENT)} is admitted for new connections once this "
        "reaches a pod; restart pods to cut connections made with the old one"
    )


def rotate_dir(directory: Path, step: Step) -> list[str]:
    """Apply ``step`` to a fleet key directory in place; returns what it did, one line per
    file. New and changed files first (each written to a temporary name and renamed over),
    removals last, so a tier reading the directory meanwhile finds a usable set."""
    try:
        files = {
            p.name: p.read_text(encoding="ascii")
            for p in directory.iterdir()
            if p.is_file() and p.name.endswith((PUBLIC_SUFFIX, SECRET_SUFFIX))
        }
    except OSError as exc:
        raise ConfigError(f"--dir {directory}: cannot read it: {exc.strerror or exc}") from None
    after, gone = rotate(files, step)
    done = []
    # Secret files first (each secret's public half is derived from it), then new public
    # keys, then changed ones: the keys admitted only grow until the removals.
    for name in sorted(after, key=lambda n: (n.endswith(PUBLIC_SUFFIX), n in files)):
        if files.get(name) != after[name]:
            _replace(directory / name, after[name])
            done.append(f"wrote {directory / name}")
    for name in gone:
        (directory / name).unlink()
        done.append(f"removed {directory / name}")
    return [*done, check_hint(step, after)]


def rotate_secret(manifest: str, step: Step) -> tuple[str, str]:
    """A Kubernetes Secret (JSON, as ``kubectl get secret NAME -o json`` prints it) after
    ``step``, as JSON for ``kubectl apply -f -`` (its server-side fields dropped), and what to
    check before the next step (:func:`check_hint`)."""
    try:
        secret = json.loads(manifest)
    except ValueError as exc:
        if re.search(r"^kind:\s*Secret\s*$", manifest, re.MULTILINE):
            raise ConfigError(
                "the Secret is YAML; --from takes JSON (p2pkv-zmq parses no YAML): "
                "give `kubectl get secret NAME -o json`"
            ) from None
        raise ConfigError(
            f"the Secret is not JSON ({exc}): give `kubectl get secret NAME -o json`"
        ) from None
    if (
        not isinstance(secret, dict)
        or secret.get("kind") != "Secret"
        or not isinstance(secret.get("data"), dict)
    ):
        raise ConfigError("not a Secret with data: give `kubectl get secret NAME -o json`")
    try:
        files = {
            name: base64.b64decode(value, validate=True).decode("ascii")
            for name, value in secret["data"].items()
        }
    except (binascii.Error, UnicodeDecodeError, TypeError, ValueError):
        raise ConfigError("the Secret's data is not base64 key files") from None
    after, _ = rotate(files, step)
    given = secret.get("metadata")
    metadata: dict[str, Any] = given if isinstance(given, dict) else {}
    out: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": secret.get("type", "Opaque"),
        "metadata": {k: metadata[k] for k in _SECRET_KEEP if k in metadata},
        "data": {
            name: base64.b64encode(text.encode("ascii")).decode("ascii")
            for name, text in sorted(after.items())
        },
    }
    return json.dumps(out, indent=2) + "\n", check_hint(step, after)


def _replace(path: Path, text: str) -> None:
    temporary = path.with_name(f".{path.name}.tmp")
    mode = 0o600 if path.name.endswith(SECRET_SUFFIX) else 0o644
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w", encoding="ascii") as f:
        f.write(text)
    os.replace(temporary, path)
