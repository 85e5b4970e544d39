"""``p2pkv bench``: data-plane matrix against raw libraries and memcpy; ``--control`` mode."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from p2pkv.cli import TOOL_COMMANDS, check_output_path, make_console, usable_transport
from p2pkv.errors import ConfigError
from p2pkv.registry import Registry, default_registry
from rich.markup import escape

from p2pkv_tools.bench.data_transport import (
    DATA_OPTIONS_FLAG,
    check_bench_data_options,
    parse_bench_data_options,
)
from p2pkv_tools.bench.hostinfo import describe_host, environ_restored
from p2pkv_tools.bench.large_region_cli import add_arguments as add_large_region_arguments
from p2pkv_tools.bench.large_region_cli import large_region_requested
from p2pkv_tools.bench.matrix import KiB, MatrixConfig, MiB, available_series
from p2pkv_tools.bench.netns import parse_rate
from p2pkv_tools.bench.progress import measure_matrix
from p2pkv_tools.bench.report import geomean_ratios, plot, print_tables
from p2pkv_tools.demo.presets import PRESETS

__all__ = ["QUICK", "RATE_HELP", "add_parser", "parse_size", "run", "tc_rate"]

QUICK = MatrixConfig(
    block_sizes=(64 * KiB, 1 * MiB),
    batches=(1, 16),
    concurrency=(1, 4),
    reps=2,
    warmup=1,
    bytes_per_rep=4 * MiB,
    max_requests=16,
    min_requests_per_inflight=1,
    region_bytes=64 * MiB,
    rep_seconds=0.2,
)
"""``--quick``: every series, two block sizes, two batches; seconds, for CI smoke runs."""

_UNITS = {
    "": 1,
    "B": 1,
    "K": KiB,
    "KB": KiB,
    "KIB": KiB,
    "M": MiB,
    "MB": MiB,
    "MIB": MiB,
    "G": 1024 * MiB,
    "GB": 1024 * MiB,
    "GIB": 1024 * MiB,
}


def parse_size(text: str) -> int:
    """``64K``, ``1M``, ``4MiB``, ``1G``, ``65536`` -> bytes (binary units)."""
    t = text.strip().upper()
    num = t.rstrip("BKMGI")
    unit = t[len(num) :]
    if not num.isdigit() or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (examples: 64K, 1M, 4MiB)")
    return int(num) * _UNITS[unit]


def _int_list(text: str) -> tuple[int, ...]:
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of integers: {text!r}") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"need positive integers, got {text!r}")
    return values


def _positive_int(text: str) -> int:
    values = _int_list(text)
    if len(values) != 1:
        raise argparse.ArgumentTypeError(f"need one positive integer, got {text!r}")
    return values[0]


def _size_list(text: str) -> tuple[int, ...]:
    values = tuple(parse_size(x) for x in text.split(",") if x.strip())
    if not values or any(v <= 0 or v % 8 for v in values):
        raise argparse.ArgumentTypeError(f"block sizes must be positive multiples of 8: {text!r}")
    return values


def _positive_rate(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"need tokens per second > 0, e.g. 20000: {text!r}")
    return value


RATE_HELP = (
    "with --netns: shape the veth to RATE each way with tc, e.g. 25gbit (tc units: "
    "bit, kbit, mbit, gbit; bps, mbps, ... are bytes/s)"
)
"""``--rate``'s help (with :func:`tc_rate` its type), wherever a bench takes ``--rate``."""


def tc_rate(text: str) -> int:
    """``--rate``'s argparse type: :func:`~p2pkv.bench.netns.parse_rate`, its ``ValueError``
    as the ``ArgumentTypeError`` argparse reports in one line."""
    try:
        return parse_rate(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "bench",
        help=TOOL_COMMANDS["bench"],
        description="Data-plane matrix: every data transport x block size x blocks per request "
        "x concurrency, with the raw library (same transport without p2pkv) and memcpy of "
        "the same scattered blocks measured in the same run. Every repetition's bytes are "
        "verified. --control measures control-plane round trips instead.",
    )
    p.add_argument("--quick", action="store_true", help="small matrix for CI (seconds)")
    p.add_argument(
        "--transports",
        type=lambda s: tuple(x for x in s.split(",") if x),
        help="data transports to run (default: every available one)",
    )
    p.add_argument("--block-sizes", type=_size_list, help="e.g. 64K,256K,1M,4M")
    p.add_argument("--batches", type=_int_list, help="blocks per request, e.g. 1,4,16,64,256")
    p.add_argument("--concurrency", type=_int_list, help="requests in flight, e.g. 1,4")
    p.add_argument("--reps", type=int, help="timed repetitions per cell (default 5)")
    p.add_argument("--warmup", type=int, help="untimed repetitions per cell (default 1)")
    p.add_argument("--bytes-per-rep", type=parse_size, help="bytes per repetition (default 256M)")
    p.add_argument("--region", type=parse_size, help="region size per side (default 1G)")
    p.add_argument(
        "--contiguous", action="store_true", help="contiguous slot runs instead of scattered slots"
    )
    p.add_argument("--no-raw", action="store_true", help="skip the raw-library baselines")
    p.add_argument("--no-memcpy", action="store_true", help="skip the memcpy baseline")
    p.add_argument(
        DATA_OPTIONS_FLAG,
        metavar="[NAME=]JSON",
        action="append",
        help="data_options of the transports in --transports (needed with it), a "
        "JSON object or @FILE for every one of them, or NAME=JSON for one (repeat "
        "the flag); their regions are allocated with them too",
    )
    p.add_argument("--seed", type=int, default=0, help="slot-placement seed")
    p.add_argument(
        "--json",
        nargs="?",
        const="-",
        metavar="PATH",
        help="write results as JSON to PATH ('-' or no value: stdout)",
    )
    p.add_argument(
        "--plot",
        metavar="PATH.png",
        help="GB/s vs block size per series, log scale, a panel per batch and "
        "concurrency (needs p2pkv-tools[plot])",
    )
    p.add_argument(
        "--control",
        action="store_true",
        help="control plane: round trips vs raw pyzmq, CPU per request",
    )
    p.add_argument(
        "--tier",
        action="store_true",
        help="submit_load to result through two real P2PTiers (two processes), "
        "both arrival orders, per cell: GB/s, p50/p99, CPU per request per side, "
        "ratios to raw and memcpy; data transports from --transports (default "
        "nixl); descriptors per request when the data transport counts them "
        "(nixl, ucx); on one host, or across a veth with --netns",
    )
    p.add_argument(
        "--tier-control", metavar="NAME", help="control transport of --tier (default zmq)"
    )
    p.add_argument(
        "--recompute-rate",
        type=_positive_rate,
        metavar="TOKENS_PER_S",
        help="with --tier: prefill tokens/s per GPU; prints the prompt length "
        "above which pulling the KV beats recomputing it",
    )
    p.add_argument(
        "--overload",
        action="store_const",
        const=True,
        metavar="",
        help="with --tier: also offer each (block, batch) more requests at once "
        "than the tier's flow window holds (4x flow.window_rounds) and report "
        "throughput and p99 under overload next to the unloaded peak",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="model whose KV bytes per token the crossover uses (default llama-3-8b)",
    )
    p.add_argument(
        "--tp",
        type=int,
        metavar="N",
        help="with --recompute-rate: tensor-parallel size of the engines (a "
        "CPU-tier chunk holds every rank's KV heads; default 1)",
    )
    p.add_argument(
        "--netns",
        action="store_const",
        const=True,
        help="with --tier: each side (and the raw baseline's two) in a network "
        "namespace of its own, joined by a veth pair, UCX over TCP (nixl's staged "
        "lane, as across hosts without RDMA); removed afterwards; needs root and "
        "iproute2",
    )
    p.add_argument("--rate", type=tc_rate, metavar="RATE", help=RATE_HELP)
    p.add_argument(
        "--fleet",
        action="store_true",
        help="fleet simulator: one tier under test against N peers in a few "
        "processes (zmq control): per N idle CPU, CPU per request at a fixed "
        "rate, fds, threads, RSS, heartbeat segments/s, time to a warm mesh after "
        "a storm of N starts, p99 of a load to a peer never contacted; then "
        "floods of 10,000 client-named peers (refusing, black-holed; 3 of each)",
    )
    p.add_argument(
        "--fleet-sizes",
        type=_int_list,
        metavar="N,N,...",
        help="with --fleet: the fleet sizes (default 16,64,256,1000)",
    )
    p.add_argument(
        "--fleet-label",
        metavar="TEXT",
        help="with --fleet: a label the JSON and its tables carry (e.g. a commit)",
    )
    p.add_argument(
        "--no-floods", action="store_const", const=True, help="with --fleet: skip the floods"
    )
    p.add_argument(
        "--flood-rounds",
        type=_positive_int,
        metavar="N",
        help="with --fleet: floods of each kind, in turn (default 3; --quick: 1)",
    )
    p.add_argument(
        "--fleet-per-process",
        type=_positive_int,
        metavar="N",
        help="with --fleet: peers per helper process (default 256)",
    )
    p.add_argument(
        "--fleet-tut-path",
        metavar="DIR:DIR",
        help="with --fleet: run the tier under test on another checkout's "
        "packages (its core/src and transports/zmq/src), against this one's peers",
    )
    p.add_argument(
        "--phases",
        action="store_const",
        const=True,
        help="with --tier: instead of the matrix, PD requests one at a time per "
        "block size x blocks per request, each split into queue, control round "
        "trip, read and report, with both sides' CPU per request by component, "
        "next to raw NIXL's read of the same blocks",
    )
    add_large_region_arguments(p, parse_size)
    p.set_defaults(func=run)


def _config(args: argparse.Namespace) -> MatrixConfig:
    config = QUICK if args.quick else MatrixConfig()
    changes: dict[str, Any] = {
        "transports": args.transports,
        "block_sizes": args.block_sizes,
        "batches": args.batches,
        "concurrency": args.concurrency,
        "reps": args.reps,
        "warmup": args.warmup,
        "bytes_per_rep": args.bytes_per_rep,
        "region_bytes": args.region,
    }
    config = replace(config, **{k: v for k, v in changes.items() if v is not None})
    if config.reps < 1 or config.warmup < 0:
        raise ConfigError("--reps must be >= 1 and --warmup >= 0")
    return replace(
        config,
        raw=not args.no_raw,
        memcpy=not args.no_memcpy,
        contiguous=args.contiguous,
        seed=args.seed,
        data_options=parse_bench_data_options(args.data_options, config.transports),
    )


def run(args: argparse.Namespace) -> int:
    """Run the matrix (or ``--control``); 1 if a cell failed. Bad options raise
    ``ConfigError``/``TransportUnavailable`` before anything is measured."""
    # Every side runs on this host: keep UCX's TCP traffic on loopback unless told otherwise
    # (the environment of this process is restored on return).
    with environ_restored():
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        return _run(args)


def _check_options(args: argparse.Namespace, registry: Registry) -> MatrixConfig | None:
    """Refuse, before anything runs, what would fail later: an output path that cannot be
    written, ``--plot`` without matplotlib, a data transport named in ``--transports``
    that is unknown or cannot run here, and ``--data-options`` without ``--transports`` or
    refused by one of them (``ConfigError``/``TransportUnavailable``). Returns the
    matrix config (None for ``--control``)."""
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if path and path != "-":
            check_output_path(option, path)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise ConfigError("--plot needs matplotlib: pip install 'p2pkv-tools[plot]'") from None
    from p2pkv_tools.bench.tier_bench import tier_requested

    if args.control and not tier_requested(args):
        if args.data_options is not None:
            raise ConfigError(
                f"{DATA_OPTIONS_FLAG} does not apply to --control (its tiers "
                f"run the memory data transport as it is): drop it"
            )
        return None
    config = _config(args)
    for name in config.transports or ():
        usable_transport(registry, "data", name)
    check_bench_data_options(registry, config.data_options)
    return config


def _fleet_requested(args: argparse.Namespace) -> bool:
    """``--fleet``; ``ConfigError`` for an option of it without it, or another mode too."""
    from p2pkv_tools.bench.fleet_cli import FLEET_FLAGS
    from p2pkv_tools.bench.tier_bench import tier_requested

    if not args.fleet:
        used = next(
            (flag for dest, flag in FLEET_FLAGS.items() if getattr(args, dest) is not None), None
        )
        if used is not None:
            raise ConfigError(f"{used} is an option of the fleet simulator: add --fleet")
        return False
    if args.control or tier_requested(args):
        raise ConfigError("--fleet, --tier and --control are separate benchmarks: give one")
    if args.plot:
        raise ConfigError(
            "--fleet has no plot: drop --plot (its tables come from --json: "
            "python -m p2pkv_tools.bench.fleet_report RUN.json)"
        )
    if args.json and args.json != "-":
        check_output_path("--json", args.json)
    return True


def _run(args: argparse.Namespace) -> int:
    # Results (tables) on stdout, unless stdout carries the JSON; progress and notes on stderr.
    to_stdout = args.json == "-"
    console = make_console(stderr=to_stdout)
    notes = make_console(stderr=True)
    if _fleet_requested(args):
        from p2pkv_tools.bench.fleet_cli import run_fleet

        return run_fleet(args, console, notes)
    if large_region_requested(args):
        from p2pkv_tools.bench.large_region_cli import run_cli

        return run_cli(args, console, notes)
    registry = default_registry()
    config = _check_options(args, registry)
    from p2pkv_tools.bench.tier_bench import tier_requested

    if config is not None and tier_requested(args):
        from p2pkv_tools.bench.tier_cli import run_tier

        return run_tier(args, config, console, notes)
    if config is None:
        from p2pkv_tools.bench.control import run_control

        return run_control(args, console)
    series, unavailable = available_series(registry, config)
    for label, why in unavailable.items():
        notes.print(f"[yellow]{escape(label)} not measured:[/] {escape(why)}")
    if not series:
        raise ConfigError("nothing to measure: every series is unavailable or switched off")
    started = time.time()
    results = measure_matrix(notes, config, series)
    elapsed = time.time() - started
    doc = {
        "host": describe_host(),
        "config": asdict(config),
        "series": [s.label for s in series],
        "unavailable": unavailable,
        "elapsed_s": round(elapsed, 1),
        "rows": [r.as_row() for r in results],
        "summary": geomean_ratios(results),
    }
    title = f"p2pkv bench ({'quick' if args.quick else 'full'}, {elapsed:.0f} s)"
    if not to_stdout:
        print_tables(console, results, title)
    if args.json:
        text = json.dumps(doc, indent=2, sort_keys=True)
        if to_stdout:
            sys.stdout.write(text + "\n")
        else:
            with open(args.json, "w", encoding="utf-8") as f:
                f.write(text + "\n")
    if args.plot:
        plot(results, args.plot, title)
        notes.print(f"plot written to {escape(args.plot)}")
    failed = [r for r in results if r.error]
    return 1 if failed else 0
