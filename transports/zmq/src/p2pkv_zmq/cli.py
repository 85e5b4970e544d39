"""``p2pkv keys``: write a CURVE key pair for the ``zmq`` control transport's options."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_keys_parser", "run_keys"]


def add_keys_parser(sub: Any) -> None:
    p = sub.add_parser(
        "keys",
        help="write a CURVE key pair (NAME.key public, NAME.key_secret secret) for zmq control",
        description=(
            "Write a CURVE key pair for the zmq control transport: NAME.key (public: list it in "
            "peers' allowed_client_keys, or use it as server_public_key) and NAME.key_secret "
            "(secret, mode 0600: use it as server_secret_key or client_secret_key)."
        ),
    )
    p.add_argument("--dir", default=".", help="directory to write into (default: .)")
    p.add_argument("--name", default="p2pkv", help="file name stem (default: p2pkv)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.set_defaults(func=run_keys)


def run_keys(args: argparse.Namespace) -> int:
    try:
        from p2pkv_zmq.keys import write_key_pair
    except ImportError as exc:
        print(f"p2pkv keys needs pyzmq ({exc}); install it with: pip install p2pkv-zmq",
              file=sys.stderr)
        return 1
    try:
        public, secret = write_key_pair(Path(args.dir), args.name, force=args.force)
    except (FileExistsError, OSError) as exc:
        print(f"p2pkv keys: {exc}", file=sys.stderr)
        return 1
    print(f"public key: {public}\nsecret key: {secret} (keep it private)")
    return 0
