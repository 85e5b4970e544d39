"""``p2pkv bench --large-region``: its flags, their checks, and the run with its output."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from p2pkv.cli import check_output_path
from p2pkv.errors import ConfigError
from rich.markup import escape

from p2pkv_tools.bench.large_region import (
    DEFAULT,
    LANES,
    WHOLE,
    LargeRegionConfig,
    render,
    run_large_region,
)

__all__ = ["LARGE_REGION_FLAGS", "add_arguments", "large_region_requested", "run_cli"]

LARGE_REGION_FLAGS = {
    "lanes": "--lanes",
    "slice_bytes": "--slice-bytes",
    "run_blocks": "--run-blocks",
}
"""Options only ``--large-region`` reads (argparse dest -> flag)."""
_OTHER_MODES = {"tier": "--tier", "control": "--control"}


def add_arguments(parser: Any, parse_size: Any) -> None:
    """``--large-region`` and the flags only it reads."""
    parser.add_argument(
        "--large-region",
        action="store_true",
        help="a large region (--region, default 6G) registered in slices: per lane and slice "
        "size, registration time and the GB/s of reads near the start, past 4 GiB, across "
        "slice boundaries, at the end and scattered, every byte checked",
    )
    parser.add_argument(
        "--lanes",
        type=lambda s: tuple(x for x in s.split(",") if x),
        metavar="LANE,...",
        help=f"with --large-region: lanes to run (default {','.join(LANES)})",
    )
    parser.add_argument(
        "--slice-bytes",
        metavar="SIZE,...",
        type=lambda s: tuple(_slice_entry(x, parse_size) for x in s.split(",") if x),
        help="with --large-region: slice sizes, each a size (e.g. 1G), 'default' (the "
        "transports' default or P2PKV_SLICE_BYTES) or 'whole' (default: whole,default)",
    )
    parser.add_argument(
        "--run-blocks",
        type=int,
        metavar="N",
        help="with --large-region: blocks per read (default 16)",
    )


def _slice_entry(text: str, parse_size: Any) -> int:
    word = text.strip().lower()
    if word in ("default", "whole"):
        return DEFAULT if word == "default" else WHOLE
    size = int(parse_size(text))
    if size < 1:
        raise argparse.ArgumentTypeError(f"a slice size must be positive: {text!r}")
    return size


def large_region_requested(args: argparse.Namespace) -> bool:
    """``--large-region`` or a flag only it reads was given."""
    return bool(args.large_region) or any(
        getattr(args, dest) is not None for dest in LARGE_REGION_FLAGS
    )


def _config(args: argparse.Namespace) -> LargeRegionConfig:
    """The run's config from the flags; ``ConfigError`` for a misuse (one line each)."""
    if not args.large_region:
        given = [
            flag for dest, flag in LARGE_REGION_FLAGS.items() if getattr(args, dest) is not None
        ]
        raise ConfigError(f"{', '.join(given)} apply to --large-region only: add it")
    clashing = [flag for dest, flag in _OTHER_MODES.items() if getattr(args, dest)]
    if clashing:
        raise ConfigError(f"--large-region is a mode of its own: drop {', '.join(clashing)}")
    changes = {
        "lanes": args.lanes,
        "slice_bytes": args.slice_bytes,
        "run_blocks": args.run_blocks,
        "reps": args.reps,
        "region_bytes": args.region,
        "block_len": args.block_sizes[0] if args.block_sizes else None,
    }
    config = LargeRegionConfig(**{k: v for k, v in changes.items() if v is not None})
    try:
        config.check()
    except ValueError as exc:
        raise ConfigError(f"--large-region: {exc}") from None
    if args.json and args.json != "-":
        check_output_path("--json", args.json)
    return config


def run_cli(args: argparse.Namespace, console: Any, notes: Any) -> int:
    """Run ``--large-region``: the table on ``console`` (Markdown), progress on ``notes``,
    ``--json`` written; exit status 1 when a read failed or a byte was wrong."""
    config = _config(args)
    doc = run_large_region(config, lambda line: notes.print(escape(line)))
    text = json.dumps(doc, indent=2, sort_keys=True) + "\n"
    if args.json == "-":
        sys.stdout.write(text)
    else:
        console.print(escape(render(doc)))
        if args.json:
            with open(args.json, "w", encoding="utf-8") as out:
                out.write(text)
    return 1 if any(row["error"] for row in doc["rows"]) else 0
