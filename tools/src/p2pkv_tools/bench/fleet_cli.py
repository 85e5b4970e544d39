"""``p2pkv bench --fleet``: run it, print it, write its JSON (see :mod:`fleet`)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

from p2pkv.errors import ConfigError
from rich.console import Console
from rich.markup import escape

from p2pkv_tools.bench.fleet import FULL, PRODUCERS, QUICK, FleetConfig, measure_fleet
from p2pkv_tools.bench.fleet_report import print_fleet
from p2pkv_tools.bench.hostinfo import describe_host

__all__ = ["FLEET_FLAGS", "fleet_config", "run_fleet"]

FLEET_FLAGS = {
    "fleet_sizes": "--fleet-sizes",
    "fleet_label": "--fleet-label",
    "no_floods": "--no-floods",
    "flood_rounds": "--flood-rounds",
    "fleet_per_process": "--fleet-per-process",
    "fleet_tut_path": "--fleet-tut-path",
}
"""Options that only ``--fleet`` reads (argparse dest -> flag)."""


def fleet_config(args: argparse.Namespace) -> FleetConfig:
    """What ``--fleet`` measures; ``ConfigError`` names a flag that cannot apply."""
    config = QUICK if args.quick else FULL
    if args.fleet_sizes:
        if min(args.fleet_sizes) < PRODUCERS:
            raise ConfigError(
                f"--fleet-sizes: a fleet needs at least {PRODUCERS} peers (the "
                f"producers of the fixed-rate loads); give sizes >= {PRODUCERS}"
            )
        config = replace(config, sizes=tuple(args.fleet_sizes))
    if args.no_floods:
        config = replace(config, floods=False)
    if args.flood_rounds:
        config = replace(config, flood_rounds=args.flood_rounds)
    if args.fleet_per_process:
        config = replace(config, per_process=args.fleet_per_process)
    if args.fleet_tut_path:
        paths = tuple(os.path.abspath(p) for p in args.fleet_tut_path.split(os.pathsep) if p)
        missing = [
            p
            for p in paths
            if not os.path.isdir(os.path.join(p, "p2pkv"))
            and not os.path.isdir(os.path.join(p, "p2pkv_zmq"))
        ]
        if not paths or missing:
            raise ConfigError(
                f"--fleet-tut-path: {missing or args.fleet_tut_path!r} holds no "
                "p2pkv or p2pkv_zmq package; give a checkout's core/src and "
                "transports/zmq/src, separated by ':'"
            )
        config = replace(config, tut_path=paths)
    return config


def run_fleet(args: argparse.Namespace, console: Console, notes: Console) -> int:
    """Measure, print the tables (unless the JSON goes to stdout), write the JSON; 1 if a
    load moved bytes that did not verify."""
    config = fleet_config(args)
    started, load = time.time(), os.getloadavg()[0]
    measured = measure_fleet(
        config, bool(args.quick), progress=lambda what: notes.print(f"fleet: {escape(what)}")
    )
    doc: dict[str, Any] = {
        "label": args.fleet_label,
        "command": "p2pkv bench --fleet " + " ".join(sys.argv[3:])
        if sys.argv[1:3] == ["bench", "--fleet"]
        else "p2pkv bench --fleet",
        "date": time.strftime("%Y-%m-%d %H:%M %Z", time.localtime(started)),
        "host": describe_host(),
        "load_avg": [round(load, 2), round(os.getloadavg()[0], 2)],
        "config": asdict(config),
        "quick": bool(args.quick),
        "elapsed_s": round(time.time() - started, 1),
        **measured,
    }
    if args.json != "-":
        print_fleet(console, doc, f"p2pkv bench --fleet ({'quick' if args.quick else 'full'})")
    if args.json:
        _write_json(args.json, doc)
    bad = sum(row.get("mismatched", 0) for row in [*doc["sizes"], *doc["floods"]])
    if bad:
        notes.print(f"[red]{bad} loads moved bytes that did not verify[/]")
    return 1 if bad else 0


def _write_json(path: str, doc: dict[str, Any]) -> None:
    """``doc`` as indented JSON to ``path`` (``-``: stdout)."""
    if path == "-":
        json.dump(doc, sys.stdout, indent=2, sort_keys=True)
        sys.stdout.write("\n")
        return
    with open(path, "w", encoding="utf-8") as out:
        json.dump(doc, out, indent=2, sort_keys=True)
        out.write("\n")
