"""``p2pkv probe``: prove that a p2pkv tier with the expected security answers at an address.

``p2pkv probe [HOST:PORT] [--ranks N] [--curve-dir DIR | --insecure] [--timeout SECONDS]``.
Without an address it probes the tier this pod runs: host and base port from the variables
the tier reads under vLLM (``VLLM_P2P_SIDE_CHANNEL_HOST``/``_PORT``, else ``P2PKV_HOST``/
``P2PKV_PORT``, else ``localhost:5710``; :data:`p2pkv.config.VLLM_HOST_ENV`), a wildcard
host probed on loopback. Keys come from ``--curve-dir``, else ``$P2PKV_CURVE_DIR``;
``--insecure`` expects a tier without authentication.

Exit status: 0 when every rank is a p2pkv tier with that security (one line each on
stdout); 1 when any is not (one line each on stderr naming what answered); 2 for misuse
(no keys and no ``--insecure``, a bad address or directory), one line naming the fix.
The ranks are probed at once (:data:`PARALLEL` at a time), each within ``--timeout``, so
``--ranks N`` takes no longer than one rank. Built for Kubernetes startup and readiness
probes: see docs/cli.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from p2pkv.addressing import format_address, parse_address
from p2pkv.config import VLLM_HOST_ENV, VLLM_PORT_ENV, TierConfig
from p2pkv.errors import ConfigError

from p2pkv_zmq.identity import WILDCARD_HOSTS
from p2pkv_zmq.options import CURVE_DIR_ENV

__all__ = ["DEFAULT_TIMEOUT", "add_probe_parser", "run_probe"]

DEFAULT_TIMEOUT = 3.0
"""Seconds one rank's probe may take in all: the dial, the answer, and after a failure the
reading of what answered (:mod:`p2pkv_zmq.probe`)."""
MAX_TIMEOUT = 3600.0
MAX_RANKS = 1024
PARALLEL = 64
"""Ranks probed at the same time (each with its own zmq context and two sockets)."""


def add_probe_parser(sub: Any) -> None:
    p = sub.add_parser(
        "probe",
        help="prove that a p2pkv tier with the expected security answers at HOST:PORT "
        "(a readiness probe)",
        description=(
            "Dial the tier at HOST:PORT as a peer would and ask who it is, without opening a "
            "session. Exit 0 only when a p2pkv tier answers with this fleet's CURVE keys (or "
            "without authentication, with --insecure); exit 1 naming what answered instead; "
            "exit 2 for misuse. Without HOST:PORT: the tier of this pod, from "
            "VLLM_P2P_SIDE_CHANNEL_HOST/_PORT (else P2PKV_HOST/P2PKV_PORT, else "
            "localhost:5710)."
        ),
    )
    p.add_argument(
        "address",
        nargs="?",
        metavar="HOST:PORT",
        help="the tier's control address (default: this pod's, from the environment)",
    )
    p.add_argument(
        "--ranks",
        "--data-parallel-size",
        dest="ranks",
        type=int,
        default=1,
        metavar="N",
        help="probe ports PORT..PORT+N-1 (one per data-parallel rank: the engine's "
        "--data-parallel-size); all must pass",
    )
    security = p.add_mutually_exclusive_group()
    security.add_argument(
        "--curve-dir", metavar="DIR", help=f"the fleet's key directory (default: ${CURVE_DIR_ENV})"
    )
    security.add_argument(
        "--insecure",
        action="store_true",
        help="expect a tier without authentication (insecure: true)",
    )
    p.add_argument(
        "--client-key",
        default="client",
        metavar="NAME",
        help="dial with the pair NAME.key_secret of the key directory (default "
        "client; client-next checks a rotation's new key, docs/security.md)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        metavar="SECONDS",
        help=f"seconds each rank's probe takes at most, the naming of what "
        f"answered included (default {DEFAULT_TIMEOUT:g}); ranks are probed "
        "at once",
    )
    p.set_defaults(func=run_probe)


def run_probe(args: argparse.Namespace) -> int:
    """0: every rank passed; 1: one did not (its line on stderr); misuse raises
    ``ConfigError`` (the CLI prints it and exits 2)."""
    if not 1 <= args.ranks <= MAX_RANKS:
        raise ConfigError(
            f"--ranks must be 1..{MAX_RANKS} (the engine's data-parallel size), got {args.ranks}"
        )
    if not 0 < args.timeout <= MAX_TIMEOUT:
        raise ConfigError(
            f"--timeout must be a number of seconds in (0, {MAX_TIMEOUT:g}], got {args.timeout}"
        )
    host, port = _target(args.address, os.environ)
    if port + args.ranks - 1 > 65535:
        raise ConfigError(f"--ranks {args.ranks} from port {port} passes 65535: lower --ranks")
    keys = _keys(args, os.environ)
    from p2pkv_zmq.probe import probe

    def one(rank: int) -> Any:
        return probe(format_address(host, port + rank), host, port + rank, keys, args.timeout)

    with ThreadPoolExecutor(min(args.ranks, PARALLEL), "p2pkv-probe") as pool:
        results = list(pool.map(one, range(args.ranks)))
    for result in results:
        if result.ok:
            print(result.line)
        else:
            print(f"p2pkv probe: {result.line}", file=sys.stderr)
    return 0 if all(result.ok for result in results) else 1


def _target(address: str | None, environ: os._Environ[str] | dict[str, str]) -> tuple[str, int]:
    """The host and base port to probe: ``address``, else the tier's from ``environ``."""
    if address is not None:
        try:
            return parse_address(address)
        except ConfigError as exc:
            raise ConfigError(f"{exc}: give the tier's control address as HOST:PORT") from None
    config = TierConfig.from_dict(
        {}, environ=environ, host_env=VLLM_HOST_ENV, port_env=VLLM_PORT_ENV
    )
    if config.base_port == 0:
        raise ConfigError("the tier's port is 0 (ephemeral) here: give HOST:PORT")
    host = config.host
    if host in WILDCARD_HOSTS:
        host = "::1" if host == "::" else "127.0.0.1"
    return host, config.base_port


def _keys(args: argparse.Namespace, environ: os._Environ[str] | dict[str, str]) -> Any:
    """The fleet's keys (``--curve-dir`` or ``$P2PKV_CURVE_DIR``), or None with
    ``--insecure``; ``ConfigError`` when neither is given or the keys cannot be read."""
    if args.insecure:
        return None
    directory, named = args.curve_dir, "--curve-dir"
    if directory is None:
        named = CURVE_DIR_ENV
        directory = environ.get(CURVE_DIR_ENV)
        if directory is not None and not directory.strip():
            raise ConfigError(
                f"{CURVE_DIR_ENV} is set but empty: set it to the fleet's key "
                "directory, or pass --insecure for a tier without keys"
            )
    if directory is None:
        raise ConfigError(
            f"no keys: set {CURVE_DIR_ENV} (or --curve-dir DIR) to the fleet's "
            "key directory, or pass --insecure for a tier without authentication"
        )
    import zmq

    from p2pkv_zmq.security import fleet_keys

    if not zmq.has("curve"):
        raise ConfigError("this libzmq was built without CURVE: probe with --insecure only")
    return fleet_keys(Path(directory), args.client_key, named=named)
