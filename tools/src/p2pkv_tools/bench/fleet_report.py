"""Tables of ``p2pkv bench --fleet``: on the terminal, and as the markdown of docs/scale.md.

``python -m p2pkv_tools.bench.fleet_report RUN.json [RUN.json ...]`` prints the markdown
tables of each run (its label, date, host load and command first), so the doc's tables are
refreshed from the JSON by one command.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

__all__ = ["FLOOD_COLUMNS", "SIZE_COLUMNS", "flood_summary", "main", "markdown", "print_fleet"]

SIZE_COLUMNS = (
    ("peers", "peers"),
    ("idle_cpu_pct", "idle CPU % of a core"),
    ("idle_cpu_per_tick_us", "idle CPU/tick µs"),
    ("idle_tick_thread_us", "tick thread CPU/tick µs"),
    ("idle_ticks_per_s", "ticks/s"),
    ("idle_calls_per_tick", "idle calls/tick"),
    ("cpu_per_request_us", "CPU/request µs"),
    ("cpu_above_idle_per_request_us", "above idle µs"),
    ("fds", "fds"),
    ("threads", "threads"),
    ("rss_mib", "RSS MiB"),
    ("heartbeat_segments_per_s", "heartbeat segments/s"),
    ("warm_s", "warm mesh s"),
    ("warm_sessions", "sessions reached"),
    ("idle_sessions", "sessions idle"),
    ("rate_p99_ms", "p99 at rate ms"),
    ("cold_p50_ms", "cold p50 ms"),
    ("cold_p99_ms", "cold p99 ms"),
    ("load_avg", "load avg"),
)
"""(JSON key, heading) of the per-N table, in order."""

FLOOD_COLUMNS = (
    ("kind", "flood"),
    ("round", "round"),
    ("names", "names"),
    ("established_rps_alone", "established req/s alone"),
    ("established_rps_alone_runs", "alone before → after"),
    ("established_rps_flooded", "req/s flooded"),
    ("ratio", "ratio"),
    ("cpu_pct_alone", "CPU % alone"),
    ("cpu_pct_flooded", "CPU % flooded"),
    ("newcomer_outcomes", "newcomer's first loads"),
    ("newcomer_p99_ms", "newcomer p99 ms"),
    ("flood_us_per_name", "thread CPU µs a flood name"),
    ("flood_zmq_dials", "zmq dials in the flooded run"),
    ("flood_reach_checks", "reach checks in the flooded run"),
    ("tick_us_alone", "thread CPU µs a tick, alone"),
    ("tick_us_flooded", "thread CPU µs a tick, flooded"),
)
"""(JSON key, heading) of the floods table, in order."""


def flood_summary(floods: Sequence[dict[str, Any]]) -> list[str]:
    """One line per kind of flood: its ratios in order, their median and the lowest; then
    the runs alone, and each one between two others read as a flood's ratio is, against
    the mean of its neighbours: the ratio of no flood at all, the host's swing that one
    flood's ratio carries too."""
    lines = []
    for kind in dict.fromkeys(row["kind"] for row in floods):
        ratios = [row["ratio"] for row in floods if row["kind"] == kind]
        known = [r for r in ratios if r is not None]
        line = f"{kind}: ratios {', '.join(_cell(r) for r in ratios)}"
        if known:
            line += f" (median {statistics.median(known):.3g}, lowest {min(known):g})"
        lines.append(line)
    alone = [row["established_rps_alone_runs"] for row in floods]
    runs = [*alone[0][:1], *(pair[-1] for pair in alone)] if alone else []
    nulls = [runs[i] / ((runs[i - 1] + runs[i + 1]) / 2) for i in range(1, len(runs) - 1)]
    if nulls and min(runs) > 0:
        lines.append(
            f"alone, {len(runs)} runs: {', '.join(_cell(r) for r in runs)} req/s; each "
            f"between two, as a ratio to their mean (no flood at all): "
            f"{', '.join(f'{n:.3g}' for n in nulls)} (median {statistics.median(nulls):.3g})"
        )
    return lines


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, dict):
        return ", ".join(f"{v} {k}" for k, v in sorted(value.items())) or "-"
    if isinstance(value, list):
        return " → ".join(_cell(v) for v in value)
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def _rows(items: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> list[list[str]]:
    return [[_cell(item.get(key)) for key, _ in columns] for item in items]


def print_fleet(console: Console, doc: dict[str, Any], title: str) -> None:
    """The per-N table and the floods table."""
    for items, columns, name in (
        (doc["sizes"], SIZE_COLUMNS, "per fleet size"),
        (doc["floods"], FLOOD_COLUMNS, "floods"),
    ):
        if not items:
            continue
        table = Table(title=f"{title}: {name}")
        for _, heading in columns:
            table.add_column(heading, justify="right")
        for row in _rows(items, columns):
            table.add_row(*row)
        console.print(table)
    for line in flood_summary(doc["floods"]):
        console.print(line)


def _markdown_table(items: Sequence[dict[str, Any]], columns: Sequence[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(h for _, h in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(items, columns)]
    return "\n".join(lines)


def markdown(doc: dict[str, Any]) -> str:
    """One run as markdown: where and when it ran, then its tables."""
    host = doc.get("host", {})
    head = (
        f"**{doc.get('label') or 'run'}**: `{doc.get('command', '')}`, "
        f"{doc.get('date', '?')}, {host.get('cores', '?')} cores, load average "
        f"{_cell(doc.get('load_avg'))} (start, end), {doc.get('elapsed_s', '?')} s."
    )
    cores = doc.get("placement")
    if cores:
        tut, peers = (", ".join(map(str, cores[role])) for role in ("tut", "peers"))
        head += f" Tier under test pinned to core {tut}, peers to {peers}."
    parts = [head, "", _markdown_table(doc["sizes"], SIZE_COLUMNS)]
    if doc.get("floods"):
        parts += ["", _markdown_table(doc["floods"], FLOOD_COLUMNS), ""]
        parts += [f"- {line}" for line in flood_summary(doc["floods"])]
    return "\n".join(parts) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    paths = list(sys.argv[1:] if argv is None else argv)
    if not paths:
        sys.stderr.write("usage: python -m p2pkv_tools.bench.fleet_report RUN.json ...\n")
        return 2
    for path in paths:
        with open(path, encoding="utf-8") as f:
            sys.stdout.write(markdown(json.load(f)) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
