"""Which UCX transports ("lanes") NIXL picks here, for ``p2pkv nixl-lanes`` and ``p2pkv doctor``.

UCX decides per operation and message size which of its transports carries the bytes: on one
host a READ should go ``zero-copy | cma/memory`` (one kernel copy, process to process, done by
the reader itself) with wire-up messages over ``tcp``; a wrong ``UCX_TLS``/``UCX_NET_DEVICES``
silently costs bandwidth (``UCX_TLS=tcp`` gives about a third of cma's throughput here) and
makes the transport read through its staging pool (see :mod:`p2pkv_nixl.locality`).
:func:`ucx_lanes` runs one tiny READ between two ``nixl`` transports in a subprocess with
``UCX_PROTO_INFO=y`` and parses the protocol tables UCX prints, so the answer reflects the real
environment (``UCX_*`` variables, installed UCX modules). The probe is intra-node: lanes to
another host may differ.

UCX variables that matter (see the README): ``UCX_TLS`` (leave unset or ``all``; it must keep
an active-message transport such as ``tcp``: ``shm`` or ``cma`` alone fail at agent creation),
``UCX_NET_DEVICES`` (``lo`` for loopback tests, else UCX also stripes TCP over external
interfaces), ``UCX_RCACHE_MAX_UNRELEASED`` (set to 1024 unless already set).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

from p2pkv.ucx_proto import parse_proto_info

from p2pkv_nixl import library

__all__ = ["UCX_VARS", "add_parser", "proto_tables", "ucx_lanes"]

UCX_VARS = ("UCX_TLS", "UCX_NET_DEVICES", "UCX_RCACHE_MAX_UNRELEASED")


def proto_tables(text: str) -> list[dict[str, Any]]:
    """The protocol tables in UCX output (``UCX_PROTO_INFO=y``), endpoints to self left out.

    Each becomes ``{"context": "<name> <scope> cfg#N", "scope", "operation", "rows":
    [{"range", "protocol", "lane"}]}`` (the rows come from ``p2pkv.ucx_proto``'s parser).
    """
    tables: dict[tuple[str, str], dict[str, Any]] = {}
    for row in parse_proto_info(text):
        words = row.endpoint.split()
        table = tables.setdefault(
            (row.endpoint, row.operation),
            {
                "context": row.endpoint,
                "scope": " ".join(words[1:-1]),
                "operation": row.operation,
                "rows": [],
            },
        )
        table["rows"].append({"range": row.size_range, "protocol": row.protocol, "lane": row.lanes})
    return list(tables.values())


def _lanes(tables: Sequence[Mapping[str, Any]], operation_prefix: str) -> list[str]:
    found: list[str] = []
    for table in tables:
        if not table["operation"].startswith(operation_prefix):
            continue
        for row in table["rows"]:
            if row["lane"] not in found:
                found.append(row["lane"])
    return found


def ucx_lanes(options: Mapping[str, Any] | None = None, timeout: float = 60.0) -> dict[str, Any]:
    """Probe the lanes a ``nixl`` transport with ``options`` (data_options) uses on this host.

    Returns ``{"ok", "error", "env", "get", "am", "lane", "tables"}``: ``get`` lists the
    lanes that carry a read's bytes (e.g. ``["cma/memory"]``): those of remote memory reads,
    or, for a staged read (the producer WRITEs into the reader's staging pool, see
    :mod:`p2pkv_nixl.transport`), those of remote memory writes; ``am`` those of active messages
    (wire-up; e.g. ``["tcp/lo"]``), ``lane`` how the transport lands reads from a same-host
    peer (``"direct"`` or ``"staged"``, see ``NixlDataTransport.lane``), ``env`` the
    ``UCX_*`` variables the probe ran with. Never raises; a probe that fails says why in
    ``error``.
    """
    env = dict(os.environ)
    library.apply_ucx_defaults(env)
    report: dict[str, Any] = {
        "ok": False,
        "error": "",
        "env": {k: env.get(k) for k in UCX_VARS},
        "get": [],
        "am": [],
        "lane": "",
        "tables": [],
    }
    problem = library.problem()
    if problem is not None:
        report["error"] = str(problem)
        return report
    env["UCX_PROTO_INFO"] = "y"
    command = [sys.executable, "-m", "p2pkv_nixl.ucx", "--probe", json.dumps(dict(options or {}))]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        report["error"] = f"probe did not finish: {exc}"
        return report
    tables = proto_tables(done.stdout + "\n" + done.stderr)
    report["tables"] = tables
    report["get"] = _lanes(tables, "remote memory read") or _lanes(tables, "remote memory write")
    report["am"] = _lanes(tables, "active message")
    report["lane"] = next(
        (line.split()[1] for line in done.stdout.splitlines() if line.startswith("LANE ")), ""
    )
    if done.returncode != 0:
        last = (done.stderr or done.stdout or "?").strip().splitlines()[-1]
        report["error"] = f"probe exited {done.returncode}: {last}"
    elif not report["get"]:
        report["error"] = "UCX printed no protocol table for remote reads"
    else:
        report["ok"] = True
    return report


def _probe(options: Mapping[str, Any], timeout: float = 20.0) -> None:
    """Subprocess side: one 4 KiB READ between two transports of this process; prints
    ``LANE <direct|staged>`` (the reader's lane for its peer)."""
    import numpy as np
    from p2pkv.contracts import DataSettings

    from p2pkv_nixl.transport import NixlDataTransport

    block_len = 4096
    regions = [np.full(2 * block_len, fill, dtype=np.uint8) for fill in (1, 0)]
    source, reader = (
        NixlDataTransport.create(DataSettings(r.data, block_len, options)) for r in regions
    )
    reader.add_peer("source", source.descriptor())
    source.add_peer("reader", reader.descriptor())  # it serves a staged read with a WRITE
    print(f"LANE {reader.lane('source')}", flush=True)
    transfer_id = reader.read_blocks("source", [1], [0])
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        source.progress()
        result = reader.poll("source")
        if transfer_id in result.failed:
            raise SystemExit("probe READ failed")
        if transfer_id in result.done:
            break
    else:
        raise SystemExit("probe READ did not complete")
    if not (regions[1][block_len:] == 1).all():
        raise SystemExit("probe READ landed wrong bytes")
    reader.close()
    source.close()


def add_parser(sub: Any) -> None:
    p = sub.add_parser("nixl-lanes", help="show which UCX transports NIXL uses on this host")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--options", default="{}", help="nixl data_options as JSON (default {})")
    p.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    report = ucx_lanes(json.loads(args.options))
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
        return 0 if report["ok"] else 1
    for key, value in report["env"].items():
        print(f"{key}={value if value is not None else '(unset)'}")
    if not report["ok"]:
        print(f"probe failed: {report['error']}")
        return 1
    print(f"remote reads: {', '.join(report['get'])}")
    print(f"active messages: {', '.join(report['am'])}")
    print(f"same-host reads land: {report['lane'] or '?'}")
    if "cma/memory" not in report["get"]:
        print(
            "note: reads do not use cma on this host; check UCX_TLS (unset or 'all' picks "
            "cma); the transport then reads through its staging pool"
        )
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--probe":
        _probe(json.loads(sys.argv[2]))
    else:
        sys.exit(f"usage: {sys.argv[0]} --probe OPTIONS_JSON (internal; use `p2pkv nixl-lanes`)")
