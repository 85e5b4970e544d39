"""``p2pkv plugins``: what is installed, what is not, and why."""

from __future__ import annotations

import argparse
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv.cli_support import make_console, print_json
from p2pkv.contracts import TransportKind
from p2pkv.registry import DISABLE_ENV, TEST_PLUGINS_ENV, Registry, default_registry


def add_parser(sub: Any) -> None:
    p = sub.add_parser("plugins", help="list registered transports and why others are unavailable")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=run)


def plugin_report(registry: Registry) -> dict[str, Any]:
    """Everything ``p2pkv plugins`` shows, as plain data (also used by ``p2pkv doctor``)."""
    rows = []
    kinds: tuple[TransportKind, ...] = ("control", "data")
    for kind in kinds:
        for name, entry in sorted(registry.entries(kind).items()):
            problem = entry.cls.availability()
            rows.append(
                {
                    "name": name,
                    "kind": kind,
                    "distribution": entry.distribution,
                    "version": entry.version,
                    "available": problem is None,
                    "reason": "" if problem is None else str(problem),
                    "capabilities": entry.cls.capabilities.as_dict(),
                }
            )
    missing = [
        {
            "name": name,
            "kind": kind,
            "distribution": dist,
            "install": f"pip install {dist}",
            "disabled": dist in registry.disabled.values(),
            "fix": registry.install_hint(dist),
        }
        for kind, name, dist in registry.missing_known()
    ]
    skipped = [
        {"plugin": name, "distribution": dist, "reason": f"disabled by {DISABLE_ENV}"}
        for name, dist in sorted(registry.disabled.items())
    ] + [
        {
            "plugin": name,
            "distribution": dist,
            "reason": f"test-only, hidden ({TEST_PLUGINS_ENV}=1 loads it)",
        }
        for name, dist in sorted(registry.hidden.items())
    ]
    failures = [
        {"plugin": f.plugin, "distribution": f.distribution, "reason": f.reason}
        for f in registry.failures
    ]
    conflicts = [
        {"kind": kind, "name": name, "distributions": dists}
        for (kind, name), dists in sorted(registry.conflicts.items())
    ]
    return {
        "transports": rows,
        "not_installed": missing,
        "skipped_plugins": skipped,
        "failed_plugins": failures,
        "conflicts": conflicts,
    }


def run(args: argparse.Namespace) -> int:
    report = plugin_report(default_registry())
    if args.json:
        print_json(report)
        return 0
    print_report(make_console(), report)
    return 0


def print_report(console: Console, report: dict[str, Any]) -> None:
    """Render a :func:`plugin_report` (also used by ``p2pkv doctor``)."""
    table = Table(title="p2pkv transports")
    for col in ("name", "kind", "distribution", "version", "status", "capabilities"):
        table.add_column(col)
    for row in report["transports"]:
        caps = ", ".join(k for k, v in row["capabilities"].items() if v is True)
        status = (
            "[green]available[/]"
            if row["available"]
            else f"[red]unavailable[/]: {escape(row['reason'])}"
        )
        table.add_row(row["name"], row["kind"], row["distribution"], row["version"], status, caps)
    for row in report["not_installed"]:
        state = (
            f"[yellow]disabled[/] by {DISABLE_ENV}"
            if row["disabled"]
            else f"[yellow]not installed[/]: {escape(row['fix'])}"
        )
        table.add_row(row["name"], row["kind"], row["distribution"], "-", state, "")
    console.print(table)
    for p in report["skipped_plugins"]:
        console.print(
            f"[yellow]plugin {p['plugin']} ({p['distribution']}) not loaded:[/] "
            f"{escape(p['reason'])}"
        )
    for f in report["failed_plugins"]:
        console.print(
            f"[red]plugin {f['plugin']} ({f['distribution']}) failed:[/] {escape(f['reason'])}"
        )
    for c in report["conflicts"]:
        console.print(
            f"[red]{c['kind']} transport {c['name']!r} refused: claimed by "
            f"{' and '.join(c['distributions'])}[/]"
        )
