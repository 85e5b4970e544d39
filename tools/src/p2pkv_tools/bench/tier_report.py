"""``p2pkv bench --tier`` output: the tier table, the first pulls and the pull-vs-recompute
crossover."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from p2pkv_tools.bench.report import _rate, _ratio, format_size
from p2pkv_tools.bench.tier_bench import TierCellResult
from p2pkv_tools.bench.tier_first_pull import FirstPull

__all__ = [
    "link_summary",
    "overload_summary",
    "print_cost_model",
    "print_crossover",
    "print_first_pulls",
    "print_overload",
    "print_tier_table",
]

_ORDER = {"producer_first": "store→load", "consumer_first": "load→store"}


def link_summary(link: Mapping[str, Any]) -> str:
    """One line naming the link of the JSON's ``link`` (a ``--netns`` veth: its namespaces,
    devices, addresses, rate and UCX_TLS; else one host and its UCX_TLS), so a result is
    never mistaken for the other kind."""
    if link["kind"] != "netns":
        tls = link.get("UCX_TLS")
        return (
            f"one host, UCX_TLS={tls}"
            if tls
            else "one host, UCX_TLS unset (UCX reads the other side's memory over cma where "
            "the kernel allows it)"
        )
    ns, dev, addr = link["namespaces"], link["veth"], link["addresses"]
    shaped = f"shaped to {link['rate']} each way ({link['qdisc']})" if link["rate"] else "unshaped"
    carried = ", ".join(
        f"{phase.replace('_', ' ')} {n / 1e6:,.1f} MB"
        for phase, n in link.get("carried_bytes", {}).items()
        if n is not None
    )
    return (
        f"veth {dev['producer']} {addr['producer']} in {ns['producer']} (producer) ⇄ "
        f"{dev['consumer']} {addr['consumer']} in {ns['consumer']} (consumer), {shaped}, "
        f"UCX_TLS={link['env']['producer'].get('UCX_TLS')}"
        + (f"; producer → consumer carried: {carried}" if carried else "")
    )


def print_tier_table(console: Console, rows: Sequence[TierCellResult], title: str) -> None:
    """Per data transport: GB/s, the ratio to the fastest raw baseline of the cell and which
    one it is (a footnote says so), the ratio to memcpy, the consumer's submit_load -> result
    p50/p99 µs and CPU µs per request on each side (descriptors per request when the tier
    reports them), one row per cell and arrival order; then every failed cell."""
    for data in sorted({r.transport for r in rows}):
        own = sorted(
            (r for r in rows if r.transport == data),
            key=lambda r: (r.block_size, r.batch, r.concurrency, r.order),
        )
        described = any(r.descriptors_per_request is not None for r in own)
        table = Table(title=f"{title}: tier {data}", title_justify="left")
        cols = [
            "block",
            "batch",
            "conc",
            "order",
            "GB/s",
            "/raw",
            "raw",
            "/memcpy",
            "p50 / p99 µs",
            "CPU µs/req\nprod / cons",
            *(["desc/req"] if described else []),
        ]
        for col in cols:
            table.add_column(col, justify="right")
        for r in own:
            cost = f"{r.producer_cpu_us:.0f} / {r.consumer_cpu_us:.0f}" if r.gbps else ""
            lat = f"{r.p50_us:.0f} / {r.p99_us:.0f}" if r.gbps else ""
            desc = (
                [
                    f"{r.descriptors_per_request:.1f}"
                    if r.descriptors_per_request is not None
                    else ""
                ]
                if described
                else []
            )
            order = _ORDER.get(r.order, r.order) + (" overload" if r.overload else "")
            raw = escape((r.raw_series or "").removeprefix("raw "))
            table.add_row(
                format_size(r.block_size),
                str(r.batch),
                str(r.concurrency),
                order,
                _rate(r),
                _ratio(r.ratio_raw),
                raw,
                _ratio(r.ratio_memcpy),
                lat,
                cost,
                *desc,
            )
        console.print(table)
        console.print(_raw_footnote(data, own))
        if not described:
            console.print(
                "descriptors per request: not reported (this data transport does "
                "not count descriptors_posted)"
            )
    for r in rows:
        if r.error:
            console.print(
                f"[red]{escape(r.series)} {format_size(r.block_size)} x{r.batch} "
                f"c{r.concurrency}:[/] {escape(r.error)}"
            )


def _raw_footnote(data: str, rows: Sequence[TierCellResult]) -> str:
    """What ``/raw`` and ``raw`` mean in ``data``'s tier table, naming the baselines."""
    measured = sorted({s for r in rows for s in r.ratios_raw})
    if not measured:
        return f"/raw: no raw {escape(data)} baseline measured in this run"
    return (
        f"/raw: GB/s over the fastest raw baseline of the same cell, named under raw, "
        f"round by round beside it, the median of the rounds (measured: "
        f"{escape(', '.join(measured))}; the JSON's ratios_raw and pair_ratios have each)"
    )


def print_first_pulls(console: Console, pulls: Sequence[FirstPull]) -> None:
    """One row per data transport: the cold first pull (its handshake and transfer parts),
    the connect and the first pull after it, the session ``peers.connect`` opened by name
    and the first pull after it, medians in ms over the fresh pairs; then every failed
    pair."""
    table = Table(
        title="first pull between fresh peers (submit_load → result, ms, median)",
        title_justify="left",
    )
    cols = [
        "data",
        "block",
        "blocks",
        "pairs",
        "cold",
        "handshake",
        "transfer",
        "connect",
        "after connect",
        "discovery",
        "after discovery",
    ]
    for col in cols:
        table.add_column(col, justify="right")
    for pull in pulls:
        row = pull.as_row()
        keys = (
            "first_pull_ms",
            "first_pull_handshake_ms",
            "first_pull_transfer_ms",
            "connect_ms",
            "first_pull_after_connect_ms",
            "discovery_ms",
            "first_pull_after_discovery_ms",
        )
        table.add_row(
            escape(pull.transport),
            format_size(pull.block_size),
            str(pull.blocks),
            str(len(pull.cold_ms) + len(pull.errors)),
            *("" if row[k] is None else f"{row[k]:.1f}" for k in keys),
        )
    console.print(table)
    for pull in pulls:
        for error in pull.errors:
            console.print(f"[red]first pull {escape(pull.transport)}:[/] {escape(error)}")


def print_crossover(console: Console, doc: Mapping[str, Any]) -> None:
    """One line per arrival order: the prompt length above which pulling beats recomputing."""
    console.print(
        f"pull vs recompute, {escape(doc['preset'])} "
        f"({doc['bytes_per_token']:,.0f} B/token; a block: {escape(doc['formula'])}), "
        f"recompute {doc['recompute_tokens_per_s']:,.0f} tokens/s:"
    )
    for o in doc["orders"]:
        name = _ORDER.get(o["order"], o["order"])
        if o["tokens"] is None:
            console.print(f"  {name}: {escape(o['why'])}")
            continue
        fit = f"fit at {format_size(o['block_size'])} blocks: {o['fixed_us']:.0f} µs fixed" + (
            f" + {o['gbps_marginal']:.2f} GB/s" if o["gbps_marginal"] else ""
        )
        console.print(
            f"  {name}: pull beats recompute above [bold]{o['tokens']:,}[/] prompt tokens ({fit})"
        )


def print_cost_model(console: Console, doc: Mapping[str, Any]) -> None:
    """The crossover fit in the units of llm-d's router, as YAML to paste into the EPP's
    ``p2p-source-producer`` parameters: one block per arrival order that has a fit."""
    for o in doc["orders"]:
        model = o.get("cost_model")
        if not model:
            continue
        name = _ORDER.get(o["order"], o["order"])
        lines = [
            f"# llm-d EPP p2p-source-producer, from p2pkv bench --tier ({name}, "
            f"{doc['preset']}, {doc['recompute_tokens_per_s']:,.0f} tokens/s recompute)",
            f"minCachedTokenDelta: {model['minCachedTokenDelta']}",
            "costModel:",
        ]
        lines += [
            f"  {key}: {model[key]}"
            for key in (
                "prefillMicrosecondsPerToken",
                "transferMicrosecondsPerToken",
                "transferFixedMs",
            )
        ]
        lines.append(
            "  # sourceWaitMs, requeueMs: not measured here (a busy source engine, "
            "the router's requeue); see docs/benchmarks.md"
        )
        console.print("\n".join(escape(line) for line in lines), highlight=False)


def overload_summary(rows: Sequence[TierCellResult]) -> list[dict[str, Any]]:
    """Per data transport, block size and batch with an overload cell: the unloaded peak
    (the best GB/s over the other cells, and that cell's p99) next to the overload cell's
    GB/s and p99, and their ratio. A skipped or failed overload cell is left out (the tier
    table shows why)."""
    out = []
    for r in rows:
        if not r.overload or r.gbps <= 0:
            continue
        peers = [
            u
            for u in rows
            if not u.overload
            and u.gbps > 0
            and (u.transport, u.block_size, u.batch) == (r.transport, r.block_size, r.batch)
        ]
        peak = max(peers, key=lambda u: u.gbps, default=None)
        out.append(
            {
                "transport": r.transport,
                "block_size": r.block_size,
                "batch": r.batch,
                "overload_concurrency": r.concurrency,
                "overload_gbps": r.gbps,
                "overload_p99_us": r.p99_us,
                "peak_gbps": peak.gbps if peak else None,
                "peak_concurrency": peak.concurrency if peak else None,
                "peak_p99_us": peak.p99_us if peak else None,
                "of_peak": r.gbps / peak.gbps if peak and r.gbps else None,
            }
        )
    return out


def print_overload(console: Console, summary: Sequence[Mapping[str, Any]]) -> None:
    """The overload summary (see :func:`overload_summary`), one row per cell."""
    table = Table(
        title="under overload (offered load above the flow window) vs unloaded peak",
        title_justify="left",
    )
    for col in (
        "data",
        "block",
        "batch",
        "peak GB/s (conc)",
        "peak p99 µs",
        "overload GB/s (conc)",
        "overload p99 µs",
        "of peak",
    ):
        table.add_column(col, justify="right")
    for o in summary:
        peak = (
            f"{o['peak_gbps']:.2f} ({o['peak_concurrency']})" if o["peak_gbps"] is not None else ""
        )
        table.add_row(
            escape(o["transport"]),
            format_size(o["block_size"]),
            str(o["batch"]),
            peak,
            f"{o['peak_p99_us']:.0f}" if o["peak_p99_us"] is not None else "",
            f"{o['overload_gbps']:.2f} ({o['overload_concurrency']})",
            f"{o['overload_p99_us']:.0f}",
            f"{o['of_peak']:.0%}" if o["of_peak"] is not None else "",
        )
    console.print(table)
