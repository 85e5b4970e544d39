"""``p2pkv demo``: a producer and a consumer move a model-shaped request stream, verified."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time
from collections.abc import Callable
from typing import Any

from p2pkv.cli import (
    TOOL_COMMANDS,
    check_output_path,
    make_console,
    print_error,
    usable_transport,
)
from p2pkv.errors import ConfigError
from p2pkv.registry import default_registry
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
)

from p2pkv_tools.bench.cli import parse_size
from p2pkv_tools.bench.data_transport import (
    DATA_OPTIONS_FLAG,
    check_data_options,
    parse_data_options,
)
from p2pkv_tools.bench.hostinfo import environ_restored
from p2pkv_tools.demo.metrics import DUMP, PLUGIN, DemoMetrics, metrics_option
from p2pkv_tools.demo.orchestrator import (
    DemoFailure,
    InlineRole,
    ProcessRole,
    RequestRecord,
    RoleHandle,
    replay,
)
from p2pkv_tools.demo.orchestrator import Progress as ReplayProgress
from p2pkv_tools.demo.presets import PRESETS, ModelPreset, resolve_preset
from p2pkv_tools.demo.roles import RoleSetup
from p2pkv_tools.demo.summary import print_summary, summarize
from p2pkv_tools.demo.workload import PromptDistribution, make_stream, parse_orders

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    presets = ", ".join(f"{p.name} ({p.block_bytes / 2**20:.2f} MiB)" for p in PRESETS.values())
    p = sub.add_parser(
        "demo",
        help=TOOL_COMMANDS["demo"],
        description="Starts a producer (prefiller) and a consumer (decoder), each with a "
        "P2PTier and a model-shaped KV region, and replays a request stream in both arrival "
        "orders plus symmetric lookups. Every loaded byte is checked against content derived "
        "from its block key. Exit status 1 on any failure or mismatch. Block size = layers x "
        "KV heads x head dim x tokens per block x dtype bytes x (2 for K and V, 1 for an MLA "
        f"latent). Presets: {presets}.",
    )
    p.add_argument(
        "--preset",
        default="llama-3-8b",
        choices=sorted(PRESETS),
        help="model whose KV block shape to use (default llama-3-8b)",
    )
    p.add_argument("--block-bytes", type=parse_size, help="override the preset's block size")
    p.add_argument("--tokens-per-block", type=int, help="override tokens per block (16)")
    p.add_argument(
        "--tp",
        type=int,
        help="tensor-parallel size of the engines: a CPU-tier "
        "chunk holds every rank's KV heads (1)",
    )
    p.add_argument("--requests", type=int, default=48, help="requests to replay (default 48)")
    p.add_argument(
        "--prompt-dist",
        default="lognormal:1024:0.6",
        help="prompt tokens: lognormal:MEDIAN:SIGMA, uniform:LO:HI or fixed:N",
    )
    p.add_argument("--max-tokens", type=int, default=4096, help="longest prompt (tokens)")
    p.add_argument(
        "--orders",
        default="consumer_first=2,producer_first=2,symmetric=1",
        help="arrival orders and weights (consumer_first, producer_first, symmetric)",
    )
    p.add_argument("--inflight", type=int, default=4, help="requests in flight (default 4)")
    p.add_argument(
        "--region",
        type=parse_size,
        default=parse_size("512M"),
        help="KV region per side (default 512M)",
    )
    p.add_argument("--control", default="zmq", help="control transport (default zmq)")
    p.add_argument("--data", default="nixl", help="data transport (default nixl)")
    p.add_argument(
        DATA_OPTIONS_FLAG,
        metavar="JSON",
        help="data_options of the data transport, a JSON object or @FILE "
        "(its keys: docs/transports.md); its regions come from allocate_region "
        "with them too",
    )
    p.add_argument("--host", default="127.0.0.1", help="address the producer listens on")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--timeout", type=float, default=300.0, help="give up after this many s")
    p.add_argument("--json", metavar="PATH", help="write the summary as JSON")
    p.add_argument(
        "--metrics",
        metavar="PORT|dump",
        type=metrics_option,
        help=f"the run's Prometheus metrics (needs {PLUGIN}): PORT serves "
        f"http://HOST:PORT/metrics while the demo runs (0 picks a free port, "
        f"printed on stderr); {DUMP!r} prints them on stdout at the end",
    )
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def _single_process(control: str, data: str, data_options: dict[str, Any]) -> bool:
    """True when a chosen transport cannot cross processes (both tiers then share one).

    Raises ``ConfigError``/``TransportUnavailable`` for a transport that cannot run here or
    ``data_options`` the data transport refuses."""
    registry = default_registry()
    control_cls = usable_transport(registry, "control", control)
    data_cls = usable_transport(registry, "data", data)
    if data_options:
        check_data_options(registry, data, data_options)
    return not (control_cls.capabilities.cross_process and data_cls.capabilities.cross_process)


def run(args: argparse.Namespace) -> int:
    """Replay the stream; 0 when every request moved verified bytes, 1 otherwise. A bad
    option raises ``ConfigError``/``TransportUnavailable`` before any process starts."""
    # Both sides are on this host: keep UCX's TCP traffic on loopback unless told otherwise
    # (for the role processes only; this process's environment is restored on return).
    with environ_restored():
        os.environ.setdefault("UCX_NET_DEVICES", "lo")
        return _run(args)


def _plan(
    args: argparse.Namespace,
) -> tuple[ModelPreset, PromptDistribution, dict[str, float], int]:
    """Validate the options: (preset, prompt distribution, orders, slots per side); sets
    ``args.data_options`` to the parsed ``--data-options``."""
    args.data_options = parse_data_options(args.data_options)
    if args.json:
        check_output_path("--json", args.json)
    preset = resolve_preset(
        args.preset,
        block_bytes=args.block_bytes,
        tokens_per_block=args.tokens_per_block,
        tp=args.tp,
    )
    dist = PromptDistribution.parse(args.prompt_dist)
    orders = parse_orders(args.orders)
    if args.inflight <= 0:
        raise ConfigError(f"--inflight must be > 0, got {args.inflight}")
    capacity = args.region // preset.block_bytes
    if capacity < 1:
        raise ConfigError(f"--region {args.region} B holds no {preset.block_bytes} B block")
    return preset, dist, orders, capacity


def _run(args: argparse.Namespace) -> int:
    preset, dist, orders, capacity = _plan(args)
    inline = _single_process(args.control, args.data, args.data_options)
    with DemoMetrics(args.metrics, host=args.host, inline=inline) as metrics:
        code = _demo(args, preset, dist, orders, capacity, inline=inline, metrics=metrics)
        metrics.print_dump()
    return code


def _demo(
    args: argparse.Namespace,
    preset: ModelPreset,
    dist: PromptDistribution,
    orders: dict[str, float],
    capacity: int,
    *,
    inline: bool,
    metrics: DemoMetrics,
) -> int:
    """Announce the run, replay it and report it: 0 when every request moved verified
    bytes, 1 otherwise."""
    stream = make_stream(
        args.requests,
        dist,
        tokens_per_block=preset.tokens_per_block,
        max_blocks=min(max(args.max_tokens // preset.tokens_per_block, 1), capacity),
        orders=orders,
        seed=args.seed,
        run_id=f"demo{time.time_ns() % 10**9}",
    )
    console = make_console()
    mode = "one process (process-local transport)" if inline else "two processes"
    console.print(
        f"p2pkv demo: {preset.name} blocks of {preset.formula()}; "
        f"control [bold]{escape(args.control)}[/], data [bold]{escape(args.data)}[/], {mode}; "
        f"{args.requests} requests, prompts {dist}, {capacity} slots per side"
    )
    if metrics.url:
        make_console(stderr=True).print(f"metrics at {escape(metrics.url)} while the demo runs")
    tier_config = {
        "control": args.control,
        "data": args.data,
        "host": args.host,
        "port": 0,
        "data_options": args.data_options,
    }
    log_level = logging.getLogger("p2pkv").getEffectiveLevel()
    setups = [
        RoleSetup(
            tier_config, preset.block_bytes, capacity, seed=args.seed + i, log_level=log_level
        )
        for i in (0, 1)
    ]
    played = _play(
        InlineRole if inline else ProcessRole,
        setups,
        stream,
        args,
        block_len=preset.block_bytes,
        capacity=capacity,
        metrics=metrics,
    )
    if played is None:
        return 1
    records, wall, stats = played
    summary = summarize(records, wall, preset.block_bytes, stats)
    summary.update(
        {
            "preset": preset.name,
            "formula": preset.formula(),
            "control": args.control,
            "data": args.data,
            "processes": 1 if inline else 2,
            "prompt_dist": str(dist),
            "orders": orders,
            "inflight": args.inflight,
            "slots_per_side": capacity,
        }
    )
    return _report(console, summary, args)


def _play(
    kind: Callable[[str, RoleSetup], RoleHandle],
    setups: list[RoleSetup],
    stream: list[Any],
    args: argparse.Namespace,
    *,
    block_len: int,
    capacity: int,
    metrics: DemoMetrics,
) -> tuple[list[RequestRecord], float, dict[str, Any]] | None:
    """Start both roles, replay the stream, stop them: (records, wall time, stats per role),
    or None after printing why the run failed (the roles are killed then)."""
    roles: list[RoleHandle] = []
    try:
        roles.append(kind("producer", setups[0]))
        roles.append(kind("consumer", setups[1]))
        records, wall = _replay_with_display(
            roles, stream, block_len=block_len, capacity=capacity, args=args
        )
        stats = {}
        for role in reversed(roles):  # the consumer (which dialed) says goodbye first
            stats[role.kind], _left = role.stop(timeout=30.0)
        return records, wall, stats
    except DemoFailure as exc:
        print_error("p2pkv demo", f"failed: {exc}")
        for role in roles:
            role.kill()
        return None
    finally:
        metrics.forget(role.pid for role in roles)


def _report(console: Any, summary: dict[str, Any], args: argparse.Namespace) -> int:
    """Print (and with ``--json`` write) the summary; 0 when nothing failed or mismatched."""
    print_summary(console, summary, f"p2pkv demo: {args.control} control + {args.data} data")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
    return 0 if summary["failures"] == 0 and summary["mismatched_blocks"] == 0 else 1


def _replay_with_display(
    roles: list[RoleHandle],
    stream: list[Any],
    *,
    block_len: int,
    capacity: int,
    args: argparse.Namespace,
) -> tuple[list[Any], float]:
    with Progress(
        TextColumn("[bold]requests"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[gb]:7.2f} GB moved"),
        TextColumn("{task.fields[rate]:6.2f} GB/s"),
        TextColumn("{task.fields[failed]} failed"),
        TimeElapsedColumn(),
        console=make_console(stderr=True),
        disable=args.quiet,
    ) as bar:
        task = bar.add_task("demo", total=len(stream), gb=0.0, rate=0.0, failed=0)
        first, last = [0.0], [0.0]

        def show(p: ReplayProgress) -> None:
            now = time.monotonic()
            first[0] = first[0] or now
            finished = p.done == len(stream)
            if now - last[0] < 0.1 and not finished:
                return
            last[0] = now
            # the last second's rate while running; the whole run's once finished
            rate = p.bytes_moved / max(now - first[0], 1e-9) / 1e9 if finished else p.rate(now)
            bar.update(task, completed=p.done, gb=p.bytes_moved / 1e9, rate=rate, failed=p.failed)

        return replay(
            roles[0],
            roles[1],
            stream,
            block_len=block_len,
            capacity=capacity,
            inflight=args.inflight,
            timeout=args.timeout,
            on_progress=show,
        )
