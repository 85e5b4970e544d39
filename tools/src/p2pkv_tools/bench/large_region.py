"""``p2pkv bench --large-region``: a large CPU tier registered in slices, read byte-exact.

Per lane (``nixl`` on one host, UCX's ``cma`` lane with direct READs; ``nixl-tcp``, the same
with ``UCX_TLS=tcp``, nixl's staged lane; ``ucx``) and per slice size (the transports'
default, :func:`p2pkv.runs.default_slice_bytes`, and the region in one slice), two fresh
processes each create the transport over a region of ``region_bytes`` (6 GiB by default,
from the transport's ``allocate_region``, never written whole: only the blocks measured are
touched), add each other, and the consumer reads runs of ``run_blocks`` blocks from the
producer in *offset classes*:

==================  ===========================================================
class               which blocks
==================  ===========================================================
``start``           the first ``run_blocks`` blocks, into the consumer's first
``past 4 GiB``      the first blocks at or past byte 4 GiB (32-bit offsets overflow)
``across slices``   a run straddling the producer's first slice boundary, read into
                    a run straddling the consumer's last one (``mid-region`` when
                    the region is one slice)
``end``             the last blocks of the region
``scattered``       blocks at random over the whole region, into random slots
==================  ===========================================================

Each class is read ``reps`` times after one untimed read (the destination blocks faulted in
beforehand), every byte checked after every read (key-derived content, consumed by the
check). Reported per lane and slice size: the slices, the time of each side's ``create``
over the large region (the registration) next to one over a region of one block (the
transport's fixed setup), ``add_peer``, each side's RSS afterwards, and per class the median
GB/s with its range, and whether every byte matched.
A read that fails, times out or lands a wrong byte marks the row (exit status 1).
"""

from __future__ import annotations

import contextlib
import os
import statistics
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from p2pkv.runs import default_slice_bytes, per_slice, region_slice_starts

from p2pkv_tools.bench.harness import Helper, HelperError
from p2pkv_tools.bench.hostinfo import describe_host, environ_restored
from p2pkv_tools.bench.large_region_side import run_side

__all__ = [
    "LANES",
    "LargeRegionConfig",
    "OffsetClass",
    "offset_classes",
    "render",
    "run_large_region",
]

MiB = 1024 * 1024
GiB = 1024 * MiB
FOUR_GIB = 4 * GiB
LANES: dict[str, tuple[str, dict[str, str]]] = {
    "nixl": ("nixl", {}),
    "nixl-tcp": ("nixl", {"UCX_TLS": "tcp"}),
    "ucx": ("ucx", {}),
}
"""Lane -> (data transport, environment of both sides)."""
WHOLE = 0
"""A ``slice_bytes`` entry: the region in one slice (``slice_bytes`` = the region's size)."""
DEFAULT = -1
"""A ``slice_bytes`` entry: no option, the transports' default (``P2PKV_SLICE_BYTES``)."""
PRODUCER, CONSUMER = "producer", "consumer"


@dataclass(frozen=True)
class LargeRegionConfig:
    """What one run measures (sizes in bytes; ``slice_bytes`` entries: a size,
    :data:`DEFAULT` or :data:`WHOLE`)."""

    region_bytes: int = 6 * GiB
    block_len: int = 2 * MiB
    run_blocks: int = 16
    reps: int = 3
    slice_bytes: tuple[int, ...] = (WHOLE, DEFAULT)
    lanes: tuple[str, ...] = tuple(LANES)
    deadline: float = 120.0
    seed: int = 0

    @property
    def num_blocks(self) -> int:
        return self.region_bytes // self.block_len

    def slice_size(self, entry: int) -> int:
        """The slice size an entry of ``slice_bytes`` stands for."""
        if entry == WHOLE:
            return self.num_blocks * self.block_len
        return default_slice_bytes() if entry == DEFAULT else entry

    def check(self) -> None:
        """``ValueError`` naming what is wrong: unknown lanes, too few blocks for a run at
        every class, a size that is not positive."""
        unknown = sorted(set(self.lanes) - set(LANES))
        if unknown:
            raise ValueError(f"unknown lane(s) {unknown}: choose from {', '.join(LANES)}")
        if min(self.block_len, self.run_blocks, self.reps) < 1 or self.block_len % 8:
            raise ValueError("block size (a multiple of 8), run and reps must be positive")
        if self.num_blocks < 4 * self.run_blocks:
            raise ValueError(
                f"a region of {self.region_bytes} B holds fewer than 4 runs of "
                f"{self.run_blocks} blocks of {self.block_len} B"
            )


@dataclass(frozen=True)
class OffsetClass:
    """Blocks of the producer (``remote``) read into blocks of the consumer (``local``)."""

    name: str
    remote: tuple[int, ...]
    local: tuple[int, ...]


def _run(first: int, n: int) -> tuple[int, ...]:
    return tuple(range(first, first + n))


def offset_classes(
    num_blocks: int, block_len: int, slice_blocks: int, run: int, seed: int = 0
) -> list[OffsetClass]:
    """The classes of the module docstring for a region of ``num_blocks`` blocks registered
    in slices of ``slice_blocks`` (``past 4 GiB`` only when the region reaches past it)."""
    classes = [OffsetClass("start", _run(0, run), _run(0, run))]
    past = -(-FOUR_GIB // block_len)
    if past + run <= num_blocks:
        classes.append(OffsetClass("past 4 GiB", _run(past, run), _run(past, run)))
    starts = region_slice_starts(num_blocks, slice_blocks)
    if len(starts) > 1:
        first, last = int(starts[1]), int(starts[-1])
        classes.append(
            OffsetClass("across slices", _run(first - run // 2, run), _run(last - run // 2, run))
        )
    else:
        middle = _run(num_blocks // 2 - run // 2, run)
        classes.append(OffsetClass("mid-region", middle, middle))
    classes.append(OffsetClass("end", _run(num_blocks - run, run), _run(num_blocks - run, run)))
    rng = np.random.default_rng(seed)
    picks = rng.choice(num_blocks, size=2 * run, replace=False).tolist()
    classes.append(OffsetClass("scattered", tuple(picks[:run]), tuple(picks[run:])))
    return classes


@contextlib.contextmanager
def _sides(transport: str, env: Mapping[str, str], deadline: float) -> Iterator[list[Helper]]:
    """A producer and a consumer helper of ``transport``, spawned with ``env`` added to
    this process's environment; stopped afterwards."""
    helpers: list[Helper] = []
    try:
        with environ_restored():
            os.environ.update(env)
            for role in (PRODUCER, CONSUMER):
                helpers.append(
                    Helper(
                        run_side,
                        (transport,),
                        name=f"p2pkv-large-{role}",
                        daemon=True,
                        timeout=deadline,
                    )
                )
        yield helpers
    finally:
        for helper in helpers:
            helper.stop()


def _measure_class(
    producer: Helper,
    consumer: Helper,
    cls: OffsetClass,
    config: LargeRegionConfig,
    seeds: Sequence[int],
) -> dict[str, Any]:
    """One class: fill, one untimed read, ``reps`` timed ones, every byte checked."""
    producer.call("fill", list(cls.remote), list(seeds))
    consumer.call("fill", list(cls.local), [s ^ 0x5A5A for s in seeds])  # fault pages in
    nbytes = len(cls.remote) * config.block_len
    times, wrong = [], 0
    producer.call("begin")
    try:
        for rep in range(config.reps + 1):
            seconds = consumer.call(
                "read", PRODUCER, list(cls.local), list(cls.remote), config.deadline
            )
            wrong += consumer.call("verify", list(cls.local), list(seeds))
            if rep:
                times.append(seconds)
    finally:
        failed = producer.call("end")
    rates = [nbytes / t / 1e9 for t in times]
    error = (
        f"{wrong} block(s) with wrong bytes"
        if wrong
        else f"the producer reported {failed} failure(s)"
        if failed
        else ""
    )
    return {
        "name": cls.name,
        "remote_first": cls.remote[0],
        "local_first": cls.local[0],
        "blocks": len(cls.remote),
        "bytes": nbytes,
        "gbps": statistics.median(rates),
        "gbps_min": min(rates),
        "gbps_max": max(rates),
        "verified": not error,
        "error": error,
    }


def run_lane(lane: str, entry: int, config: LargeRegionConfig) -> dict[str, Any]:
    """One lane at one slice size (an entry of ``config.slice_bytes``): its report row."""
    transport, env = LANES[lane]
    size = config.slice_size(entry)
    options = {} if entry == DEFAULT else {"slice_bytes": size}
    slice_blocks = min(per_slice(size, config.block_len), config.num_blocks)
    row: dict[str, Any] = {
        "lane": lane,
        "transport": transport,
        "env": env,
        "slice_bytes": size,
        "slice_option": "default" if entry == DEFAULT else "whole" if entry == WHOLE else size,
        "slices": -(-config.num_blocks // slice_blocks),
        "classes": [],
        "error": "",
    }
    try:
        with _sides(transport, env, config.deadline) as (producer, consumer):
            built = {
                role: helper.call("build", config.num_blocks, config.block_len, options)
                for role, helper in ((PRODUCER, producer), (CONSUMER, consumer))
            }
            row["add_peer_ms"] = {
                PRODUCER: producer.call("add_peer", CONSUMER, built[CONSUMER]["descriptor"]) * 1e3,
                CONSUMER: consumer.call("add_peer", PRODUCER, built[PRODUCER]["descriptor"]) * 1e3,
            }
            row["create_ms"] = {r: b["create_s"] * 1e3 for r, b in built.items()}
            row["create_one_block_ms"] = {
                r: b["create_one_block_s"] * 1e3 for r, b in built.items()
            }
            classes = offset_classes(
                config.num_blocks, config.block_len, slice_blocks, config.run_blocks, config.seed
            )
            for index, cls in enumerate(classes):
                first = (config.seed << 32) + (index << 20) + 1
                seeds = list(range(first, first + len(cls.remote)))
                row["classes"].append(_measure_class(producer, consumer, cls, config, seeds))
            row["rss"] = {PRODUCER: producer.call("rss"), CONSUMER: consumer.call("rss")}
    except HelperError as exc:
        row["error"] = str(exc)
    if not row["error"]:
        row["error"] = "; ".join(f"{c['name']}: {c['error']}" for c in row["classes"] if c["error"])
    return row


def run_large_region(
    config: LargeRegionConfig, progress: Callable[[str], None] = lambda line: None
) -> dict[str, Any]:
    """Every lane at every slice size: the JSON document (``host``, ``config``, ``rows``)."""
    config.check()
    rows = []
    for lane in config.lanes:
        for entry in config.slice_bytes:
            row = run_lane(lane, entry, config)
            progress(
                f"{lane}, slices of {row['slice_bytes'] / GiB:.2f} GiB: "
                + (row["error"] or "every byte verified")
            )
            rows.append(row)
    return {"host": describe_host(), "config": asdict(config), "rows": rows}


def _ms(pair: Mapping[str, float] | None) -> str:
    return "-" if not pair else f"{pair[PRODUCER]:.1f} / {pair[CONSUMER]:.1f}"


def render(doc: Mapping[str, Any]) -> str:
    """The report as a Markdown table: one line per lane, slice size and offset class."""
    config = doc["config"]
    lines = [
        f"region {config['region_bytes'] / GiB:.2f} GiB per side, blocks of "
        f"{config['block_len'] // 1024} KiB, runs of {config['run_blocks']} blocks, "
        f"{config['reps']} timed reads per class",
        "",
        "| lane | slices | create ms: region, one block (producer / consumer) | "
        "add_peer ms | class | first block (remote / local) | GB/s median (min-max) | "
        "verified |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in doc["rows"]:
        head = (
            f"| {row['lane']} | {row['slices']} x {row['slice_bytes'] / GiB:.2f} GiB "
            f"({row['slice_option']}) | {_ms(row.get('create_ms'))}, "
            f"{_ms(row.get('create_one_block_ms'))} | "
            f"{_ms(row.get('add_peer_ms'))} |"
        )
        if not row["classes"]:
            lines.append(f"{head} - | - | - | FAILED: {row['error']} |")
        for cls in row["classes"]:
            lines.append(
                f"{head} {cls['name']} | {cls['remote_first']} / {cls['local_first']} | "
                f"{cls['gbps']:.2f} ({cls['gbps_min']:.2f}-{cls['gbps_max']:.2f}) | "
                f"{'yes' if cls['verified'] else 'NO: ' + cls['error']} |"
            )
            head = "| | | | |"
        rss = row.get("rss")
        if rss:
            lines.append(
                f"| | | | | RSS after (MiB) | {rss[PRODUCER] / MiB:.0f} / "
                f"{rss[CONSUMER] / MiB:.0f} | | |"
            )
    return "\n".join(lines)
