"""``p2pkv keys``: CURVE keys for the ``zmq`` control transport: one key pair, a fleet's key
directory (``$P2PKV_CURVE_DIR``), that directory as a Kubernetes ``Secret``, or a step of a
client key rotation (:mod:`p2pkv_zmq.rotation`). Existing keys are never replaced without
``--force`` (or a rotation step, which keeps the fleet working)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from p2pkv_zmq.rotation import STEPS

__all__ = ["add_keys_parser", "run_keys"]


def add_keys_parser(sub: Any) -> None:
    p = sub.add_parser(
        "keys",
        help="write CURVE keys for zmq control: one pair, a fleet's key directory, or a "
        "Kubernetes Secret of it",
        description=(
            "Write CURVE keys for the zmq control transport. By default one pair: NAME.key "
            "(public: list it in peers' allowed_client_keys, or use it as server_public_key) "
            "and NAME.key_secret (secret, mode 0600: use it as server_secret_key or "
            "client_secret_key). --fleet writes a fleet's key directory (server and client "
            "pairs) for P2PKV_CURVE_DIR; --secret prints it as a Kubernetes Secret to mount "
            "there (docs/security.md). --rotate STEP runs a step of a client key rotation on "
            "--dir, or on the Secret JSON --from gives (printing the new Secret)."
        ),
    )
    kind = p.add_mutually_exclusive_group()
    kind.add_argument(
        "--fleet",
        action="store_true",
        help="write server.key(_secret) and client.key(_secret) into --dir",
    )
    kind.add_argument(
        "--secret",
        metavar="NAME",
        help="print a Kubernetes Secret NAME of fresh fleet keys (nothing is "
        "written to disk; create it with `kubectl create -f -`, which "
        "refuses to replace an existing one)",
    )
    kind.add_argument(
        "--rotate",
        choices=STEPS,
        metavar="STEP",
        help="a step of a client key rotation: begin, switch, finish (docs/security.md)",
    )
    p.add_argument(
        "--from",
        dest="source",
        metavar="FILE",
        help="with --rotate: the Secret as JSON (`kubectl get secret NAME -o "
        "json`; - for stdin); the rotated Secret is printed",
    )
    p.add_argument("--namespace", help="with --secret: the Secret's namespace")
    p.add_argument("--dir", default=".", help="directory to write into (default: .)")
    p.add_argument("--name", help="file name stem of one pair (default: p2pkv)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    try:
        from p2pkv_zmq import keys
    except ImportError as exc:
        print(
            f"p2pkv keys needs pyzmq ({exc}); install it with: pip install p2pkv-zmq",
            file=sys.stderr,
        )
        return 1
    from p2pkv.errors import ConfigError

    misuse = _misuse(args)
    if misuse:
        print(f"p2pkv keys: {misuse}", file=sys.stderr)
        return 2
    try:
        if args.rotate:
            _rotate(args)
        elif args.secret:
            sys.stdout.write(keys.fleet_secret_manifest(args.secret, args.namespace))
        elif args.fleet:
            paths = keys.write_fleet_keys(Path(args.dir), force=args.force)
            print(
                "fleet keys: "
                + ", ".join(map(str, paths))
                + f"\nset P2PKV_CURVE_DIR={args.dir} on every instance (keep it private)"
            )
        else:
            public, secret = keys.write_key_pair(
                Path(args.dir), args.name or "p2pkv", force=args.force
            )
            print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    except (ConfigError, FileExistsError) as exc:  # bad input, or keys it would replace
        print(f"p2pkv keys: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"p2pkv keys: {exc}", file=sys.stderr)
        return 1
    return 0


def _rotate(args: argparse.Namespace) -> None:
    from p2pkv_zmq.rotation import rotate_dir, rotate_secret

    if args.source is None:
        for line in rotate_dir(Path(args.dir), args.rotate):
            print(line)
        return
    if args.source == "-":
        manifest = sys.stdin.read()
    else:
        try:
            manifest = Path(args.source).read_text(encoding="utf-8")
        except OSError as exc:
            raise FileExistsError(f"--from {args.source}: {exc.strerror or exc}") from None
    secret, hint = rotate_secret(manifest, args.rotate)
    sys.stdout.write(secret)
    print(f"p2pkv keys: {hint}", file=sys.stderr)


def _misuse(args: argparse.Namespace) -> str | None:
    """A flag that does not go with the others, as one line naming it and the fix."""
    if args.name and (args.fleet or args.secret or args.rotate):
        return "--name names one pair; a fleet's files are server.* and client.*: drop --name"
    if args.namespace and not args.secret:
        return "--namespace goes with --secret NAME"
    if args.source and not args.rotate:
        return "--from goes with --rotate STEP"
    if args.force and args.rotate:
        return "--rotate replaces only what its step changes: drop --force"
    return None
